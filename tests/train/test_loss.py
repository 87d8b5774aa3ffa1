import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.parallel._launch import run_ranks
from tidal.train.loss import (
    IGNORE_INDEX,
    CompiledChunk,
    chunk_cross_entropy,
    chunk_cross_entropy_in_place,
    chunk_logprobs,
    chunk_logprobs_in_place,
    cross_entropy_sum,
    token_logprobs,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_plain_cross_entropy(dtype):
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 7, 50)).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :2] = -100
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(
        ref_logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=-100
    )
    out = cross_entropy_sum(logits, labels, chunk_rows=4)  # several chunks, one partial
    torch.testing.assert_close(out, ref)
    (0.5 * out).backward()
    (0.5 * ref).backward()
    tol = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(logits.grad, ref_logits.grad, **tol)
    assert logits.grad.dtype == dtype
    assert (logits.grad[0, :2] == 0).all()


def test_no_grad_path():
    logits, labels = torch.randn(4, 10), torch.randint(0, 10, (4,))
    with torch.no_grad():
        out = cross_entropy_sum(logits[None], labels[None])
    torch.testing.assert_close(out, F.cross_entropy(logits, labels, reduction="sum"))


def test_fused_and_in_place_formulations_agree():
    # The fused form runs compiled on CUDA, the in-place one on CPU: keep both checked here.
    torch.manual_seed(1)
    x = 4 * torch.randn(33, 40)
    y = torch.randint(0, 40, (33,))
    y[3] = -100
    g1, g2 = torch.empty_like(x), torch.empty_like(x)
    torch.testing.assert_close(
        chunk_cross_entropy(x, y, g1), chunk_cross_entropy_in_place(x, y, g2)
    )
    torch.testing.assert_close(g1, g2)


# -- weighted cross entropy ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_cross_entropy_matches_reference(dtype):
    torch.manual_seed(2)
    logits = (3 * torch.randn(3, 7, 50)).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (3, 7))
    labels[1, 3:] = IGNORE_INDEX
    weights = torch.randn(3, 7)
    weights[1, 4] = float("nan")  # an ignored position's weight is never read
    ref_logits = logits.detach().clone().requires_grad_()
    per_token = F.cross_entropy(
        ref_logits.flatten(0, 1).float(),
        labels.flatten(),
        reduction="none",
        ignore_index=IGNORE_INDEX,
    )
    ref = (per_token * torch.where(labels.flatten() != IGNORE_INDEX, weights.flatten(), 0)).sum()
    out = cross_entropy_sum(logits, labels, chunk_rows=4, weights_BT=weights)
    torch.testing.assert_close(out, ref)
    out.backward()
    ref.backward()
    tol = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(logits.grad, ref_logits.grad, **tol)


def test_weighted_fused_and_in_place_formulations_agree():
    torch.manual_seed(3)
    x, y, w = 4 * torch.randn(33, 40), torch.randint(0, 40, (33,)), torch.rand(33)
    y[5] = IGNORE_INDEX
    g1, g2 = torch.empty_like(x), torch.empty_like(x)
    torch.testing.assert_close(
        chunk_cross_entropy(x, y, g1, w), chunk_cross_entropy_in_place(x, y, g2, w)
    )
    torch.testing.assert_close(g1, g2)


# -- per-token log-probs ---------------------------------------------------------------------


def _reference(logits, labels):
    """Plain fp32 log-softmax: log-probs of the labels (0 where ignored) and entropies."""
    logp_BTV = F.log_softmax(logits.float(), dim=-1)
    valid = labels != IGNORE_INDEX
    lp = logp_BTV.gather(2, labels.clamp(min=0)[..., None])[..., 0]
    ent = -(logp_BTV.exp() * logp_BTV).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_and_gradient_match_log_softmax(dtype):
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 7, 50)).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :2] = IGNORE_INDEX
    ref_logits = logits.detach().clone().requires_grad_()
    ref_lp, ref_ent = _reference(ref_logits, labels)
    lp, ent = token_logprobs(logits, labels, entropy=True, chunk_rows=4)  # a partial chunk
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == (3, 7)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent.detach())
    assert (lp[0, :2] == 0).all() and (ent[0, :2] == 0).all() and not ent.requires_grad
    g = torch.randn(3, 7)  # a different weight per token, as an RL loss gives
    (lp * g).sum().backward()
    (ref_lp * g).sum().backward()
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(logits.grad, ref_logits.grad, **tol)
    assert logits.grad.dtype == dtype and (logits.grad[0, :2] == 0).all()


