"""The Generator on CPU: batching, groups, seeds, sampling options, stops, continuous
batching, weights and the store, bad input."""

import math
from dataclasses import replace

import pytest
import torch

from tests.generate.conftest import tiny_model
from tidal.generate import Generator, GeneratorConfig, SamplingParams, completion_logprobs, sample

PROMPTS = [[1, 5, 7], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [4], [9] * 5]
GREEDY = SamplingParams(temperature=0, max_new_tokens=12)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def greedy_by_recompute(model, prompt, n):
    """Reference: argmax of a full forward over the whole sequence, one token at a time."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


def ids(groups):
    return [[s.completion_ids for s in g] for g in groups]


def test_greedy_batch_of_ragged_prompts_matches_recompute(model):
    gen = Generator(model, config=GeneratorConfig(max_batch=4, max_seq_len=64, check_every=5))
    groups = gen.generate(PROMPTS, GREEDY)
    for prompt, group in zip(PROMPTS, groups, strict=True):
        (s,) = group
        assert s.prompt_ids == prompt and s.finish_reason == "length"
        assert s.completion_ids == greedy_by_recompute(model, prompt, 12)
        assert len(s.logprobs) == len(s.sampling_logprobs) == 12
        assert s.sampling_logprobs == [0.0] * 12 and all(lp < 0 for lp in s.logprobs)
    assert gen.stats.prefill_calls == 1  # the four prompts in one padded forward


def test_group_shares_one_prefill_and_seeds_its_samples(model):
    gen = Generator(model, config=GeneratorConfig(max_batch=8, max_seq_len=64))
    params = SamplingParams(n=6, temperature=1.0, max_new_tokens=10, seed=11)
    (group,) = gen.generate([PROMPTS[1]], params)
    assert gen.stats.prefill_tokens == len(PROMPTS[1])  # computed once, copied to 6 rows
    assert [s.sample_index for s in group] == list(range(6))
    assert len({tuple(s.completion_ids) for s in group}) == 6  # each sample its own noise
    (again,) = gen.generate([PROMPTS[1]], params)
    assert ids([again]) == ids([group])
    (other,) = gen.generate([PROMPTS[1]], SamplingParams(n=6, max_new_tokens=10, seed=12))
    assert ids([other]) != ids([group])


def test_same_request_same_tokens_in_any_batch(model):
    p = SamplingParams(n=2, temperature=0.9, top_p=0.9, max_new_tokens=12, seed=3)
    alone = Generator(model, config=GeneratorConfig(max_batch=2, max_seq_len=64))
    (ref,) = alone.generate([PROMPTS[0]], p)
    crowd = Generator(model, config=GeneratorConfig(max_batch=5, max_seq_len=64, check_every=3))
    others = SamplingParams(n=1, temperature=1.0, max_new_tokens=7, seed=8)
    groups = crowd.generate(PROMPTS[1:] + [PROMPTS[0]] + PROMPTS[1:2], [others] * 3 + [p, others])
    assert ids([groups[3]]) == ids([ref])  # other slots, other neighbours, refills in between


def test_truncation_limits_equal_greedy(model):
    gen = Generator(model, config=GeneratorConfig(max_batch=4, max_seq_len=64))
    greedy = ids(gen.generate(PROMPTS, GREEDY))
    for p in [
        SamplingParams(temperature=1.5, top_k=1, max_new_tokens=12),
        SamplingParams(temperature=1.5, top_p=1e-6, max_new_tokens=12),
        SamplingParams(temperature=1.5, min_p=1.0, max_new_tokens=12),
    ]:
        groups = gen.generate(PROMPTS, p)
        assert ids(groups) == greedy, p
        # One token left: the sampled distribution is a point mass.
        assert all(s.sampling_logprobs == [0.0] * 12 for g in groups for s in g)
    groups = gen.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=5, max_new_tokens=12))
    s = groups[1][0]
    assert all(slp >= lp for slp, lp in zip(s.sampling_logprobs, s.logprobs, strict=True))


def test_sampler_draws_from_the_truncated_tempered_softmax():
    torch.manual_seed(0)
    V, R = 6, 40_000
    logits = torch.randn(V) * 2
    rows = dict(
        temperature_B=torch.full((R,), 0.7),
        top_k_B=torch.full((R,), 4),
        top_p_B=torch.full((R,), 0.9),
        min_p_B=torch.full((R,), 0.05),
        keys_B=torch.arange(R),
        steps_B=torch.zeros(R, dtype=torch.long),
    )
    tok, lp, slp = sample(logits.expand(R, V), **rows)
    # The expected distribution, computed the plain way.
    p = torch.softmax(logits / 0.7, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[order[:4]] = True
    q = torch.where(keep, p, 0) / p[keep].sum()
    before = torch.cumsum(q[order], 0) - q[order]
    keep[order[before >= 0.9]] = False
    keep &= p >= 0.05 * p.max()
    q = torch.where(keep, p, 0) / p[keep].sum()
    freq = torch.bincount(tok, minlength=V).double() / R
    assert (freq - q).abs().max() < 0.01, (freq, q)
    assert set(tok.tolist()) == set(torch.nonzero(keep)[:, 0].tolist())
    torch.testing.assert_close(slp, q.log()[tok].float())
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[tok])


def test_stop_token_and_length(model):
    expected = greedy_by_recompute(model, PROMPTS[0], 12)
    stop = expected[4]
    gen = Generator(model, config=GeneratorConfig(max_batch=2, max_seq_len=64, check_every=3))
    groups = gen.generate(
        [PROMPTS[0], PROMPTS[2]],
        [SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop,)), GREEDY],
    )
    s = groups[0][0]
    first = expected.index(stop)
    assert s.completion_ids == expected[: first + 1] and s.finish_reason == "stop"
    assert len(s.logprobs) == first + 1
    assert groups[1][0].finish_reason == "length" and len(groups[1][0].completion_ids) == 12
    # max_new_tokens=1: the token sampled from the prefill is the whole completion.
    (one,) = gen.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=1))
    assert one[0].completion_ids == expected[:1] and one[0].finish_reason == "length"


def test_stop_strings_cut_text_and_tokens(model, tokenizer):
    prompt = [tokenizer.bos_id, *tokenizer.encode("The ")]
    gen = Generator(
        model,
        tokenizer=tokenizer,
        config=GeneratorConfig(max_batch=2, max_seq_len=64, check_every=4),
    )
    free = gen.generate([prompt], SamplingParams(temperature=0, max_new_tokens=30))[0][0]
    assert free.text == tokenizer.decode(free.completion_ids)
    # A stop string taken from the middle of the free-running text.
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop and stop in text
    params = SamplingParams(temperature=0, max_new_tokens=30, stop=(stop, "@@never@@"))
    s = gen.generate([prompt], params)[0][0]
    assert s.finish_reason == "stop" and s.text == text[: text.index(stop)]
    n = len(s.completion_ids)
    assert s.completion_ids == free.completion_ids[:n]
    assert stop in tokenizer.decode(s.completion_ids)  # the last token completes it...
    assert stop not in tokenizer.decode(s.completion_ids[:-1])  # ...and not one earlier


def test_finished_rows_are_refilled_at_once(model):
    """Two slots, one long request and six short ones: the short ones run one after the
    other in the second slot while the long one decodes, so the whole run takes about as
    many steps as the long request alone."""
    long = SamplingParams(temperature=0, max_new_tokens=40)
    short = SamplingParams(temperature=0, max_new_tokens=4)
    gen = Generator(model, config=GeneratorConfig(max_batch=2, max_seq_len=64, check_every=2))
    prompts = [PROMPTS[0]] + [PROMPTS[1], PROMPTS[2], PROMPTS[3]] * 2
    groups = gen.generate(prompts, [long] + [short] * 6)
    assert gen.stats.decode_steps <= 40 + 2
    assert gen.stats.prefill_calls == 1 + 5  # the first admission holds the long + one short
    for prompt, group, p in zip(prompts, groups, [long] + [short] * 6, strict=True):
        assert group[0].completion_ids == greedy_by_recompute(model, prompt, p.max_new_tokens)


def test_stream_overlaps_batches_and_yields_them_in_order(model):
    """Three batches through `stream`: each batch's samples are those `generate` gives it
    alone (same seeds), they come out in feed order, and the next batch's groups take the
    slots the previous one frees, so the stream decodes fewer steps than the batches one
    after the other."""
    long = SamplingParams(n=2, temperature=1.0, max_new_tokens=30, seed=5)
    short = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=6)
    batches = [
        ([PROMPTS[0], PROMPTS[1]], [long, short]),
        ([PROMPTS[2], PROMPTS[3]], [short, short]),
        ([PROMPTS[1]], [long]),
    ]
    config = GeneratorConfig(max_batch=4, max_seq_len=64, check_every=2)
    alone = Generator(model, config=config)
    expected, steps_alone = [], 0
    for prompts, params in batches:
        expected.append(ids(alone.generate(prompts, params)))
        steps_alone += alone.stats.decode_steps
        alone.stats.decode_steps = 0

    gen = Generator(model, config=config)
    fed, asked_busy = iter(batches), []

    def feed(idle: bool):
        asked_busy.append(not idle)
        return next(fed, Generator.END)

    out = [ids(groups) for groups in gen.stream(feed)]
    assert out == expected
    assert any(asked_busy[1:])  # later batches were fed while earlier rows still decoded
    assert gen.stats.decode_steps < steps_alone


def test_stream_asks_again_until_fed_and_checks_each_batch(model, tokenizer):
    """A feed with nothing yet (None) is asked again; END ends a stream at once; a bad batch
    raises the error `generate` raises, when it is fed."""
    gen = Generator(model, tokenizer=tokenizer, config=GeneratorConfig(max_batch=2, max_seq_len=64))
    answers = iter([None, None, ([PROMPTS[0]], GREEDY)])
    out = list(gen.stream(lambda idle: next(answers, Generator.END)))
    assert ids(out[0]) == ids(gen.generate([PROMPTS[0]], GREEDY)) and len(out) == 1
    assert list(gen.stream(lambda idle: Generator.END)) == []
    bad = iter([([PROMPTS[0]], GREEDY), ([[]], GREEDY)])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        list(gen.stream(lambda idle: next(bad, Generator.END)))


def test_stream_reports_the_tokens_of_streamed_prompts_as_they_decode(model):
    """`on_tokens` hears each sample of a prompt with `stream` set at every host check while
    it runs, in order and from its first token, and never a prompt without it; the tokens
    sampled are those of the same request unstreamed."""
    config = GeneratorConfig(max_batch=8, max_seq_len=64, check_every=3)
    streamed = SamplingParams(n=2, temperature=1.0, max_new_tokens=20, seed=5, stop_token_ids=())
    quiet = SamplingParams(temperature=0, max_new_tokens=9, stop_token_ids=())
    prompts, params = [PROMPTS[0], PROMPTS[2]], [replace(streamed, stream=True), quiet]
    expected = ids(Generator(model, config=config).generate(prompts, [streamed, quiet]))
    gen, heard, calls = Generator(model, config=config), {}, []

    def on_tokens(batch, index, sample_index, new):
        assert new and (batch, index) == (0, 0)
        calls.append(sample_index)
        heard.setdefault(sample_index, []).extend(new)

    feed = iter([(prompts, params)])
    (groups,) = gen.stream(lambda idle: next(feed, Generator.END), on_tokens=on_tokens)
    assert ids(groups) == expected
    for j, done in enumerate(groups[0]):
        # every check but the one the sample finished at: all tokens but the last few
        assert 20 - 3 <= len(heard[j]) < 20 and calls.count(j) >= 5
        assert done.completion_ids[: len(heard[j])] == heard[j]


def test_rows_move_down_to_smaller_buckets(model):
    """Eight rows, seven finish early: the long one moves into slot 0 and decodes alone."""
    gen = Generator(model, config=GeneratorConfig(max_batch=8, max_seq_len=64, check_every=2))
    params = [SamplingParams(temperature=0, max_new_tokens=3)] * 7 + [
        SamplingParams(temperature=0, max_new_tokens=20)
    ]
    prompts = (PROMPTS * 2)[:8]
    groups = gen.generate(prompts, params)
    assert gen.buckets == [1, 2, 4, 8]
    for prompt, group, p in zip(prompts, groups, params, strict=True):
        assert group[0].completion_ids == greedy_by_recompute(model, prompt, p.max_new_tokens)


def test_logprobs_match_the_trainer_within_bound(model, record_property):
    """Outside batch-invariant mode the generator's log-probs differ from the trainer's
    forward in the last bits (other kernels for other shapes). Documented bound on CPU fp32:
    max |diff| < 1e-4."""
    gen = Generator(model, config=GeneratorConfig(max_batch=3, max_seq_len=64, check_every=3))
    groups = gen.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=16))
    samples = [s for g in groups for s in g]
    with torch.no_grad():
        trainer = completion_logprobs(model, samples)
    diff = torch.cat([torch.tensor(s.logprobs) - t for s, t in zip(samples, trainer, strict=True)])
    diff = diff.abs()
    record_property("max_abs_diff", float(diff.max()))
    record_property("mean_abs_diff", float(diff.mean()))
    print(f"generator vs trainer log-probs: max {diff.max():.3g}, mean {diff.mean():.3g}")
    assert diff.max() < 1e-4


def test_load_weights_in_place_and_versions(model):
    gen = Generator(tiny_model(seed=0), config=GeneratorConfig(max_batch=2, max_seq_len=64))
    before = ids(gen.generate(PROMPTS[:2], GREEDY))
    ptrs = {n: p.data_ptr() for n, p in gen.model.named_parameters()}
    other = tiny_model(seed=1).state_dict()
    gen.load_weights(other, version=7)
    assert {n: p.data_ptr() for n, p in gen.model.named_parameters()} == ptrs
    for n, t in gen.model.state_dict().items():
        assert torch.equal(t, other[n]), n
    groups = gen.generate(PROMPTS[:2], GREEDY)
    assert ids(groups) != before and groups[0][0].weight_version == 7
    assert ids(groups) == ids(Generator(tiny_model(seed=1)).generate(PROMPTS[:2], GREEDY))

    bad = dict(other)
    del bad["norm.weight"]
    bad["extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match=r"missing norm\.weight, unexpected extra\.weight"):
        gen.load_weights(bad)
    bad = dict(other)
    bad["output.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'output.weight' has shape \(3, 3\)"):
        gen.load_weights(bad)


def test_load_from_store_and_timeout():
    import time

    import tidal.store

    store = tidal.store.connect()
    try:
        gen = Generator(tiny_model(seed=0), config=GeneratorConfig(max_batch=2, max_seq_len=64))
        for v, seed in [(3, 1), (4, 2)]:
            store.put_state_dict(tiny_model(seed=seed).state_dict(), "policy", version=v)
        ptrs = [p.data_ptr() for p in gen.model.parameters()]
        assert gen.load_from_store(store, "policy") == 4  # the newest
        assert [p.data_ptr() for p in gen.model.parameters()] == ptrs
        assert gen.generate(PROMPTS[:1], GREEDY)[0][0].weight_version == 4
        assert gen.load_from_store(store, "policy", version=3) == 3
        ref = tiny_model(seed=1).state_dict()
        assert all(torch.equal(t, ref[n]) for n, t in gen.model.state_dict().items())
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="version 9 of 'policy' did not arrive"):
            gen.load_from_store(store, "policy", version=9, timeout=0.3)
        with pytest.raises(TimeoutError, match="version 0 of 'nothing' did not arrive"):
            gen.load_from_store(store, "nothing", timeout=0.3)  # no version yet: waits for 0
        assert time.monotonic() - start < 10
        assert gen.version == 3  # unchanged by the failed reads
    finally:
        store.close()


def word_tokenizer():
    """A word-level tokenizer with an unknown token: text outside its words cannot come out."""
    import tokenizers

    from tidal.train.data import Tokenizer

    vocab = {"<unk>": 0, "a": 1, "b": 2, "<|eos|>": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return Tokenizer(tok, bos_id=3, eos_id=3)


def test_bad_input_is_a_clear_error(model, tokenizer):
    gen = Generator(model, tokenizer=tokenizer, config=GeneratorConfig(max_batch=2, max_seq_len=32))
    cases = [
        ([[]], GREEDY, "prompt 0 is empty"),
        ([[1] * 40], GREEDY, "prompt 0 has 40 tokens; a row holds at most 32"),
        ([[1] * 30], SamplingParams(max_new_tokens=5), "at most 2 new tokens fit"),
        ([[1, 999]], GREEDY, r"outside the vocabulary \[0, 512\)"),
        ([[1]], SamplingParams(n=3, max_new_tokens=8), "n=3 samples exceed .*max_batch=2"),
        ([[1]], SamplingParams(stop_token_ids=(600,), max_new_tokens=8), "stop_token_ids"),
        ([[1], [2]], [GREEDY], "2 prompts but 1 SamplingParams"),
    ]
    for prompts, params, match in cases:
        with pytest.raises(ValueError, match=match):
            gen.generate(prompts, params)
    with pytest.raises(TypeError, match="sequence of token-id sequences"):
        gen.generate([1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="need a tokenizer"):
        Generator(model).generate([[1]], SamplingParams(stop=("x",), max_new_tokens=8))
    with pytest.raises(ValueError, match="tune_kernels tunes compiled kernels: it needs compile"):
        Generator(model, config=GeneratorConfig(tune_kernels=True))  # CPU: nothing compiled
    with pytest.raises(ValueError, match="stop string 'zz' cannot be produced by the tokenizer"):
        Generator(model, tokenizer=word_tokenizer()).generate(
            [[1]], SamplingParams(stop=("zz",), max_new_tokens=8)
        )
    for kw, match in [
        ({"temperature": -0.1}, "temperature must be finite and >= 0"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
        ({"n": 0}, "n must be"),
        ({"stop": "abc"}, "tuple of strings"),
        ({"stop": ("",)}, "non-empty strings"),
    ]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len=128"):
        Generator(model, config=GeneratorConfig(max_seq_len=129))
    with pytest.raises(ValueError, match="need a model on a CUDA device"):
        Generator(model, config=GeneratorConfig(cuda_graphs=True))
    # The generator still works after every refusal.
    assert gen.generate([[1, 2]], GREEDY)[0][0].finish_reason in ("stop", "length")


def test_compile_scope_blocks_traces_one_block_for_every_layer(model, monkeypatch):
    """compile_scope="blocks" with dynamo on CPU (a counting backend that runs the traced
    graphs as they are): after `warm_up`, the same tokens as eager, and nothing more compiles
    whatever the batch buckets (continuous batching walks 8, 4, 2, 1), the prompts' count and
    widths and the sampler variants warmed. The 4 layers x 4 buckets x prefill cost 4 block
    graphs, each dynamic in the batch and time from its first shape (no static graph
    recompiled at the second size); size 1 is a graph of its own. CUDA compiles and captures
    the same code (tests/generate/test_gpu.py)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counters: dict[str, CompileCounter] = {}
    compile_ = torch.compile

    def counting_compile(fn, **kw):
        counter = counters.setdefault(fn.__name__, CompileCounter())
        return compile_(fn, backend=counter, dynamic=kw.get("dynamic"))

    with pytest.warns(UserWarning, match="compile_scope='blocks' is ignored"):
        gen = Generator(
            model, config=GeneratorConfig(max_batch=8, max_seq_len=64, compile_scope="blocks")
        )
    assert gen.warm_up() == 0.0 and gen.stats.warmup_seconds == 0  # eager: nothing to pay
    monkeypatch.setattr(torch, "compile", counting_compile)
    gen.compile_for_testing()  # what compile=None gives on CUDA
    ref = Generator(model, config=GeneratorConfig(max_batch=8, max_seq_len=64))
    # Lengths that end at different steps: the rows left run in buckets 8, 4, 2 and 1.
    params = [
        SamplingParams(n=2, temperature=0.9, top_p=0.9, max_new_tokens=n, seed=n)
        for n in (3, 9, 17, 30)
    ]
    with pytest.raises(ValueError, match=r"warm_up buckets \[3\] are not batch buckets"):
        gen.warm_up(buckets=[3])
    assert gen.warm_up([params[0], GREEDY]) > 0  # the truncated and greedy variants
    frames = {name: c.frame_count for name, c in counters.items()}
    # Decode: bucket 1 and one graph for the others; prefill: one prompt, and one for more.
    assert frames == {"run_block": 4, "_record_greedy": 2, "_record_truncated": 2}, frames
    assert gen.stats.prefill_calls == gen.stats.decode_steps == 0  # warm-up not counted
    assert gen.stats.warmup_seconds > 0
    ragged = [[3] * 40, [5, 6], *PROMPTS[:3]]  # other widths and prompt counts
    for prompts, p in [
        (PROMPTS, params),
        (PROMPTS, GREEDY),
        (ragged[:3], params[1]),
        (ragged[:1], GREEDY),
        (ragged, params[2]),
    ]:
        assert ids(gen.generate(prompts, p)) == ids(ref.generate(prompts, p))
    assert {name: c.frame_count for name, c in counters.items()} == frames
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="compile_scope must be 'step' or 'blocks'"):
        GeneratorConfig(compile_scope="layers")  # type: ignore[arg-type]
