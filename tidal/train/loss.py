"""Token losses that never hold fp32 logits of the whole vocabulary: the cross entropy, and
per-token log-probs for an injected loss (RL).

Shapes: B batch, T time, N = B * T rows, V vocabulary (V_r: this rank's vocabulary shard), C
rows of one chunk.

`cross_entropy_sum(logits, labels)` returns the sum of token losses over labels != -100, like
`F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=-100)`, optionally
weighted per token. The plain form keeps an fp32 copy of the logits and fp32
log-probabilities alive for backward (for a 128k vocabulary at 4 x 4096 tokens that is 2 x
8.4 GB) and spends a dozen memory passes over them. Here the forward walks the rows in
chunks; for each chunk it computes the log-sum-exp in fp32 and writes d(loss)/d(logits) =
softmax - onehot straight into a buffer of the logits' dtype, which is all backward needs (it
only scales it by the incoming gradient). The logits can be freed as soon as the loss is
computed.

On CUDA the per-chunk math is compiled by inductor into two fused kernels (one reduction, one
pointwise pass): in benchmarks/train_throughput.py on an H200 this took the loss of Llama 3 1B
at batch 4 x 4096 from about 35 ms to a few ms per step. On CPU an in-place eager version runs.

`linear_cross_entropy_sum(h, weight, labels)` goes one step further and takes the final
hidden states and the output weight instead of the logits: per chunk it also runs the output
projection and both of its gradient products, so neither the logits nor their gradient exist
for all rows (the trainer's default loss, `training.fused_loss`).

`token_logprobs(logits, labels)` is the same scheme for per-token log-probs log p(label)
(fp32 [B, T], 0 where the label is -100), optionally with per-token entropies (detached, for
metrics): the forward writes d logp / d logits = onehot - softmax per chunk into a buffer of
the logits' dtype, and backward scales each row by its incoming gradient (in fp32, rounded
once into the buffer). So an RL loss over log-probs costs the memory of the cross entropy.
Variants:

- vocabulary-sharded logits (a DTensor `Shard(-1)` over a 1-D tensor-parallel mesh, what the
  output projection gives under `parallelism.loss_parallel`): a distributed log-sum-exp per
  chunk, two all-reduces over the shard's group (the rows' max, then the sums of exp, the
  label's logit and, for entropy, of p x); each rank writes the gradient of its own shard,
  backward needs no communication, and the result is the same plain tensor on every rank.
  Eager on every device (the per-chunk collectives keep it out of one compiled graph).
- `batch_invariant=True`: the log-softmax of tidal/models/batch_invariant.py per chunk (fixed
  blocks of rows), so the values are bitwise those the RL generator reports for the same
  logits (chunk sizes are multiples of the mode's row block). Eager.

The per-chunk kernels are public so that their two formulations can be checked against each
other on any machine: `chunk_cross_entropy` and `chunk_logprobs` are the fused forms that
CUDA runs compiled (`CompiledChunk`), `chunk_cross_entropy_in_place` and
`chunk_logprobs_in_place` the same math with in-place kernels that CPU runs eagerly. Each
takes one chunk of rows and writes its gradient into a buffer the caller owns.

`TokenLoss` is the protocol of a loss injected into the trainer's step (tidal/train/step.py):
it gets a micro-batch's per-token log-probs and returns its loss and metrics.

Precondition: backward runs at most once per forward (it scales the saved buffer in place).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from tidal.models import batch_invariant as bi

if TYPE_CHECKING:
    from tidal.train.data.loader import Batch

IGNORE_INDEX = -100
"""Label value for positions excluded from the loss (cross_entropy's default ignore_index)."""

CHUNK_ROWS = 4096
"""Rows per chunk: the only fp32 [C, V] tensors are one chunk's (2 GB at a 128k vocabulary on
CUDA, where the fused kernels want long chunks); a multiple of every batch-invariant row block."""


# -- cross entropy -------------------------------------------------------------------------


def chunk_cross_entropy(
    x_CV: torch.Tensor,
    labels_C: torch.Tensor,
    grad_CV: torch.Tensor | None,
    weights_C: torch.Tensor | None = None,
):
    """Summed cross entropy of one chunk of rows `x_CV` (any float dtype) against `labels_C`
    (IGNORE_INDEX: left out), each row's term times `weights_C` if given; writes
    d(loss)/d(x) = (softmax - onehot) x weight into `grad_CV` if given. The fused form that
    CUDA runs compiled; `chunk_cross_entropy_in_place` is the CPU one."""
    xf_CV = x_CV.float()
    valid_C = labels_C != IGNORE_INDEX
    safe_C = labels_C.clamp(min=0)
    lse_C = torch.logsumexp(xf_CV, dim=-1)
    target_C = xf_CV.gather(1, safe_C[:, None]).squeeze(1)
    scale_C = valid_C if weights_C is None else torch.where(valid_C, weights_C.float(), 0.0)
    loss = ((lse_C - target_C) * scale_C).sum()
    if grad_CV is not None:
        vocab_V = torch.arange(x_CV.shape[1], device=x_CV.device)
        onehot_CV = (vocab_V[None, :] == safe_C[:, None]).float()
        # Written in place: under compile the fused kernel stores straight into the buffer.
        grad_CV.copy_((torch.exp(xf_CV - lse_C[:, None]) - onehot_CV) * scale_C[:, None])
    return loss


def chunk_cross_entropy_in_place(
    x_CV: torch.Tensor,
    labels_C: torch.Tensor,
    grad_CV: torch.Tensor | None,
    weights_C: torch.Tensor | None = None,
):
    """`chunk_cross_entropy` with in-place kernels, for uncompiled (CPU) runs: 2.5x faster
    than the fused formulation run eagerly, with the same results."""
    xf_CV = x_CV.float()
    valid_C = labels_C != IGNORE_INDEX
    safe_C = labels_C.clamp(min=0)[:, None]
    lse_C = torch.logsumexp(xf_CV, dim=-1)
    scale_C = valid_C if weights_C is None else torch.where(valid_C, weights_C.float(), 0.0)
    loss = ((lse_C - xf_CV.gather(1, safe_C).squeeze(1)) * scale_C).sum()
    if grad_CV is not None:
        work = grad_CV if grad_CV.dtype == torch.float32 else torch.empty_like(xf_CV)
        torch.sub(xf_CV, lse_C[:, None], out=work).exp_()
        work.scatter_add_(1, safe_C, -torch.ones_like(safe_C, dtype=work.dtype))
        work.mul_(scale_C[:, None])
        if work is not grad_CV:
            grad_CV.copy_(work)
    return loss


class CompiledChunk:
    """A chunk kernel (`chunk_cross_entropy`, `chunk_logprobs`) compiled twice: with static
    shapes for full chunks of `rows` rows (the fastest code) and with a dynamic row count for
    any shorter one. A row count that changes from call to call (an RL step's longest rollout
    sets its sequence length) then costs one compile in all, not one per length (dynamo stops
    recompiling after its limit of 8 and runs the rest eagerly). The losses make one per
    chunk size, on CUDA.

    Example::

        kernel = CompiledChunk(chunk_logprobs, rows=4096)
        logp_C, ent_C = kernel(x_CV, labels_C, grad_CV, True)
    """

    def __init__(self, fn: Callable, rows: int) -> None:
        self.rows = rows
        self.full = torch.compile(fn, dynamic=False)
        self.part = torch.compile(fn, dynamic=True)

    def __call__(self, x_CV: torch.Tensor, *args: Any) -> Any:
        return (self.full if x_CV.shape[0] == self.rows else self.part)(x_CV, *args)


@functools.cache
def _compiled_chunk(rows: int) -> CompiledChunk:
    return CompiledChunk(chunk_cross_entropy, rows)


class _CrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, labels_N, chunk, weights_N):
        N = logits_NV.shape[0]
        want_grad = logits_NV.requires_grad
        chunk_fn = _compiled_chunk(chunk) if logits_NV.is_cuda else chunk_cross_entropy_in_place
        loss = torch.zeros((), dtype=torch.float32, device=logits_NV.device)
        grad_NV = torch.empty_like(logits_NV) if want_grad else None
        for start in range(0, N, chunk):
            end = min(N, start + chunk)
            grad_CV = grad_NV[start:end] if grad_NV is not None else None
            if weights_N is None:  # the unweighted call of the unweighted loss, bit for bit
                loss += chunk_fn(logits_NV[start:end], labels_N[start:end], grad_CV)
            else:
                loss += chunk_fn(
                    logits_NV[start:end], labels_N[start:end], grad_CV, weights_N[start:end]
                )
        if want_grad:
            ctx.save_for_backward(grad_NV)
        return loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (grad_NV,) = ctx.saved_tensors
        return grad_NV.mul_(grad_out.to(grad_NV.dtype)), None, None, None


