"""Batch-invariant kernels: every row's result is independent of the rest of the batch.

A matmul, a norm or a log-softmax computes each output row with some reduction order, and
the libraries (MKL, cuBLAS, ATen reductions) pick that order from the shapes: how many rows,
how long the sequence. So the same token gets different low bits when it is decoded in a
batch of 64, prefilled with a 128-token prompt, or scored by the trainer in a batch of 4 x
4096. This module removes every such dependence by making each kernel call see one fixed
shape:

- Matmuls (`aten.mm`, `aten.addmm`, and `aten.bmm` with one shared weight, as a linear layer
  on a 3-D input may produce): the rows are cut into blocks of `row_block(device)` rows
  (padded with zeros), one call per block. A row's result then depends only on the row and
  the weight, not on M.
  Each block's product cuts K into `K_PARTS` parts summed by a fixed tree (`tree_sum`), so
  the order of a weight's sum does not depend on how tensor parallelism splits K either.
- Row reductions over the last dim (`mean` and `sum` as in RMSNorm, `_log_softmax`,
  `_softmax`, the fused RMSNorm kernel of CUDA): the same fixed row blocks. Each
  replacement returns the dtypes of the kernel it replaces (RMSNorm: rows in the input
  dtype, rstd in fp32), so a bf16 model stays bf16.
- Attention (`attention` below, called by the model): keys and values in fixed chunks of
  `KV_CHUNK` positions, an online softmax that combines the chunks in increasing order, and
  matmuls of one shape: the queries are cut into fixed blocks of columns per key head
  (padded), and each call takes a fixed number of (key head, query block) problems (padded).
  A query at position p does the same arithmetic whether it is one of 4096 training queries
  or the only query of a decode step: chunks past p are exact no-ops (weights exp(-inf) = 0,
  rescale exp(0) = 1), and the keys past p inside p's chunk are masked to -inf before the
  exponent.

`BatchInvariantMode` is a TorchDispatchMode: it sees the aten ops under autograd and
autocast, replaces the ones above in the forward pass and lets the backward pass run the
normal kernels (gradients need not be invariant). With DTensor arguments (tensor
parallelism) it runs the same replacements on the local shards, and sums a row-parallel
layer's partial sums over ranks in a fixed order (tidal/models/batch_invariant_tp.py).
`Transformer.forward(..., batch_invariant=True)` enters it and switches attention to the
chunked kernel; the trainer's scoring path (tidal.generate.logprobs) and the generator call
the same forward.

Where this departs from the reference designs (Thinking Machines' batch_invariant_ops, which
write persistent Triton kernels): plain PyTorch ops at fixed shapes, so the same code runs on
CPU and CUDA, under autograd, inside CUDA graphs, and on tensor-parallel DTensor shards.
The invariance then rests on a library computing a given shape the same way each time,
which holds for MKL and ATen on CPU (tests/generate/test_batch_invariant.py checks bit
equality) and for cuBLAS at a fixed shape, layout, alignment and workspace: every matmul
call of the mode has one shape per weight (linear layers) or one shape in all (attention),
whatever the batch, the sequence length or the number of queries (`-m gpu` checks bf16 on
CUDA).
On CPU, the elementwise ops are exact as long as ATen's threads split tensors at multiples of
its vector width, true for power-of-two thread counts and the model widths used here.

Cost: see benchmarks/generate.md (batch-invariant rows); it is a mode for exact parity, not
the fast path.

Shape legend: B batch, H query heads, G key/value heads, J = H / G query heads per key head,
T queries, S keys, K head dim, C keys per chunk, X = B * G key heads, Q = T * J query
columns per key head, N query columns per problem, P problems (key head x query block),
M rows.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode_temporarily,
)

KV_CHUNK = 64
"""Keys per attention chunk: the decode split of the KV cache by a fixed size (not count)."""

K_PARTS = 8
"""Parts of a matmul's reduction dim (each weight's K, where it divides): each part's product
is computed on its own and the parts are summed by a fixed tree (`tree_sum`). A row-parallel
layer sharded over TP ranks (a power of two up to K_PARTS) then computes the same subtrees
on its ranks, and the mode's fixed-order all-reduce adds them as the tree's top levels: TP 2
gives the bits of TP 1."""

_ROW_BLOCK = {"cpu": 16, "cuda": 128}
_QUERY_BLOCK = {"cpu": 8, "cuda": 16}
_PROBLEM_BLOCK = {"cpu": 32, "cuda": 256}


_TRITON = {"on": os.environ.get("TIDAL_BI_TRITON", "") == "1", "cpu": False}


def use_triton(enabled: bool, *, on_cpu: bool = False) -> None:
    """Run the mode on CUDA with the Triton kernels of tidal/kernels/batch_invariant.py (one
    launch per matmul, RMSNorm, log-softmax and attention) instead of the torch path's
    fixed-shape blocks of library calls. Off by default (also TIDAL_BI_TRITON=1); CPU tensors
    take the torch path unless `on_cpu` (only under Triton's interpreter, TRITON_INTERPRET=1:
    the tests of the wiring). The two paths give different bits: turn it on for the trainer
    and the generator alike."""
    _TRITON["on"], _TRITON["cpu"] = enabled, enabled and on_cpu


def _triton_for(x: torch.Tensor):
    """The Triton kernels module when they are on for x's device, else None."""
    if not (_TRITON["on"] and (x.is_cuda or _TRITON["cpu"])):
        return None
    from tidal.kernels import batch_invariant as kernels

    return kernels