def test_token_logprobs_without_grad_or_entropy():
    torch.manual_seed(1)
    logits, labels = torch.randn(2, 5, 30), torch.randint(0, 30, (2, 5))
    with torch.no_grad():
        lp, ent = token_logprobs(logits, labels)
    assert ent is None
    torch.testing.assert_close(lp, _reference(logits, labels)[0])


def test_fused_and_in_place_logprob_formulations_agree():
    # The fused form is compiled on CUDA, the in-place one runs on CPU: both checked here.
    torch.manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        x = (4 * torch.randn(33, 40)).to(dtype)
        y = torch.randint(0, 40, (33,))
        y[3] = IGNORE_INDEX
        g1, g2 = torch.empty_like(x), torch.empty_like(x)
        (lp1, e1), (lp2, e2) = (
            chunk_logprobs(x, y, g1, True),
            chunk_logprobs_in_place(x, y, g2, True),
        )
        torch.testing.assert_close(lp1, lp2)
        torch.testing.assert_close(e1, e2)
        torch.testing.assert_close(g1, g2)


def test_batch_invariant_logprobs_are_the_generators_bits():
    """In batch-invariant mode the log-probs are bitwise bi.log_softmax(x)[label] (what the
    Generator reports), whatever the chunking and the rows around them."""
    from tidal.models import batch_invariant as bi

    torch.manual_seed(4)
    logits = 5 * torch.randn(4, 25, 300)
    labels = torch.randint(0, 300, (4, 25))
    want = bi.log_softmax(logits.reshape(-1, 300)).gather(1, labels.reshape(-1, 1)).view(4, 25)
    for chunk in (16, 32, 4096):
        lp, _ = token_logprobs(logits, labels, batch_invariant=True, chunk_rows=chunk)
        assert torch.equal(lp, want), chunk
    one_row, _ = token_logprobs(logits[2:3, 7:8], labels[2:3, 7:8], batch_invariant=True)
    assert torch.equal(one_row[0, 0], want[2, 7])  # a decode step's single row
    with pytest.raises(ValueError, match="multiple of the batch-invariant row block"):
        token_logprobs(logits, labels, batch_invariant=True, chunk_rows=24)
    x = logits.clone().requires_grad_()
    lp, _ = token_logprobs(x, labels, batch_invariant=True, chunk_rows=32)
    lp.sum().backward()
    ref = logits.clone().requires_grad_()
    _reference(ref, labels)[0].sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match=r"logits \(2, 3, 5\) and labels \(2, 4\)"):
        token_logprobs(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


# -- memory: no fp32 [N, V] tensor at a 128k vocabulary ----------------------------------------


class _Allocations(TorchDispatchMode):
    """Records the bytes of every tensor an op returns (forward and backward), whatever the
    allocator: the largest fp32 one tells whether a full fp32 [N, V] buffer was made."""

    def __init__(self):
        super().__init__()
        self.fp32_max = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.fp32_max = max(self.fp32_max, t.untyped_storage().nbytes())
        return out


def test_no_fp32_logits_at_a_128k_vocabulary():
    N, V, chunk = 128, 128_256, 16
    torch.manual_seed(0)
    logits = torch.randn(2, N // 2, V, dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, V, (2, N // 2))
    full_fp32 = N * V * 4  # 65.7 MB
    naive = _Allocations()
    with naive:  # the mode catches the plain form: it cannot pass by construction
        F.cross_entropy(logits.detach().flatten(0, 1).float(), labels.flatten())
    assert naive.fp32_max >= full_fp32
    for entropy in (False, True):
        logits.grad = None
        seen = _Allocations()
        with seen:
            lp, _ = token_logprobs(logits, labels, entropy=entropy, chunk_rows=chunk)
            (lp * torch.randn(2, N // 2)).sum().backward()
        assert seen.fp32_max <= chunk * V * 4, (seen.fp32_max, chunk * V * 4)
        assert logits.grad.dtype == torch.bfloat16
    seen = _Allocations()
    with seen:
        cross_entropy_sum(logits, labels, chunk_rows=chunk, weights_BT=torch.rand(2, N // 2))
    assert seen.fp32_max <= chunk * V * 4


# -- vocabulary-sharded logits (loss-parallel tensor parallelism) ------------------------------


def _sharded_logprobs(rank, world, cases):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = []
    for logits, labels, g in cases:
        x = distribute_tensor(logits, mesh, [Shard(2)]).requires_grad_()
        lp, ent = token_logprobs(x, labels, entropy=True, chunk_rows=4)
        (lp * g).sum().backward()
        with torch.no_grad():
            lp_eval, _ = token_logprobs(x, labels)
        out.append((lp.detach(), ent, x.grad.full_tensor(), lp_eval, x.to_local().shape[-1]))
    return out


def test_vocabulary_sharded_logprobs_match_one_process(tmp_path):
    """TP=2 over gloo, an odd vocabulary (shards of 19 and 18 entries), labels on both
    shards and ignored ones, fp32 and bf16: values, entropies and gradients equal one
    process's."""
    torch.manual_seed(5)
    V, cases, refs = 37, [], []
    for dtype in (torch.float32, torch.bfloat16):
        logits = (3 * torch.randn(2, 5, V)).to(dtype)
        labels = torch.randint(0, V, (2, 5))
        labels[0, 0], labels[0, 1], labels[1, 4] = 0, V - 1, IGNORE_INDEX
        g = torch.randn(2, 5)
        ref_x = logits.clone().requires_grad_()
        ref_lp, ref_ent = token_logprobs(ref_x, labels, entropy=True)
        (ref_lp * g).sum().backward()
        cases.append((logits, labels, g))
        refs.append((ref_lp.detach(), ref_ent, ref_x.grad))
    results = run_ranks(2, _sharded_logprobs, cases, tmp_path=tmp_path)
    for rank, per_case in enumerate(results):
        for (lp, ent, grad, lp_eval, local_v), (ref_lp, ref_ent, ref_grad) in zip(
            per_case, refs, strict=True
        ):
            assert local_v == (19, 18)[rank]
            torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lp_eval, lp)
            torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
            tol = {} if grad.dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
            torch.testing.assert_close(grad, ref_grad, **tol)
            assert grad.dtype == ref_grad.dtype
    for a, b in zip(results[0], results[1], strict=True):
        assert torch.equal(a[0], b[0])  # the same plain tensor on every rank


@pytest.mark.slow
def test_compiled_logprob_chunk_matches_eager():
    """The fused chunk as CUDA compiles it, compiled by inductor on CPU here (a cold compile
    per variant takes seconds: slow-marked)."""
    compiled = torch.compile(chunk_logprobs, dynamic=False)
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for entropy in (False, True):
            x = (4 * torch.randn(64, 1000)).to(dtype)
            y = torch.randint(0, 1000, (64,))
            y[3] = IGNORE_INDEX
            g1, g2 = torch.empty_like(x), torch.empty_like(x)
            (lp1, e1), (lp2, e2) = (
                compiled(x, y, g1, entropy),
                chunk_logprobs_in_place(x, y, g2, entropy),
            )
            torch.testing.assert_close(lp1, lp2)
            torch.testing.assert_close(g1, g2)
            if entropy:
                torch.testing.assert_close(e1, e2, atol=2e-5, rtol=1e-5)


def test_cuda_chunk_kernels_compile_once_for_every_row_count(monkeypatch):
    """Full chunks run the static-shape kernel, shorter ones the dynamic one: an RL step's
    changing sequence length does not recompile per length."""
    calls = []

    def fake_compile(fn, dynamic):
        return lambda x, *a: calls.append((dynamic, x.shape[0]))

    monkeypatch.setattr(torch, "compile", fake_compile)
    kernel = CompiledChunk(lambda *a: None, rows=8)
    for rows in (8, 5, 8, 3):
        kernel(torch.zeros(rows, 2))
    assert calls == [(False, 8), (True, 5), (False, 8), (True, 3)]