def cross_entropy_sum(
    logits_BTV: torch.Tensor,
    labels_BT: torch.Tensor,
    chunk_rows: int = CHUNK_ROWS,
    weights_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum of next-token cross entropies (fp32) over labels that are not -100, each token's
    multiplied by `weights_BT` if given (treated as constants: no gradient reaches them)."""
    V = logits_BTV.shape[-1]
    weights_N = None if weights_BT is None else weights_BT.detach().reshape(-1)
    return _CrossEntropySum.apply(
        logits_BTV.reshape(-1, V), labels_BT.reshape(-1), chunk_rows, weights_N
    )


# -- cross entropy fused with the output projection ---------------------------------------


def _mm_into_fp32(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a @ b in fp32 (a, b of any float dtype): on CUDA the product of low-precision
    inputs is summed into fp32 inside the GEMM (out_dtype), never rounded to bf16 first."""
    if a.dtype == torch.float32:
        return torch.mm(a, b) if acc is None else acc.addmm_(a, b)
    if a.is_cuda:
        if acc is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(acc, a, b, out_dtype=torch.float32)
    prod = torch.mm(a.float(), b.float())  # CPU has no mixed-dtype GEMM
    return prod if acc is None else acc.add_(prod)


class _LinearCrossEntropySum(torch.autograd.Function):
    """Summed cross entropy of h @ w.T, the rows in chunks: each chunk's logits, their
    gradient and both GEMMs of backward run in forward, so neither the logits nor their
    gradient ever exist for all rows; backward only scales the saved d(loss)/dh and
    d(loss)/dw (fp32, summed over chunks inside the GEMM)."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, chunk, weights_N, dtype, grad_enabled):
        # Inside forward grad mode is always off: whether the caller's was is passed in, so a
        # no_grad call (validation) runs one GEMM per chunk, not three.
        want_h = grad_enabled and ctx.needs_input_grad[0]
        want_w = grad_enabled and ctx.needs_input_grad[1]
        chunk_fn = _compiled_chunk(chunk) if h_ND.is_cuda else chunk_cross_entropy_in_place
        N = h_ND.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        grad_ND = torch.empty(h_ND.shape, dtype=dtype, device=h_ND.device) if want_h else None
        grad_VD: torch.Tensor | None = None
        with torch.autocast(h_ND.device.type, enabled=False):
            hc_ND, wc_VD = h_ND.to(dtype), w_VD.to(dtype)
            for start in range(0, N, chunk):
                end = min(N, start + chunk)
                x_CV = torch.mm(hc_ND[start:end], wc_VD.t())
                g_CV = torch.empty_like(x_CV) if want_h or want_w else None
                extra = () if weights_N is None else (weights_N[start:end],)
                loss += chunk_fn(x_CV, labels_N[start:end], g_CV, *extra)
                del x_CV  # one chunk of logits alive at a time
                if g_CV is None:
                    continue
                if grad_ND is not None:
                    torch.mm(g_CV, wc_VD, out=grad_ND[start:end])
                if want_w:
                    grad_VD = _mm_into_fp32(grad_VD, g_CV.t(), hc_ND[start:end])
        ctx.save_for_backward(grad_ND, grad_VD)
        ctx.dtypes = (h_ND.dtype, w_VD.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_ND, grad_VD = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        dh = None if grad_ND is None else (grad_ND.float() * grad_out).to(h_dtype)
        dw = None if grad_VD is None else grad_VD.mul_(grad_out).to(w_dtype)
        return dh, dw, None, None, None, None, None


def linear_cross_entropy_sum(
    h_BTD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_BT: torch.Tensor,
    chunk_rows: int = CHUNK_ROWS,
    weights_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """`cross_entropy_sum(F.linear(h_BTD, weight_VD), labels_BT)` without the logits: the
    output projection and the loss run together over chunks of rows, so at most one chunk's
    logits and their gradient exist (for Llama 3 1B at 4 x 4096 tokens, 2 x 1 GB instead of
    2 x 4.2 GB), and backward makes no pass over [N, V] tensors. What it holds instead until
    backward: d(loss)/d(weight) in fp32, [V, D] (1 GB for Llama 3 1B; while a chunk is added
    on CUDA a second one exists briefly), and d(loss)/dh, [N, D]. So it saves memory when
    N is well above D, as in training batches; for a few hundred tokens and a large
    vocabulary the plain loss holds less.

    The GEMMs run in the autocast dtype when autocast is on (as `F.linear` would), else in
    the inputs' common dtype; the loss and d(loss)/d(weight) are summed in fp32. Gradients
    reach `h_BTD` and `weight_VD` (backward at most once per forward); `weights_BT`, as in
    `cross_entropy_sum`, is a constant.

    Example (what `training.fused_loss` does; `output_weight()` is the embedding when tied)::

        head = functools.partial(linear_cross_entropy_sum, labels_BT=ids[:, 1:])
        loss = model(ids[:, :-1], head=head) / n_tokens
    """
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    if h_BTD.shape[:-1] != labels_BT.shape or h_BTD.shape[-1] != weight_VD.shape[-1]:
        raise ValueError(
            f"hidden states {tuple(h_BTD.shape)}, weight {tuple(weight_VD.shape)} and labels "
            f"{tuple(labels_BT.shape)} do not fit: need [..., D], [V, D] and [...]"
        )
    device_type = h_BTD.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = torch.promote_types(h_BTD.dtype, weight_VD.dtype)
    weights_N = None if weights_BT is None else weights_BT.detach().reshape(-1)
    return _LinearCrossEntropySum.apply(
        h_BTD.reshape(-1, h_BTD.shape[-1]),
        weight_VD,
        labels_BT.reshape(-1),
        chunk_rows,
        weights_N,
        dtype,
        torch.is_grad_enabled() and (h_BTD.requires_grad or weight_VD.requires_grad),
    )


# -- per-token log-probs -------------------------------------------------------------------


def chunk_logprobs(x_CV, labels_C, grad_CV, entropy: bool):
    """Per-row log p(label) of one chunk of rows `x_CV` (fp32 [C], 0 where the label is
    IGNORE_INDEX) and, with `entropy`, each row's entropy (fp32 [C], else None); writes
    d logp / d x = onehot - softmax, masked to valid rows, into `grad_CV` if given. The fused
    form that CUDA runs compiled; `chunk_logprobs_in_place` is the CPU one."""
    xf_CV = x_CV.float()
    valid_C = labels_C != IGNORE_INDEX
    safe_C = labels_C.clamp(min=0)
    lse_C = torch.logsumexp(xf_CV, dim=-1)
    target_C = xf_CV.gather(1, safe_C[:, None]).squeeze(1)
    logp_C = torch.where(valid_C, target_C - lse_C, 0.0)
    p_CV = torch.exp(xf_CV - lse_C[:, None])
    ent_C = None
    if entropy:
        # H = sum p (lse - x): non-negative terms (lse - sum p x would cancel digits).
        ent_C = torch.where(valid_C, (p_CV * (lse_C[:, None] - xf_CV)).sum(-1), 0.0)
    if grad_CV is not None:
        vocab_V = torch.arange(x_CV.shape[1], device=x_CV.device)
        onehot_CV = (vocab_V[None, :] == safe_C[:, None]).float()
        grad_CV.copy_((onehot_CV - p_CV) * valid_C[:, None])
    return logp_C, ent_C


def chunk_logprobs_in_place(x_CV, labels_C, grad_CV, entropy: bool):
    """`chunk_logprobs` with in-place kernels, for uncompiled (CPU) runs, with the same
    results."""
    xf_CV = x_CV.float()  # x itself when fp32: never written below
    invalid_C = labels_C == IGNORE_INDEX
    safe_C1 = labels_C.clamp(min=0)[:, None]
    lse_C = torch.logsumexp(xf_CV, dim=-1)
    logp_C = (xf_CV.gather(1, safe_C1).squeeze(1) - lse_C).masked_fill_(invalid_C, 0.0)
    ent_C = None
    if entropy or grad_CV is not None:
        fp32_out = grad_CV is not None and grad_CV.dtype == torch.float32
        p_CV = grad_CV if fp32_out else torch.empty_like(xf_CV)
        torch.sub(xf_CV, lse_C[:, None], out=p_CV).exp_()
        if entropy:
            ent_C = torch.einsum("cv,cv->c", p_CV, lse_C[:, None] - xf_CV)  # sum p (lse - x)
            ent_C.masked_fill_(invalid_C, 0.0)
        if grad_CV is not None:
            p_CV.neg_().scatter_add_(1, safe_C1, torch.ones_like(safe_C1, dtype=p_CV.dtype))
            p_CV.masked_fill_(invalid_C[:, None], 0.0)
            if not fp32_out:
                grad_CV.copy_(p_CV)
    return logp_C, ent_C


def _chunk_logprobs_bi(x_CV, labels_C, grad_CV, entropy: bool):
    """Batch-invariant: the generator's fixed-order log-softmax, then the label's entry."""
    logp_CV = bi.log_softmax(x_CV)  # fp32 [C, V], rows in fixed blocks (as the generator)
    invalid_C = labels_C == IGNORE_INDEX
    safe_C1 = labels_C.clamp(min=0)[:, None]
    logp_C = logp_CV.gather(1, safe_C1).squeeze(1).masked_fill_(invalid_C, 0.0)
    ent_C = None
    if entropy or grad_CV is not None:
        p_CV = logp_CV.exp()
        if entropy:
            ent_C = torch.einsum("cv,cv->c", p_CV, logp_CV).neg_().masked_fill_(invalid_C, 0.0)
        if grad_CV is not None:
            p_CV.neg_().scatter_add_(1, safe_C1, torch.ones_like(safe_C1, dtype=p_CV.dtype))
            grad_CV.copy_(p_CV.masked_fill_(invalid_C[:, None], 0.0))
    return logp_C, ent_C


def _chunk_logprobs_sharded(x_CV, labels_C, grad_CV, entropy: bool, group, offset: int):
    """Vocabulary-parallel: x_CV holds vocabulary entries [offset, offset + V_r) of every
    row; the log-sum-exp and the label's logit are reduced over `group`."""
    xf_CV = x_CV.float()
    V_r = x_CV.shape[1]
    valid_C = labels_C != IGNORE_INDEX
    local_C = labels_C - offset
    own_C = valid_C & (local_C >= 0) & (local_C < V_r)  # this rank holds the label's logit
    safe_C1 = local_C.clamp(0, V_r - 1)[:, None]
    m_C = xf_CV.amax(dim=-1)
    dist.all_reduce(m_C, op=dist.ReduceOp.MAX, group=group)
    e_CV = torch.exp(xf_CV - m_C[:, None])
    parts = [e_CV.sum(-1), torch.where(own_C, xf_CV.gather(1, safe_C1).squeeze(1), 0.0)]
    if entropy:  # H = log S + sum e (m - x) / S: non-negative terms, no cancellation
        parts.append(torch.einsum("cv,cv->c", e_CV, m_C[:, None] - xf_CV))
    sums_KC = torch.stack(parts)
    dist.all_reduce(sums_KC, group=group)  # S = sum of exp, the label's logit, the H term
    lse_C = m_C + sums_KC[0].log()
    logp_C = torch.where(valid_C, sums_KC[1] - lse_C, 0.0)
    ent_C = None
    if entropy:
        ent_C = torch.where(valid_C, sums_KC[0].log() + sums_KC[2] / sums_KC[0], 0.0)
    if grad_CV is not None:
        p_CV = e_CV.div_(sums_KC[0][:, None])
        p_CV.neg_().scatter_add_(1, safe_C1, own_C[:, None].to(p_CV.dtype))
        grad_CV.copy_(p_CV.mul_(valid_C[:, None]))
    return logp_C, ent_C


@functools.cache
def _compiled_logprobs(rows: int) -> CompiledChunk:
    return CompiledChunk(chunk_logprobs, rows)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, labels_N, chunk, entropy, chunk_fn):
        N = logits_NV.shape[0]
        logp_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
        ent_N = torch.zeros(N if entropy else 0, dtype=torch.float32, device=logits_NV.device)
        grad_NV = torch.empty_like(logits_NV) if logits_NV.requires_grad else None
        for start in range(0, N, chunk):
            end = min(N, start + chunk)
            grad_CV = grad_NV[start:end] if grad_NV is not None else None
            lp_C, ent_C = chunk_fn(logits_NV[start:end], labels_N[start:end], grad_CV, entropy)
            logp_N[start:end] = lp_C
            if ent_C is not None:
                ent_N[start:end] = ent_C
        ctx.mark_non_differentiable(ent_N)
        if grad_NV is not None:
            ctx.save_for_backward(grad_NV)
        return logp_N, ent_N

    @staticmethod
    def backward(ctx, grad_N, _grad_ent):
        (grad_NV,) = ctx.saved_tensors
        # In place, computed in fp32 and rounded once into the buffer's dtype.
        return grad_NV.mul_(grad_N[:, None]), None, None, None, None


