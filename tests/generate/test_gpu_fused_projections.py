"""Fused projections (GeneratorConfig.fuse_projections) under compile
and CUDA graphs: the same greedy tokens as the unfused generator in both compile scopes, and
captured graphs that follow in-place weight loads through the stacked weights. Skipped
without CUDA (`pytest -m gpu tests/generate/test_gpu_fused_projections.py`)."""

import pytest
import torch
import torch._dynamo

from tidal.generate import Generator, GeneratorConfig, SamplingParams, completion_logprobs
from tidal.models import Transformer, get_flavor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[1, 5, 7], list(range(2, 60)), [4], [9] * 5, list(range(100, 230))]
SCOPES = pytest.mark.parametrize(
    "scope", ["step", "blocks"], ids=["compiled_step", "compiled_blocks"]
)
# bf16 weights, compiled decode vs the trainer's forward (the bounds of tests/generate/
# test_gpu.py, 3x what was measured there unfused).
MAX_GAP_BF16, MEAN_GAP_BF16 = 0.09, 0.018


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(flavor="debug", seed=0, dtype=torch.float32, **kw):
    with torch.device("meta"):
        m = Transformer(get_flavor(flavor, vocab_size=512, max_seq_len=512, **kw))
    m.to_empty(device="cuda")
    m.init_weights(seed=seed)
    if m.args.qkv_bias:  # init zeroes the biases: give the fused bias something to add
        g = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("bias"):
                    p.copy_(0.1 * torch.randn(p.shape, device="cuda", generator=g))
    return m.to(dtype)


def _ids(groups):
    return [[s.completion_ids for s in g] for g in groups]


@SCOPES
@pytest.mark.parametrize("flavor", ["debug", "debug_qwen2", "debug_qwen3"])
def test_fused_graphs_match_unfused_greedy_tokens(scope, flavor):
    """fp32 weights: compiled and captured, fused and unfused give the same greedy tokens
    (log-probs within 1e-3); sampled with truncation, the same seeded tokens."""
    model = _model(flavor)
    params = SamplingParams(temperature=0, max_new_tokens=40)
    cfg = dict(max_batch=8, max_seq_len=256, compile_scope=scope)
    ref = Generator(model, config=GeneratorConfig(fuse_projections=False, **cfg))
    want = ref.generate(PROMPTS, params)
    gen = Generator(model, config=GeneratorConfig(**cfg))  # None: on for CUDA
    assert gen.fused == 2 * model.args.n_layers and gen.compiles and gen.captures
    got = gen.generate(PROMPTS, params)
    assert gen.stats.graphs_captured >= 1
    assert _ids(got) == _ids(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(
            torch.tensor(g[0].logprobs), torch.tensor(w[0].logprobs), atol=1e-3, rtol=0
        )
    sampled = SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=24)
    assert _ids(gen.generate(PROMPTS, sampled)) == _ids(ref.generate(PROMPTS, sampled))


@SCOPES
def test_fused_graphs_follow_in_place_weight_loads(scope):
    """bf16: graphs captured over the stacked weights replay with the weights loaded in place
    afterwards (no re-capture); the log-probs they report are the new model's."""
    gen = Generator(
        _model(seed=0, dtype=torch.bfloat16),
        config=GeneratorConfig(max_batch=4, max_seq_len=256, compile_scope=scope),
    )
    assert gen.fused > 0
    params = SamplingParams(temperature=0, max_new_tokens=32)
    first = gen.generate(PROMPTS[:3], params)
    captured = gen.stats.graphs_captured
    ptrs = [p.data_ptr() for p in gen.model.parameters()]
    old_model = _model(seed=0, dtype=torch.bfloat16)
    other = _model(seed=1, dtype=torch.bfloat16)
    gen.load_weights(other.state_dict(), version=5)
    assert [p.data_ptr() for p in gen.model.parameters()] == ptrs
    second = gen.generate(PROMPTS[:3], params)
    assert gen.stats.graphs_captured == captured  # replayed, not re-captured
    assert second[0][0].weight_version == 5 and _ids(second) != _ids(first)
    samples = [s for g in second for s in g]
    with torch.no_grad():
        new = completion_logprobs(other, samples)
        old = completion_logprobs(old_model, samples)
    reported = [torch.tensor(s.logprobs) for s in samples]
    gap_new = torch.cat([r - t.cpu() for r, t in zip(reported, new, strict=True)]).abs()
    gap_old = torch.cat([r - t.cpu() for r, t in zip(reported, old, strict=True)]).abs()
    print(f"fused bf16 vs trainer: max {gap_new.max():.3g}, mean {gap_new.mean():.3g}")
    assert gap_new.max() < MAX_GAP_BF16 and gap_new.mean() < MEAN_GAP_BF16, gap_new
    assert gap_old.mean() > 10 * MEAN_GAP_BF16, gap_old
