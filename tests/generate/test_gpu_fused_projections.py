"""Fused projections (GeneratorConfig.fuse_projections) under compile
and CUDA graphs: the same greedy tokens as the unfused generator in both compile scopes, and
captured graphs that follow in-place weight loads through the stacked weights. Skipped
without CUDA (`pytest -m gpu tests/generate/test_gpu_fused_projections.py`)."""

import pytest
import torch

from tests.generate._cuda import (
    PROMPTS,
    SCOPES,
    check_graphs_follow_weight_loads,
    completion_ids,
    cuda_model,
)
from tidal.generate import Generator, GeneratorConfig, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("fresh_dynamo"),
]


@SCOPES
@pytest.mark.parametrize("flavor", ["debug", "debug_qwen2", "debug_qwen3"])
def test_fused_graphs_match_unfused_greedy_tokens(scope, flavor):
    """fp32 weights: compiled and captured, fused and unfused give the same greedy tokens
    (log-probs within 1e-3); sampled with truncation, the same seeded tokens."""
    model = cuda_model(flavor)
    params = SamplingParams(temperature=0, max_new_tokens=40)
    cfg = dict(max_batch=8, max_seq_len=256, compile_scope=scope)
    ref = Generator(model, config=GeneratorConfig(fuse_projections=False, **cfg))
    want = ref.generate(PROMPTS, params)
    gen = Generator(model, config=GeneratorConfig(fuse_projections=True, **cfg))
    assert gen.fused == 2 * model.args.n_layers and gen.compiles and gen.captures
    got = gen.generate(PROMPTS, params)
    assert gen.stats.graphs_captured >= 1
    assert completion_ids(got) == completion_ids(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(
            torch.tensor(g[0].logprobs), torch.tensor(w[0].logprobs), atol=1e-3, rtol=0
        )
    sampled = SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=24)
    assert completion_ids(gen.generate(PROMPTS, sampled)) == completion_ids(
        ref.generate(PROMPTS, sampled)
    )


@SCOPES
def test_fused_graphs_follow_in_place_weight_loads(scope):
    """bf16: graphs captured over the stacked weights replay with the weights loaded in place
    afterwards (no re-capture); the log-probs they report are the new model's."""
    gen, gap_new = check_graphs_follow_weight_loads(scope, fuse_projections=True)
    assert gen.fused > 0
    print(f"fused bf16 vs trainer: max {gap_new.max():.3g}, mean {gap_new.mean():.3g}")