def token_logprobs(
    logits_BTV: torch.Tensor,
    labels_BT: torch.Tensor,
    *,
    entropy: bool = False,
    batch_invariant: bool = False,
    chunk_rows: int = CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of the labels, log softmax(logits)[label], without fp32 logits of
    the whole vocabulary (see the module docstring).

    Args:
        logits_BTV: logits in any float dtype; or a DTensor sharded over the vocabulary
            (`Shard(-1)` on a 1-D mesh), as under loss-parallel tensor parallelism.
        labels_BT: int64 label ids; IGNORE_INDEX (-100) where excluded.
        entropy: also return each position's entropy of softmax(logits) (detached).
        batch_invariant: the generator's fixed-order log-softmax (bitwise the log-probs the
            RL Generator reports in batch-invariant mode); plain logits only.
        chunk_rows: rows per chunk (a multiple of 128 with `batch_invariant`).

    Returns:
        (logprobs, entropy): fp32 [B, T], 0 where the label is IGNORE_INDEX; logprobs is
        differentiable (backward at most once), entropy is None unless asked for. Plain
        tensors, the same on every rank for sharded logits.

    Raises:
        ValueError: mismatched shapes, a DTensor not sharded over the vocabulary on one mesh
            dimension, batch_invariant with a DTensor, or a chunk size the mode cannot use.

    Example::

        logp, ent = token_logprobs(model(ids)[:, :-1], ids[:, 1:], entropy=True)
        (-(logp * advantages[:, None]).sum()).backward()
    """
    from torch.distributed.tensor import DTensor, Shard

    if logits_BTV.shape[:-1] != labels_BT.shape:
        raise ValueError(
            f"logits {tuple(logits_BTV.shape)} and labels {tuple(labels_BT.shape)} must agree "
            "in every dimension but the last"
        )
    B, T, V = *labels_BT.shape, logits_BTV.shape[-1]
    labels_N = labels_BT.reshape(-1)
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    if isinstance(logits_BTV, DTensor):
        mesh, placements = logits_BTV.device_mesh, logits_BTV.placements
        if mesh.ndim != 1 or placements[0] not in (Shard(-1), Shard(logits_BTV.dim() - 1)):
            raise ValueError(
                "token_logprobs takes a DTensor sharded over the vocabulary on a 1-D mesh "
                f"(Shard(-1)), got placements {placements} on a {mesh.ndim}-D mesh"
            )
        if batch_invariant:
            raise ValueError(
                "batch_invariant=True needs plain logits; vocabulary-sharded ones (tensor "
                "parallel) are not computed in a fixed order"
            )
        local_BTV = logits_BTV.to_local()
        # Shard(-1) splits as torch.chunk does: every rank but the last ones ceil(V / n).
        offset = min(mesh.get_local_rank() * -(-V // mesh.size()), V)
        fn = functools.partial(_chunk_logprobs_sharded, group=mesh.get_group(), offset=offset)
        logits_NV = local_BTV.reshape(-1, local_BTV.shape[-1])
    else:
        logits_NV = logits_BTV.reshape(-1, V)
        if batch_invariant:
            if chunk_rows % bi.row_block(logits_BTV.device):
                raise ValueError(
                    f"chunk_rows={chunk_rows} must be a multiple of the batch-invariant row "
                    f"block ({bi.row_block(logits_BTV.device)} on {logits_BTV.device.type})"
                )
            fn = _chunk_logprobs_bi
        else:
            fn = _compiled_logprobs(chunk_rows) if logits_BTV.is_cuda else chunk_logprobs_in_place
    logp_N, ent_N = _TokenLogprobs.apply(logits_NV, labels_N, chunk_rows, entropy, fn)
    return logp_N.view(B, T), (ent_N.view(B, T) if entropy else None)


# -- injected losses -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepNorms:
    """Step-wide normalizers of an injected loss: totals over every micro-batch of the step
    and every data-parallel rank (Python numbers in one process, else 0-dim device tensors,
    so a step needs no host sync)."""

    tokens: float | torch.Tensor
    """Valid labels (label != IGNORE_INDEX), at least 1."""
    sequences: float | torch.Tensor
    """Rows with at least one valid label, at least 1."""


class TokenLoss(Protocol):
    """A loss the trainer's step calls once per micro-batch (`Trainer.train_step(batches,
    n_tokens, loss=...)`), on every layout: under pipeline parallel on the last stage, inside
    the schedule.

    Called as `loss(logprobs, batch, norms, entropy)` with:

    - logprobs: fp32 [B, T] log p(labels) under the model being trained (differentiable;
      0 where the label is IGNORE_INDEX), from `token_logprobs`;
    - batch: the micro-batch (`Batch`: its labels and `extras`, e.g. advantages and old
      log-probs, sliced to the same rows);
    - norms: `StepNorms` of the whole step;
    - entropy: fp32 [B, T] detached per-token entropies when `wants_entropy`, else None.

    Returns (loss, metrics): the micro-batch's share of the step loss (a 0-dim tensor; the
    step minimizes the sum over micro-batches and data-parallel ranks, so normalize by
    `norms`, not by the micro-batch's own counts), and 0-dim detached tensors that the step
    reduces over micro-batches and data-parallel ranks: by sum, except names ending in
    "_max" (max) or "_min" (min). Return a metric's share of the step (e.g. a count divided
    by `norms.tokens`), so that the sum is the step's value. Every call returns the same keys.
    """

    wants_entropy: bool
    """Whether `entropy` is computed and passed (one more pass per chunk)."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        batch: Batch,
        norms: StepNorms,
        entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


@dataclass(frozen=True, slots=True)
class CrossEntropy:
    """The next-token cross entropy as a `TokenLoss`: the sum of -logprobs over valid labels
    / `norms.tokens`, each token weighted by `batch.extras[weights]` when that key is set.

    Unweighted it equals the trainer's default loss (`train_step(..., loss=None)`), which is
    faster: it computes the cross entropy straight from the logits.
    """

    weights: str | None = None
    """Name of a [B, T] float extra weighting each token, or None."""
    wants_entropy: bool = False

    def __call__(self, logprobs, batch, norms, entropy):
        nll_BT = -logprobs
        if self.weights is not None:
            if self.weights not in batch.extras:
                raise KeyError(
                    f"CrossEntropy(weights={self.weights!r}): the batch has no such extra "
                    f"(it has {sorted(batch.extras)})"
                )
            nll_BT = nll_BT * batch.extras[self.weights]
        loss = nll_BT.sum() / norms.tokens
        return loss, {"loss": loss.detach()}