def row_block(device: torch.device) -> int:
    """Rows per matmul/reduction call. 16 on CPU (MKL takes other paths below 16 rows);
    128 on CUDA, one cuBLAS tile height, so a decode batch of up to 128 rows is one call."""
    return _ROW_BLOCK.get(device.type, 128)


def query_block(device: torch.device) -> int:
    """Query columns per attention problem (one key head): 16 on CUDA, 8 on CPU. A decode
    step has J = heads / key heads columns per key head and pads them to this; a prefill of
    T tokens has T * J columns, in blocks of this."""
    return _QUERY_BLOCK.get(device.type, 16)


def problem_block(device: torch.device) -> int:
    """Attention problems (key head x query block) per matmul call: 256 on CUDA, 32 on CPU."""
    return _PROBLEM_BLOCK.get(device.type, 256)


def by_rows(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Any:
    """fn over fixed blocks of rows of x (all dims but the last are rows), concatenated.

    fn returns a tensor or a tuple of tensors (a kernel with several outputs, each with rows
    in its first dim); each output is concatenated on its own, so it keeps the dtype fn gives
    it (RMSNorm's normed rows in the input dtype, its rstd in fp32).
    """
    lead, D = x.shape[:-1], x.shape[-1]
    x_MD = x.reshape(-1, D)
    M, R = x_MD.shape[0], row_block(x.device)
    pad = (-M) % R
    if pad:
        x_MD = torch.cat([x_MD, x_MD.new_zeros(pad, D)])
    blocks = [fn(x_MD[i : i + R]) for i in range(0, M + pad, R)] or [fn(x_MD)]  # M = 0

    def join(parts: list[torch.Tensor]) -> torch.Tensor:
        out = torch.cat(parts)[:M]
        return out.reshape(*lead, out.shape[-1])

    if isinstance(blocks[0], tuple):
        return tuple(join(list(parts)) for parts in zip(*blocks, strict=True))
    return join(blocks)


def _last_dim(x: torch.Tensor, dims) -> bool:
    if isinstance(dims, int):
        dims = [dims]
    return dims is not None and len(dims) == 1 and dims[0] % x.dim() == x.dim() - 1


def k_parts(K: int) -> int:
    """Parts of the reduction dim K of a matmul in the mode: K_PARTS where K divides into
    them, else 1 (one part: such a weight cannot be sharded over K bitwise)."""
    return K_PARTS if K % K_PARTS == 0 else 1


def tree_sum(x_P: torch.Tensor) -> torch.Tensor:
    """The sum over dim 0 as a fixed pairwise tree: (x0 + x1) + (x2 + x3), ... An aligned
    power-of-two run of consecutive entries is one subtree, so ranks that each hold such a
    run, sum it, and sum their results with this again, get the same bits."""
    while x_P.shape[0] > 1:
        if x_P.shape[0] % 2:  # an odd last entry waits for the next level
            x_P = torch.cat([x_P[:-1:2] + x_P[1::2], x_P[-1:]])
        else:
            x_P = x_P[0::2] + x_P[1::2]
    return x_P[0]


def fixed_order_mm(
    a_MK: torch.Tensor,
    b_KN: torch.Tensor,
    parts: int | None = None,
    bias_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """a @ b (+ bias) in the mode's order: K cut into `parts` (default `k_parts(K)`) equal
    parts, one product per part, summed by `tree_sum` (a rank of a row-parallel layer passes
    its share of the whole weight's parts). Torch path: on fixed blocks of rows, the parts as
    one bmm of a fixed shape per weight, in fp32 for bf16/fp16 inputs (rounded once, as one
    matmul would); on CUDA with `use_triton` on, the Triton kernel."""
    K = a_MK.shape[1]
    P = k_parts(K) if parts is None else parts
    kernels = _triton_for(a_MK)
    if kernels is not None:
        return kernels.matmul(a_MK, b_KN, bias_N, parts=P)
    if P == 1:
        block = lambda a_RK: _aten.mm.default(a_RK, b_KN)  # noqa: E731
    else:
        dtype = a_MK.dtype
        wide = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
        b_PkN = b_KN.reshape(P, K // P, b_KN.shape[1]).to(wide).contiguous()  # once per call

        def block(a_RK: torch.Tensor) -> torch.Tensor:
            a_PRk = a_RK.view(a_RK.shape[0], P, K // P).transpose(0, 1).to(wide).contiguous()
            return tree_sum(_aten.bmm.default(a_PRk, b_PkN)).to(dtype)

    if bias_N is None:
        return by_rows(block, a_MK)
    return by_rows(lambda a_RK: block(a_RK) + bias_N, a_MK)


def _mm(func, a, b, **kw):
    return fixed_order_mm(a, b)


def _addmm(func, bias, a, b, **kw):
    if bias.dim() != 1 or kw:  # a bias per row, or beta/alpha: no row-independent blocking
        return func(bias, a, b, **kw)
    return fixed_order_mm(a, b, bias_N=bias)


def _bmm(func, a, b):
    # A linear layer on a 3-D input whose strides keep matmul from folding it into one mm
    # arrives here with one weight for the whole batch: fold it ourselves.
    if b.shape[0] == 1 or b.stride(0) == 0:
        N, M, K = a.shape
        out = fixed_order_mm(a.reshape(N * M, K), b[0])
        return out.view(N, M, -1)
    return func(a, b)  # a true batch of matrices (attention): its caller fixes the shapes


def _row_reduce(func, x, dim, keepdim=False, **kw):
    if x.dim() < 2 or not _last_dim(x, dim):
        return func(x, dim, keepdim, **kw)
    out = by_rows(lambda x_RD: func(x_RD, [-1], True, **kw), x)
    return out if keepdim else out.squeeze(-1)


def _softmax(func, x, dim, half_to_float):
    if x.dim() < 2 or not _last_dim(x, dim):
        return func(x, dim, half_to_float)
    kernels = _triton_for(x)
    if kernels is not None and func is _aten._log_softmax.default:
        return kernels.log_softmax(x, dtype=torch.float32 if half_to_float else x.dtype)
    return by_rows(lambda x_RV: func(x_RV, -1, half_to_float), x)


def _fused_rms_norm(func, x, normalized_shape, weight, eps):
    if len(normalized_shape) != 1 or x.dim() < 2:
        return func(x, normalized_shape, weight, eps)
    # Two outputs: normed rows [.., D] in x's dtype and rstd [.., 1] in fp32 (for bf16 x).
    kernels = _triton_for(x)
    if kernels is not None:
        return kernels.rms_norm(x, weight, eps)
    return by_rows(lambda x_RD: func(x_RD, normalized_shape, weight, eps), x)


_aten = torch.ops.aten
_IMPLS: dict = {
    _aten.mm.default: _mm,
    _aten.addmm.default: _addmm,
    _aten.bmm.default: _bmm,
    _aten.mean.dim: _row_reduce,
    _aten.sum.dim_IntList: _row_reduce,
    _aten._log_softmax.default: _softmax,
    _aten._softmax.default: _softmax,
}
if hasattr(_aten, "_fused_rms_norm"):  # the fused RMSNorm kernel of newer torch on CUDA
    _IMPLS[_aten._fused_rms_norm.default] = _fused_rms_norm

REPLACED_OPS: frozenset = frozenset(_IMPLS)
"""The aten overloads `BatchInvariantMode` replaces (the list in the module docstring, as this
torch names them); every other op runs its normal kernel."""


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _is_dtensor(x: torch.Tensor) -> bool:
    return type(x).__name__ == "DTensor" and type(x).__module__.startswith("torch.distributed")


def _is_collective(func) -> bool:
    return func.namespace == "_c10d_functional"


def _tp():
    from tidal.models import batch_invariant_tp

    return batch_invariant_tp


class BatchInvariantMode(TorchDispatchMode):
    """Within this mode, forward matmuls and row reductions run on fixed row blocks.

    Ops reached from the autograd engine (the backward pass) and every other op run their
    normal kernels. Example::

        with BatchInvariantMode():
            logp = torch.log_softmax(model(ids), -1)   # rows independent of the batch
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = _IMPLS.get(func)
        if torch._C._current_autograd_node() is not None:
            return func(*args, **kwargs)
        if impl is None:
            collective = _tp().COLLECTIVES.get(func) if _is_collective(func) else None
            return func(*args, **kwargs) if collective is None else collective(func, *args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if any(_is_dtensor(a) for a in tensors):
            # Tensor parallel: the same replacement on the local shards (batch_invariant_tp).
            return _tp().dtensor_op(func, impl, args, kwargs)
        if any(type(a) not in _PLAIN or a.device.type == "meta" for a in tensors):
            return func(*args, **kwargs)  # other subclasses (fake tensors), shape inference
        return impl(func, *args, **kwargs)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dim, each row computed on its own fixed block."""
    with BatchInvariantMode():
        return torch.log_softmax(logits.float(), dim=-1)


def attention(
    q_BHTK: torch.Tensor,
    k_BGSK: torch.Tensor,
    v_BGSK: torch.Tensor,
    q_pos_BT: torch.Tensor,
) -> torch.Tensor:
    """Causal GQA attention with a fixed reduction order, in fp32; output in q's dtype.

    Key slot s holds absolute position s; a query at position p sees slots 0..p. The work
    is cut into problems: one key head and a block of `query_block(device)` query columns
    (the heads j of that key head at consecutive times, zero-padded). Keys are processed in
    chunks of KV_CHUNK slots in increasing order with an online softmax. Every matmul runs
    on `problem_block(device)` problems at once, so each call has one shape, [P, C, K] @
    [P, K, N] and [P, K + 1, C] @ [P, C, N], whatever the batch, the number of queries
    (prefill or decode) or the number of keys; the softmax denominator comes out of the same
    matmul as the values (a row of ones appended to V). Elementwise ops and the max are
    exact whatever the shape.

    Backward (the trainer): the gradient of plain masked attention on the saved inputs
    (normal kernels, as for every op of the mode); no chunk intermediates are kept.
    """
    # No op of this kernel is one the mode replaces (its matmuls are bmm.out calls of one
    # shape): run it outside the mode, without the mode's per-op Python dispatch.
    inside = isinstance(_get_current_dispatch_mode(), BatchInvariantMode)
    with _pop_mode_temporarily() if inside else contextlib.nullcontext():
        return _FixedOrderAttention.apply(q_BHTK, k_BGSK, v_BGSK, q_pos_BT)


class _FixedOrderAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHTK, k_BGSK, v_BGSK, q_pos_BT):
        ctx.save_for_backward(q_BHTK, k_BGSK, v_BGSK, q_pos_BT)
        with torch.autocast(q_BHTK.device.type, enabled=False):  # fp32 matmuls, as documented
            kernels = _triton_for(q_BHTK)
            if kernels is not None:
                return kernels.attention(q_BHTK, k_BGSK, v_BGSK, q_pos_BT)
            return _chunked_attention(q_BHTK, k_BGSK, v_BGSK, q_pos_BT)

    @staticmethod
    def backward(ctx, grad_BHTK):
        q, k, v, pos_BT = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        inputs = [t.detach().requires_grad_(n) for t, n in zip((q, k, v), needs, strict=True)]
        visible_BTS = torch.arange(k.shape[2], device=k.device) <= pos_BT[:, :, None]
        with torch.enable_grad(), torch.autocast(q.device.type, enabled=False):
            o = torch.nn.functional.scaled_dot_product_attention(
                *(t.float() for t in inputs), attn_mask=visible_BTS[:, None], enable_gqa=True
            )
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(o, wanted, grad_BHTK.float()))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None)


def _chunked_attention(q_BHTK, k_BGSK, v_BGSK, q_pos_BT) -> torch.Tensor:
    B, H, T, K = q_BHTK.shape
    G, S = k_BGSK.shape[1], k_BGSK.shape[2]
    J, C = H // G, KV_CHUNK
    dev = q_BHTK.device
    N, PB = query_block(dev), problem_block(dev)
    X, Q = B * G, T * J  # key heads, query columns per key head
    nq = -(-Q // N)  # query blocks per key head
    P = -(-X * nq // PB) * PB  # problems, padded to whole calls
    # Queries of key head g as columns, ordered (t, j): [B, G, J, T, K] -> [X, Q, K].
    q_XQK = q_BHTK.float().view(B, G, J, T, K).transpose(2, 3).reshape(X, Q, K)
    pos_XQ = q_pos_BT[:, None, :, None].expand(B, G, T, J).reshape(X, Q)
    # Problems (x, query block): [P, N, K]. Padding columns and problems are zero queries at
    # position 0 (they see slot 0 only: finite, and dropped at the end).
    q_PNK = _pad(_pad(q_XQK, 1, nq * N).view(X * nq, N, K), 0, P)
    pos_PN = _pad(_pad(pos_XQ, 1, nq * N).view(X * nq, N), 0, P)
    head_P = _pad(torch.arange(X * nq, device=dev) // nq, 0, P)  # its key head (no sync)
    q_PKN = q_PNK.transpose(1, 2).contiguous()
    scale = 1.0 / math.sqrt(K)
    m_P1N = torch.full((P, 1, N), -math.inf, device=dev)
    acc_PKN = torch.zeros(P, K, N, device=dev)
    den_P1N = torch.zeros(P, 1, N, device=dev)
    ones_X1C = torch.ones(X, 1, C, device=dev)
    for c0 in range(0, S, C):
        # This chunk's keys of each key head: [X, C, K] (a last partial chunk padded with
        # masked zero keys), then gathered for every problem: [P, C, K].
        k_XCK = _pad(k_BGSK[:, :, c0 : c0 + C].float().reshape(X, -1, K), 1, C)
        v_XCK = _pad(v_BGSK[:, :, c0 : c0 + C].float().reshape(X, -1, K), 1, C)
        # [V^T; 1]: the values and a row of ones, so that one matmul gives the weighted
        # values and the weights' sum.
        vt1_XK1C = torch.cat([v_XCK.transpose(1, 2), ones_X1C], dim=1)
        k_PCK, vt1_PK1C = k_XCK.index_select(0, head_P), vt1_XK1C.index_select(0, head_P)
        s_PCN = _bmm_blocks(k_PCK, q_PKN, PB) * scale
        slot_C = torch.arange(c0, c0 + C, device=dev)
        hidden_PCN = slot_C[None, :, None] > pos_PN[:, None, :]
        s_PCN = s_PCN.masked_fill(hidden_PCN, -math.inf)
        m_new = torch.maximum(m_P1N, s_PCN.amax(dim=1, keepdim=True))  # max: order-free
        alpha_P1N = torch.exp(m_P1N - m_new)
        p_PCN = torch.exp(s_PCN - m_new)
        pv_PK1N = _bmm_blocks(vt1_PK1C, p_PCN, PB)
        acc_PKN = acc_PKN * alpha_P1N + pv_PK1N[:, :K]
        den_P1N = den_P1N * alpha_P1N + pv_PK1N[:, K:]
        m_P1N = m_new
    o_PNK = (acc_PKN / den_P1N).transpose(1, 2)
    # [X * nq, N, K] -> [X, Q, K] -> [B, G, T, J, K] -> [B, H, T, K] (heads g*J + j, as in
    # enable_gqa).
    o_XQK = o_PNK[: X * nq].reshape(X, nq * N, K)[:, :Q]
    o_BHTK = o_XQK.reshape(B, G, T, J, K).transpose(2, 3).reshape(B, H, T, K)
    return o_BHTK.to(q_BHTK.dtype)


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """x zero-padded along dim to `size` (x itself when it has that size)."""
    extra = size - x.shape[dim]
    if not extra:
        return x
    return torch.nn.functional.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, extra])


def _bmm_blocks(a_PMK: torch.Tensor, b_PKN: torch.Tensor, block: int) -> torch.Tensor:
    """a @ b, one bmm per `block` consecutive matrices (contiguous slices: every call sees
    the same shapes, strides and alignment), written into one result."""
    P, M, N = a_PMK.shape[0], a_PMK.shape[1], b_PKN.shape[2]
    assert P % block == 0, f"{P} problems are not whole blocks of {block}"
    out_PMN = a_PMK.new_empty(P, M, N)
    blocks = zip(
        a_PMK.contiguous().split(block),
        b_PKN.contiguous().split(block),
        out_PMN.split(block),
        strict=True,
    )
    for a, b, out in blocks:
        torch.bmm(a, b, out=out)  # bmm.out: not a replaced op; writes the slice in place
    return out_PMN
