"""Batch-invariant mode on CPU (fp32, bf16 weights, bf16 autocast): kernels independent of
the batch, and generator log-probs bitwise equal to the trainer's forward."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.generate.conftest import qwen_tiny, tiny_model
from tidal.generate import Generator, GeneratorConfig, SamplingParams, completion_logprobs
from tidal.models import batch_invariant as bi

PROMPTS = [[1, 5, 7], list(range(2, 40)), [4], [9] * 5, list(range(100, 170))]


def test_matmul_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    w = torch.randn(768, 256)
    x = torch.randn(300, 256)
    with bi.BatchInvariantMode():
        ref = F.linear(x, w)
        for m in [1, 2, 3, 15, 16, 17, 100]:
            assert torch.equal(F.linear(x[:m], w), ref[:m]), m
            assert torch.equal(F.linear(x[None, -m:], w)[0], ref[-m:]), m
        logp = torch.log_softmax(x, -1)
        norm = F.rms_norm(x, (256,), eps=1e-5)
        for m in [1, 5, 33]:
            assert torch.equal(torch.log_softmax(x[:m], -1), logp[:m])
            assert torch.equal(F.rms_norm(x[:m], (256,), eps=1e-5), norm[:m])
    # The reason for the mode: plain kernels change a row's bits with the row count.
    assert not all(torch.equal(F.linear(x[:m], w), F.linear(x, w)[:m]) for m in [1, 2, 3])


@pytest.fixture
def fused_rms_norm():
    """RMSNorm through `aten._fused_rms_norm`, as on CUDA: CPU has no kernel for it, so
    F.rms_norm decomposes before the mode sees it; with this CPU kernel (the reference math,
    outputs in CUDA's dtypes: normed rows in the input dtype, rstd in fp32) the mode's
    replacement runs on CPU too."""

    def kernel(x, normalized_shape, weight, eps):
        dims = tuple(range(-len(normalized_shape), 0))
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        rstd = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + eps)
        out = x.float() * rstd
        return (out if weight is None else out * weight).to(x.dtype), rstd

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_fused_rms_norm", kernel, "CPU")
    yield
    lib._destroy()


class _Replaced(bi.BatchInvariantMode):
    """The mode, noting which of its replacements ran."""

    def __init__(self):
        super().__init__()
        self.ops: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in bi.REPLACED_OPS:
            self.ops.add(func)
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp32 + bf16 autocast"])
def test_replacements_keep_the_dtypes_of_the_normal_kernels(precision, fused_rms_norm):
    """Each replacement returns what the kernel it replaces returns (dtype, shape, values up
    to rounding), also under autocast: a bf16 model's activations stay bf16 (the H200 failure
    was RMSNorm's rows coming back in fp32, rejected by the next bf16 matmul)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    x, w = torch.randn(40, 64, dtype=dtype), torch.randn(32, 64, dtype=dtype)
    bias, scale = torch.randn(32, dtype=dtype), torch.rand(64, dtype=dtype) + 0.5
    ops = {
        "linear": lambda: F.linear(x, w),
        "linear with bias": lambda: F.linear(x, w, bias),
        "linear on a strided 3-D input": lambda: F.linear(x.view(5, 8, 64).transpose(0, 1), w),
        "mean": lambda: x.mean(-1),
        "mean keepdim": lambda: x.pow(2).mean(-1, keepdim=True),
        "sum": lambda: x.sum(-1),
        "sum in fp32": lambda: x.sum(-1, dtype=torch.float32),
        "softmax": lambda: torch.softmax(x, -1),
        "log_softmax": lambda: torch.log_softmax(x, -1),
        "log_softmax in fp32": lambda: torch.log_softmax(x.float(), -1),
        "rms_norm": lambda: F.rms_norm(x, (64,), scale, 1e-5),
        "rms_norm without weight": lambda: F.rms_norm(x.view(5, 8, 64), (64,), None, 1e-5),
    }
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled="autocast" in precision)
    mode = _Replaced()
    for name, op in ops.items():
        with torch.no_grad(), autocast:
            want = op()
            with mode:
                got = op()
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        tol = 2e-2 if torch.bfloat16 in (want.dtype, got.dtype) or "autocast" in precision else 1e-5
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=name)
    assert mode.ops == bi.REPLACED_OPS, "every replacement is exercised"


