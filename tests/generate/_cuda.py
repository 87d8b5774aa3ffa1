"""Shared pieces of the Generator's CUDA tests (tests/generate/test_gpu.py,
test_gpu_fused_projections.py): the prompts, the compile scopes, a seed-initialized model on
the GPU, the bf16 gap bounds, and the check that captured graphs follow in-place weight loads.
Each of those test modules also resets dynamo around each test (the `fresh_dynamo` fixture of
tests/generate/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from tidal.generate import Generator, GeneratorConfig, SamplingParams, completion_logprobs
from tidal.models import Transformer, get_flavor

PROMPTS = [[1, 5, 7], list(range(2, 60)), [4], [9] * 5, list(range(100, 230))]
SCOPES = pytest.mark.parametrize(
    "scope", ["step", "blocks"], ids=["compiled_step", "compiled_blocks"]
)

# Outside batch-invariant mode, bf16 weights, compiled decode vs the trainer's forward, the
# model and samples of test_gpu.py's test_normal_mode_bf16_logprob_gap_is_bounded: measured
# max |diff| 0.02971, mean 0.005784 on one H200 (torch 2.11.0+cu130). The bounds are 3x those
# figures (docs/generate.md).
MAX_GAP_BF16, MEAN_GAP_BF16 = 0.09, 0.018


def cuda_model(flavor="debug", seed=0, dtype=torch.float32, **kw) -> Transformer:
    """A seed-initialized model of `flavor` (vocab 512, 512 positions) on the GPU; a flavor
    with q/k/v biases gets nonzero ones (init zeroes them: the fused bias then adds
    something)."""
    with torch.device("meta"):
        m = Transformer(get_flavor(flavor, vocab_size=512, max_seq_len=512, **kw))
    m.to_empty(device="cuda")
    m.init_weights(seed=seed)
    if m.args.qkv_bias:
        g = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("bias"):
                    p.copy_(0.1 * torch.randn(p.shape, device="cuda", generator=g))
    return m.to(dtype)


def completion_ids(groups):
    return [[s.completion_ids for s in g] for g in groups]


def check_graphs_follow_weight_loads(scope: str, **config) -> tuple[Generator, torch.Tensor]:
    """bf16, `GeneratorConfig(compile_scope=scope, **config)`: graphs captured before a
    `load_weights` replay after it (no re-capture, the parameters loaded in place) and
    compute with the new weights. Returns the generator and the gaps of its reported
    log-probs to the new model's."""
    gen = Generator(
        cuda_model(seed=0, dtype=torch.bfloat16),
        config=GeneratorConfig(max_batch=4, max_seq_len=256, compile_scope=scope, **config),
    )
    params = SamplingParams(temperature=0, max_new_tokens=32)
    first = gen.generate(PROMPTS[:3], params)
    captured = gen.stats.graphs_captured
    ptrs = [p.data_ptr() for p in gen.model.parameters()]
    gen_model_before = cuda_model(seed=0, dtype=torch.bfloat16)  # the weights it had
    other = cuda_model(seed=1, dtype=torch.bfloat16)
    gen.load_weights(other.state_dict(), version=5)
    assert [p.data_ptr() for p in gen.model.parameters()] == ptrs
    second = gen.generate(PROMPTS[:3], params)
    assert gen.stats.graphs_captured == captured  # replayed, not re-captured
    assert second[0][0].weight_version == 5 and completion_ids(second) != completion_ids(first)
    # The replayed graphs computed with the new weights: the log-probs they reported are the
    # new model's (teacher-forced, eager) within the bf16 gap, and far from the old model's.
    # (Not compared with a fresh generator's greedy tokens: another compiled graph rounds
    # differently in bf16 and can flip a near tie; on the H200 one prompt's 14th token did.)
    samples = [s for g in second for s in g]
    with torch.no_grad():
        new = completion_logprobs(other, samples)
        old = completion_logprobs(gen_model_before, samples)
    reported = [torch.tensor(s.logprobs) for s in samples]
    gap_new = torch.cat([r - t.cpu() for r, t in zip(reported, new, strict=True)]).abs()
    gap_old = torch.cat([r - t.cpu() for r, t in zip(reported, old, strict=True)]).abs()
    assert gap_new.max() < MAX_GAP_BF16 and gap_new.mean() < MEAN_GAP_BF16, gap_new
    assert gap_old.mean() > 10 * MEAN_GAP_BF16, gap_old
    return gen, gap_new
