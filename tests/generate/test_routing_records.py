"""Routing records of a mixture-of-experts model (`GeneratorConfig.record_routing`): every
sample carries the experts each MoE layer routed its prompt and completion tokens to, and
they are the experts the training forward routes the same tokens to, through continuous
batching, row compaction, shared prompt prefills and the compiled steps; a dense model is
refused; the decode step's host sync of the experts' loop path keeps CUDA graphs off."""

from __future__ import annotations

import pytest
import torch

from tests.generate.conftest import moe_tiny, tiny_model
from tidal.generate import Generator, GeneratorConfig, SamplingParams
from tidal.generate.steps import moe_host_sync
from tidal.models.moe import moe_layers

PROMPTS = [[0, 5, 7, 9], list(range(2, 23)), [4], [9] * 6]


def forward_routing(model, ids: list[int]) -> torch.Tensor:
    """[layers, len(ids) - 1, top_k]: the training forward's experts of every token but the
    last."""
    model(torch.tensor([ids]), batch_invariant=True)
    return torch.stack([m.last_experts_NK for m in moe_layers(model)])[:, :-1]


def check_records(model, groups) -> int:
    checked = 0
    for group in groups:
        for s in group:
            want = forward_routing(model, s.prompt_ids + s.completion_ids)
            assert s.routed_experts.dtype == torch.uint8
            assert torch.equal(s.routed_experts.long(), want)
            checked += want.shape[1]
    return checked


# Groups of 3 in 4 rows, lengths that end at different steps: refills and compaction.
PARAMS = [
    SamplingParams(n=3 if i % 2 else 1, temperature=1.0, max_new_tokens=4 + 5 * i, seed=i)
    for i in range(len(PROMPTS))
]


def test_records_are_the_training_forwards_experts():
    model = moe_tiny()
    cfg = GeneratorConfig(
        max_batch=4, max_seq_len=64, check_every=3, batch_invariant=True, record_routing=True
    )
    gen = Generator(model, config=cfg)
    assert check_records(model, gen.generate(PROMPTS, PARAMS)) > 100
    assert gen.stats.decode_steps > 0


def test_compiled_steps_record_as_eager_ones(monkeypatch):
    """The compiled prefill and decode steps (traced by dynamo, run by its eager backend:
    the same kernels) record what the eager steps record."""
    model = moe_tiny()
    cfg = GeneratorConfig(max_batch=4, max_seq_len=64, check_every=3, record_routing=True)
    want = Generator(model, config=cfg).generate(PROMPTS, PARAMS)
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager"))
    torch._dynamo.reset()
    gen = Generator(model, config=cfg)
    gen.compile_for_testing()  # what compile=None gives on CUDA
    got = gen.generate(PROMPTS, PARAMS)
    torch._dynamo.reset()
    for g, w in zip(got, want, strict=True):
        for s, t in zip(g, w, strict=True):
            assert s.completion_ids == t.completion_ids
            assert torch.equal(s.routed_experts, t.routed_experts)


def test_continuations_record_the_whole_conversation():
    model = moe_tiny()
    cfg = GeneratorConfig(max_batch=2, max_seq_len=64, batch_invariant=True, record_routing=True)
    gen = Generator(model, config=cfg)
    p = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3, stop_token_ids=())
    (s,) = gen.generate([[0, 5, 7]], p, keep=True)[0]
    (t,) = gen.continue_([s.conversation], [[11, 12]], p, keep=False)
    assert t.prompt_ids == s.prompt_ids + s.completion_ids + [11, 12]
    assert check_records(model, [[s, t]]) == (3 + 5 - 1) + (10 + 5 - 1)


def test_dense_model_and_no_recording():
    dense = tiny_model()
    with pytest.raises(ValueError, match="record_routing=True .* this model is dense"):
        Generator(dense, config=GeneratorConfig(max_batch=2, record_routing=True))
    gen = Generator(moe_tiny(), config=GeneratorConfig(max_batch=2, max_seq_len=32))
    (s,) = gen.generate([[1, 2]], SamplingParams(max_new_tokens=3))[0]
    assert s.routed_experts is None


def test_the_experts_loop_reads_counts_on_the_host():
    """Off sm90 bf16 (and in batch-invariant mode) the experts run one matmul per expert and
    read the counts on the host: a CUDA graph cannot capture that step."""
    model = moe_tiny()
    assert moe_host_sync(tiny_model(), GeneratorConfig()) is None  # dense
    assert "grouped GEMM" in moe_host_sync(model, GeneratorConfig())
    assert "batch-invariant" in moe_host_sync(model, GeneratorConfig(batch_invariant=True))