@pytest.mark.parametrize("rms_norm", ["composite (CPU)", "fused (as on CUDA)"])
def test_bitwise_with_bf16_weights(rms_norm, request):
    """bf16 parameters (no autocast), the H200's failing configuration, on the tiny model."""
    if rms_norm.startswith("fused"):
        request.getfixturevalue("fused_rms_norm")
    model = tiny_model().to(torch.bfloat16)
    gen = Generator(
        model,
        config=GeneratorConfig(max_batch=3, max_seq_len=112, check_every=3, batch_invariant=True),
    )
    params = [SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=i) for i in range(3)]
    samples = [s for g in gen.generate(PROMPTS[:3], params) for s in g]
    assert gen.cache.k[0].dtype == torch.bfloat16
    with torch.no_grad():
        trainer = completion_logprobs(model, samples, batch_invariant=True)
    for s, lp in zip(samples, trainer, strict=True):
        assert torch.equal(torch.tensor(s.logprobs), lp), (s.prompt_index, s.sample_index)
        assert all(math.isfinite(x) for x in s.logprobs)


class _Bmms(TorchDispatchMode):
    """Records the operand shapes, strides and 16-byte alignment of every bmm call."""

    def __init__(self):
        super().__init__()
        self.calls: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket is torch.ops.aten.bmm:
            ts = [*args, *kwargs.values()]
            self.calls.add(tuple((tuple(t.shape), t.stride(), t.data_ptr() % 16) for t in ts))
        return func(*args, **kwargs)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ],
)
def test_attention_matmuls_have_one_shape_for_any_query_count(device):
    """Every attention matmul has one shape (queries padded to fixed blocks, problems to
    whole calls), so a library picking its kernel by shape (cuBLAS by M, N and the batch)
    computes each query the same way in a trainer's forward, a prefill and a decode step;
    and the bits agree (on CUDA: with several calls per chunk, as a real prefill has)."""
    torch.manual_seed(0)
    # CPU: J = 2 query columns per key head and token; CUDA: J = 4, Llama 3's head dim.
    B, H, G, T, S, K = (2, 4, 2, 150, 200, 16) if device == "cpu" else (2, 16, 4, 600, 700, 64)
    q, k, v = (torch.randn(B, n, T, K, device=device) for n in (H, G, G))
    # A generator's cache: the same keys, then stale entries past the rows' lengths.
    k_cache = torch.cat([k, torch.randn(B, G, S - T, K, device=device)], dim=2)
    v_cache = torch.cat([v, torch.randn(B, G, S - T, K, device=device)], dim=2)
    rows = torch.tensor([0, 1, 1], device=device)
    pos = torch.tensor([[0], [T - 1], [70]], device=device)
    bmms = _Bmms()
    with torch.no_grad(), bmms:
        full = bi.attention(q, k, v, torch.arange(T, device=device).expand(B, T))
        one = bi.attention(q[rows, :, pos[:, 0], None], k_cache[rows], v_cache[rows], pos)
        alone = bi.attention(q[1:, :, 70:71], k_cache[1:], v_cache[1:], pos[2:])  # batch 1
        prefill = bi.attention(q[1:, :, :37], k_cache[1:], v_cache[1:], pos.new_tensor([range(37)]))
    assert len(bmms.calls) == 2, bmms.calls  # scores, and values with the denominator
    for shape, stride, align in (t for call in bmms.calls for t in call):
        assert stride == torch.empty(shape).stride() and align == 0  # contiguous, aligned
    for i, (b, t) in enumerate(zip(rows.tolist(), pos[:, 0].tolist(), strict=True)):
        assert torch.equal(one[i, :, 0], full[b, :, t]), (b, t)
    assert torch.equal(alone[0, :, 0], full[1, :, 70])
    assert torch.equal(prefill[0], full[1, :, :37])
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    tol = 1e-5 if device == "cpu" else 1e-4
    torch.testing.assert_close(full, ref, atol=tol, rtol=tol)


