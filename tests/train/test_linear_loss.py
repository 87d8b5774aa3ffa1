"""The cross entropy fused with the output projection (`linear_cross_entropy_sum`): values and
gradients against the plain projection + loss, memory (no [N, V] tensor), and the trainer's
use of it against the unfused path."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.train.test_loss import _Allocations
from tests.train.test_trainer import tiny_trainer
from tidal.train.loss import IGNORE_INDEX, cross_entropy_sum, linear_cross_entropy_sum


def _case(seed=0, B=2, T=75, D=24, V=97):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g)
    w = torch.randn(V, D, generator=g) / D**0.5
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :9] = IGNORE_INDEX
    labels[1, -1] = IGNORE_INDEX
    return h, w, labels


def _reference(h, w, labels, weights=None):
    nll = F.cross_entropy(
        F.linear(h, w).flatten(0, 1).float(),
        labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return (nll if weights is None else nll * weights.flatten()).sum()


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("chunk", [16, 150, 4096])  # partial last chunk, exact, one chunk
def test_matches_projection_then_cross_entropy_in_fp32(weighted, chunk):
    h, w, labels = _case()
    weights = torch.rand(labels.shape, generator=torch.Generator().manual_seed(3))
    weights = weights if weighted else None
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = linear_cross_entropy_sum(h1, w1, labels, chunk_rows=chunk, weights_BT=weights)
    ref = _reference(h2, w2, labels, weights)
    torch.testing.assert_close(out, ref)
    (0.37 * out).backward()  # backward scales by the incoming gradient
    (0.37 * ref).backward()
    torch.testing.assert_close(h1.grad, h2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)
    assert (h1.grad[0, :9] == 0).all()  # ignored positions get no gradient


def test_under_bf16_autocast_it_matches_the_unfused_loss():
    h, w, labels = _case(seed=1)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy_sum(h1, w1, labels, chunk_rows=32)
        ref = cross_entropy_sum(F.linear(h2, w2), labels)  # the trainer's unfused loss
    torch.testing.assert_close(out, ref)  # the same bf16 logits, fp32 sums
    out.backward()
    ref.backward()
    assert h1.grad.dtype == w1.grad.dtype == torch.float32  # the parameters' dtypes
    # The unfused path rounds d(loss)/dw to bf16 once; the fused one sums chunks in fp32.
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-2, rtol=2e-2)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-2, rtol=2e-2)


def test_bf16_inputs_without_autocast_get_bf16_gradients():
    h, w, labels = _case(seed=2)
    h = h.bfloat16().requires_grad_()
    w = w.bfloat16().requires_grad_()  # as under FSDP's bf16 parameters
    linear_cross_entropy_sum(h, w, labels, chunk_rows=64).backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    ref_h, ref_w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    _reference(ref_h.float(), ref_w.float(), labels).backward()
    torch.testing.assert_close(h.grad.float(), ref_h.grad.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(w.grad.float(), ref_w.grad.float(), atol=2e-2, rtol=2e-2)


def test_gradient_to_one_input_only_and_no_grad():
    h, w, labels = _case(seed=4)
    ref = _reference(h, w, labels)
    h1 = h.clone().requires_grad_()
    out = linear_cross_entropy_sum(h1, w, labels, chunk_rows=40)
    out.backward()
    h2 = h.clone().requires_grad_()
    _reference(h2, w, labels).backward()
    torch.testing.assert_close(h1.grad, h2.grad)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy_sum(h, w, labels), ref)


def test_no_grad_runs_only_the_logits_products():
    """Under no_grad (validation) with parameters that require grad, each chunk runs its
    logits GEMM only: no gradient GEMMs, no [N, D] or [V, D] gradient buffers."""
    h, w, labels = _case(seed=6)
    h, w = h.requires_grad_(), w.requires_grad_()
    n_chunks = -(-labels.numel() // 40)
    for grad, products in ((False, n_chunks), (True, 3 * n_chunks)):
        ops = _Products()
        with torch.set_grad_enabled(grad), ops:
            linear_cross_entropy_sum(h, w, labels, chunk_rows=40)
        assert ops.count == products, (grad, ops.count)


class _Products(TorchDispatchMode):
    """Counts the matrix products (mm, addmm, their out= and in-place forms) run under it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_never_holds_logits_or_their_gradient_for_every_row():
    N, D, V, chunk = 256, 16, 32_000, 32
    g = torch.Generator().manual_seed(5)
    h = torch.randn(2, N // 2, D, generator=g).requires_grad_()
    w = torch.randn(V, D, generator=g).requires_grad_()
    labels = torch.randint(0, V, (2, N // 2), generator=g)
    naive = _Allocations()
    with naive:  # the mode catches the unfused form: it cannot pass by construction
        cross_entropy_sum(F.linear(h, w), labels).backward()
    assert naive.fp32_max >= N * V * 4
    seen = _Allocations()
    with seen:
        linear_cross_entropy_sum(h, w, labels, chunk_rows=chunk).backward()
    # One chunk's logits at most, and d(loss)/dw itself ([V, D], here smaller than a chunk).
    assert seen.fp32_max <= max(chunk * V, V * D) * 4, seen.fp32_max


def test_mismatched_shapes_are_named():
    h, w, labels = _case()
    with pytest.raises(ValueError, match="do not fit"):
        linear_cross_entropy_sum(h, w[:, :-1], labels)
    with pytest.raises(ValueError, match="do not fit"):
        linear_cross_entropy_sum(h, w, labels[:, :-1])


@pytest.mark.parametrize("tied", [False, True])
def test_trainer_steps_match_the_unfused_loss(tmp_path, tied):
    """The trainer's default loss runs fused (training.fused_loss, the default); the same
    steps with it off give the same losses and weights (fp32 on CPU: summation order only)."""
    extra = ["--model.flavor", "debug_qwen3"] if tied else []  # tied embeddings
    runs = []
    for fused in ("true", "false"):
        t = tiny_trainer(
            tmp_path / fused, "--training.fused_loss", fused, "--training.steps", "4", *extra
        )
        assert t.path.fused_loss == (fused == "true")
        assert (t.model.output is None) == tied
        losses = [float(t.train_step(*t.next_batches()[:2]).loss) for _ in range(4)]
        runs.append((losses, {k: v.clone() for k, v in t.model.state_dict().items()}))
    (fused_losses, fused_sd), (plain_losses, plain_sd) = runs
    torch.testing.assert_close(fused_losses, plain_losses, rtol=1e-5, atol=1e-6)
    for name, value in fused_sd.items():
        torch.testing.assert_close(value, plain_sd[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_matches_the_unfused_loss():
    """CUDA: compiled chunk kernels, bf16 GEMMs, d(loss)/dw summed into fp32 by the GEMM."""
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, D, V = 2, 2500, 256, 50_000
    h = torch.randn(B, T, D, device="cuda", generator=g)
    w = torch.randn(V, D, device="cuda", generator=g) / D**0.5
    labels = torch.randint(0, V, (B, T), device="cuda", generator=g)
    labels[0, :100] = IGNORE_INDEX
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = linear_cross_entropy_sum(h1, w1, labels, chunk_rows=1024)
        ref = cross_entropy_sum(F.linear(h2, w2), labels, chunk_rows=1024)
    torch.testing.assert_close(out, ref)
    (out / 4000).backward()
    (ref / 4000).backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=2e-2)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=2e-2)
    fp32_ref = torch.autograd.grad(_reference(h, w.requires_grad_(), labels) / 4000, w)[0]
    # Summed in fp32 across chunks, the fused gradient is at least as close to fp32 math.
    fused_err = (w1.grad - fp32_ref).abs().max()
    plain_err = (w2.grad - fp32_ref).abs().max()
    assert fused_err <= 1.05 * plain_err, (fused_err, plain_err)
