"""The Engine alone: requests of several clients fed to the Generator as one batch, results
matching `Generator.generate`, bad requests refused before the stream, stop."""

from __future__ import annotations

import pytest

from tidal.generate import Generator, GeneratorConfig, SamplingParams
from tidal.serve.engine import Engine


def test_requests_waiting_together_run_as_one_batch(tiny_model, chat_tokenizer):
    gen = Generator(tiny_model, tokenizer=chat_tokenizer, config=GeneratorConfig(max_batch=16))
    engine = Engine(gen)
    prompts = [[0, 40 + i, 41] for i in range(6)]
    params = [SamplingParams(n=2, max_new_tokens=10, seed=i) for i in range(6)]
    futures = [engine.submit([p], [q]) for p, q in zip(prompts, params, strict=True)]
    engine.start()  # all six wait in the queue: the first feed takes them together
    try:
        groups = [f.result(timeout=60)[0] for f in futures]
    finally:
        engine.stop()
    assert engine.stats.batches_fed == 1 and engine.stats.largest_batch == 6
    assert engine.stats.max_in_flight == 6 and engine.stats.requests == 6
    assert gen.stats.prefill_calls == 1  # one prefill for all six clients' prompts
    # The same samples as the Python API gives for the same requests.
    direct = Generator(tiny_model, tokenizer=chat_tokenizer, config=GeneratorConfig(max_batch=16))
    expected = direct.generate(prompts, params)
    for got, want in zip(groups, expected, strict=True):
        assert [s.completion_ids for s in got] == [s.completion_ids for s in want]


def test_requests_fed_together_are_numbered_and_heard_each_as_its_own(tiny_model, chat_tokenizer):
    """Two clients' requests in one fed batch, one of two prompts: each result's prompts are
    numbered from 0 in its own request, and each listener hears only its own samples, under
    its own prompt numbers, as a prefix of the tokens it gets."""
    config = GeneratorConfig(max_batch=16, check_every=2)
    engine = Engine(Generator(tiny_model, tokenizer=chat_tokenizer, config=config))
    heard: list[dict] = [{}, {}]

    def listener(k):
        return lambda i, j, ids: heard[k].setdefault((i, j), []).extend(ids)

    params = SamplingParams(max_new_tokens=12, stop_token_ids=())
    first = engine.submit([[0, 40, 41]], [params], listener(0))
    second = engine.submit([[0, 50], [0, 51, 52]], [params, params], listener(1))
    engine.start()
    try:
        results = [first.result(timeout=60), second.result(timeout=60)]
    finally:
        engine.stop()
    assert engine.stats.batches_fed == 1
    for k, groups in enumerate(results):
        assert [g[0].prompt_index for g in groups] == list(range(len(groups)))
        assert sorted(heard[k]) == [(i, 0) for i in range(len(groups))]
        for (i, j), ids in heard[k].items():
            assert ids and groups[i][j].completion_ids[: len(ids)] == ids


def test_bad_requests_fail_at_submit_and_stop_refuses_more(tiny_model, chat_tokenizer):
    gen = Generator(tiny_model, tokenizer=chat_tokenizer, config=GeneratorConfig(max_batch=4))
    engine = Engine(gen)
    engine.start()
    with pytest.raises(ValueError, match="max_batch"):
        engine.submit([[0, 5]], [SamplingParams(n=5)])
    with pytest.raises(ValueError, match="exceeds"):
        engine.submit([[0, 5]], [SamplingParams(max_new_tokens=gen.capacity)])
    ok = engine.submit([[0, 5]], [SamplingParams(max_new_tokens=3)])
    assert len(ok.result(timeout=60)[0]) == 1
    engine.stop()
    assert engine.stats.restarts == 0
    with pytest.raises(RuntimeError, match="stopped"):
        engine.submit([[0, 5]], [SamplingParams()])


def test_an_engine_failure_fails_the_requests_in_flight_and_serves_on(
    tiny_model, chat_tokenizer, monkeypatch
):
    gen = Generator(tiny_model, tokenizer=chat_tokenizer, config=GeneratorConfig(max_batch=4))
    engine = Engine(gen)
    real_stream, calls = gen.stream, []

    def stream(feed, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the first stream dies once it has taken a batch
            while feed(True) is None:
                pass
            raise RuntimeError("device lost")
        return real_stream(feed, **kwargs)

    monkeypatch.setattr(gen, "stream", stream)
    first = engine.submit([[0, 5]], [SamplingParams(max_new_tokens=3)])
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            first.result(timeout=60)
        again = engine.submit([[0, 5]], [SamplingParams(max_new_tokens=3, stop_token_ids=())])
        assert len(again.result(timeout=60)[0][0].completion_ids) == 3
    finally:
        engine.stop()
    assert engine.stats.restarts == 1 and engine.stats.requests == 2