def test_chunked_attention_equals_sdpa_numerically():
    torch.manual_seed(0)
    B, H, G, T, K = 2, 4, 2, 150, 16
    q, k, v = torch.randn(B, H, T, K), torch.randn(B, G, T, K), torch.randn(B, G, T, K)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = bi.attention(q, k, v, torch.arange(T).expand(B, T))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # Decode: one query per row at different positions of a longer cache.
    pos = torch.tensor([[40], [149]])
    one = bi.attention(q.gather(2, pos[:, None, :, None].expand(B, H, 1, K)), k, v, pos)
    torch.testing.assert_close(one[0, :, 0], ref[0, :, 40], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one[1, :, 0], ref[1, :, 149], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flavor", ["llama", "qwen3", "one_kv_head"])
def test_generator_logprobs_are_bitwise_the_trainers(flavor):
    model = {"llama": tiny_model, "qwen3": qwen_tiny}.get(
        flavor, lambda: tiny_model(n_kv_heads=1)
    )()
    params = [
        SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=24, seed=1),
        SamplingParams(n=1, temperature=0.0, max_new_tokens=30),
        SamplingParams(n=2, temperature=0.7, top_k=20, max_new_tokens=9, seed=2),
        SamplingParams(n=1, temperature=1.3, min_p=0.05, max_new_tokens=17, seed=3),
        SamplingParams(n=2, temperature=1.0, max_new_tokens=20, seed=4),
    ]
    # Few slots: groups wait, get refilled into freed rows and moved to smaller buckets.
    gen = Generator(
        model,
        config=GeneratorConfig(max_batch=4, max_seq_len=112, check_every=3, batch_invariant=True),
    )
    samples = [s for g in gen.generate(PROMPTS, params) for s in g]
    assert len(samples) == 9
    with torch.no_grad():
        batched = completion_logprobs(model, samples, batch_invariant=True)
        for s, lp in zip(samples, batched, strict=True):
            assert torch.equal(torch.tensor(s.logprobs), lp), (s.prompt_index, s.sample_index)
            (alone,) = completion_logprobs(model, [s], batch_invariant=True)
            assert torch.equal(alone, lp)
    # Another batch composition: three slots, the requests in reverse order.
    solo = Generator(
        model, config=GeneratorConfig(max_batch=3, max_seq_len=112, batch_invariant=True)
    )
    again = [s for g in solo.generate(PROMPTS[::-1], params[::-1]) for s in g]
    key = {(s.prompt_ids.__repr__(), s.sample_index): s for s in samples}
    for s in again:
        ref = key[(s.prompt_ids.__repr__(), s.sample_index)]
        assert s.completion_ids == ref.completion_ids
        assert s.logprobs == ref.logprobs and s.sampling_logprobs == ref.sampling_logprobs


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_bitwise_with_two_threads():
    torch.set_num_threads(2)  # the autouse fixture restores the count
    model = tiny_model()
    gen = Generator(
        model, config=GeneratorConfig(max_batch=3, max_seq_len=112, batch_invariant=True)
    )
    groups = gen.generate(PROMPTS[:3], SamplingParams(n=1, max_new_tokens=24, seed=5))
    samples = [s for g in groups for s in g]
    with torch.no_grad():
        trainer = completion_logprobs(model, samples, batch_invariant=True)
        for s, lp in zip(samples, trainer, strict=True):
            assert torch.equal(torch.tensor(s.logprobs), lp)


def test_bitwise_under_autocast_bf16():
    """bf16 weights-on-the-fly as a trainer without FSDP runs them (CPU autocast)."""
    model = tiny_model()
    config = GeneratorConfig(max_batch=2, max_seq_len=112, batch_invariant=True, amp_dtype="bf16")
    gen = Generator(model, config=config)
    samples = [s for g in gen.generate(PROMPTS[:3], SamplingParams(max_new_tokens=16)) for s in g]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        trainer = completion_logprobs(model, samples, batch_invariant=True)
    for s, lp in zip(samples, trainer, strict=True):
        assert torch.equal(torch.tensor(s.logprobs), lp)
        assert all(math.isfinite(x) for x in s.logprobs)


def test_trainer_forward_with_the_mode_trains():
    """The mode is a forward option: gradients flow (backward uses the normal kernels)."""
    model = tiny_model()
    ids = torch.randint(0, 512, (2, 33))
    loss = (
        -torch.log_softmax(model(ids[:, :-1], batch_invariant=True), -1)
        .gather(-1, ids[:, 1:, None])
        .mean()
    )
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    ref = tiny_model()
    F.cross_entropy(ref(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)


def test_flex_and_custom_attention_are_refused():
    model = tiny_model(attention="flex")
    with pytest.raises(ValueError, match="batch_invariant=True supports the causal SDPA path"):
        model(torch.zeros(1, 4, dtype=torch.long), batch_invariant=True)
