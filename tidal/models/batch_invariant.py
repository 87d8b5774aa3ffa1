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
- Row reductions over the last dim (`mean` and `sum` as in RMSNorm, `_log_softmax`,
  `_softmax`, the fused RMSNorm kernel of CUDA): the same fixed row blocks. Each
  replacement returns the dtypes of the kernel it replaces (RMSNorm: rows in the input
  dtype, rstd in fp32), so a bf16 model stays bf16.
- Attention (`attention` below, called by the model): keys and values in fixed chunks of
  `KV_CHUNK` positions, an online softmax that combines the chunks in increasing order, and
  per-chunk matmuls whose two small dims (chunk length, head dim) are fixed. A query at
  position p does the same arithmetic whether it is one of 4096 training queries or the only
  query of a decode step: chunks past p are exact no-ops (weights exp(-inf) = 0, rescale
  exp(0) = 1), and the keys past p inside p's chunk are masked to -inf before the exponent.

`BatchInvariantMode` is a TorchDispatchMode: it sees the aten ops under autograd and
autocast, replaces the ones above in the forward pass and lets the backward pass run the
normal kernels (gradients need not be invariant). `Transformer.forward(...,
batch_invariant=True)` enters it and switches attention to the chunked kernel; the trainer's
scoring path (tidal.rl.logprobs) and the generator call the same forward.

Where this departs from the reference designs (Thinking Machines' batch_invariant_ops, which
write persistent Triton kernels): plain PyTorch ops at fixed shapes, so the same code runs on
CPU and CUDA, under autograd, inside CUDA graphs, and with tensor-parallel DTensors passed
through untouched. The invariance then rests on a library computing a given shape the same
way each time, which holds for MKL and ATen on CPU (tests/rl/test_batch_invariant.py checks
bit equality) and for cuBLAS at a fixed shape and workspace; the attention matmuls keep the
chunk and head dims fixed but not the number of queries (`-m gpu` checks bf16 on CUDA).
On CPU, the elementwise ops are exact as long as ATen's threads split tensors at multiples of
its vector width, true for power-of-two thread counts and the model widths used here.

Cost: see benchmarks/README.md ("Batch-invariant mode"); it is a mode for exact parity, not
the fast path.

Shape legend: B batch, H query heads, G key/value heads, J = H / G query heads per key head,
T queries, S keys, K head dim, C keys per chunk, N = T * J query columns, M rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

KV_CHUNK = 64
"""Keys per attention chunk: the decode split of the KV cache by a fixed size (not count)."""

_ROW_BLOCK = {"cpu": 16, "cuda": 128}


def row_block(device: torch.device) -> int:
    """Rows per matmul/reduction call. 16 on CPU (MKL takes other paths below 16 rows);
    128 on CUDA, one cuBLAS tile height, so a decode batch of up to 128 rows is one call."""
    return _ROW_BLOCK.get(device.type, 128)


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


def _mm(func, a, b, **kw):
    return by_rows(lambda a_RK: func(a_RK, b, **kw), a)


def _addmm(func, bias, a, b, **kw):
    if bias.dim() != 1:  # a bias per row: no row-independent blocking of it here
        return func(bias, a, b, **kw)
    return by_rows(lambda a_RK: func(bias, a_RK, b, **kw), a)


def _bmm(func, a, b):
    # A linear layer on a 3-D input whose strides keep matmul from folding it into one mm
    # arrives here with one weight for the whole batch: fold it ourselves.
    if b.shape[0] == 1 or b.stride(0) == 0:
        N, M, K = a.shape
        out = by_rows(lambda a_RK: _aten.mm.default(a_RK, b[0]), a.reshape(N * M, K))
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
    return by_rows(lambda x_RV: func(x_RV, -1, half_to_float), x)


def _fused_rms_norm(func, x, normalized_shape, weight, eps):
    if len(normalized_shape) != 1 or x.dim() < 2:
        return func(x, normalized_shape, weight, eps)
    # Two outputs: normed rows [.., D] in x's dtype and rstd [.., 1] in fp32 (for bf16 x).
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


_PLAIN = (torch.Tensor, torch.nn.Parameter)


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
        if impl is None or torch._C._current_autograd_node() is not None:
            return func(*args, **kwargs)
        if any(type(a) not in _PLAIN for a in args if isinstance(a, torch.Tensor)):
            return func(*args, **kwargs)  # tensor subclasses (DTensor) dispatch their own way
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

    Key slot s holds absolute position s; a query at position p sees slots 0..p. Keys are
    processed in chunks of KV_CHUNK slots in increasing order with an online softmax; each
    chunk's matmuls have the chunk length and the head dim as their fixed dims (the queries of
    one key head are the free dim N), and the softmax denominator comes out of the same
    matmul as the values (a row of ones appended to V), so no reduction depends on how many
    queries or keys the call has.
    """
    B, H, T, K = q_BHTK.shape
    G, S = k_BGSK.shape[1], k_BGSK.shape[2]
    J, C = H // G, KV_CHUNK
    dev = q_BHTK.device
    # Queries of key head g as columns: [B*G, K, N], columns ordered (t, j).
    q_BGTJK = q_BHTK.float().view(B, G, J, T, K).transpose(2, 3)
    q_XNK = q_BGTJK.reshape(B * G, T * J, K)
    pos_XN = q_pos_BT[:, None, :, None].expand(B, G, T, J).reshape(B * G, T * J)
    N = T * J
    if N == 1:  # one column takes a matrix-vector path: pad to two (the copy sees key 0)
        q_XNK = torch.cat([q_XNK, q_XNK], dim=1)
        pos_XN = torch.cat([pos_XN, torch.zeros_like(pos_XN)], dim=1)
    kv_heads = B * G
    if kv_heads == 1:  # likewise one matrix takes another path than a batch of them
        q_XNK, pos_XN = torch.cat([q_XNK, q_XNK]), torch.cat([pos_XN, pos_XN])
        k_BGSK, v_BGSK = torch.cat([k_BGSK, k_BGSK]), torch.cat([v_BGSK, v_BGSK])
    q_XKN = q_XNK.transpose(1, 2)
    scale = 1.0 / math.sqrt(K)
    X, Np = q_XNK.shape[0], q_XNK.shape[1]
    m_X1N = torch.full((X, 1, Np), -math.inf, device=dev)
    acc_XKN = torch.zeros(X, K, Np, device=dev)
    den_X1N = torch.zeros(X, 1, Np, device=dev)
    ones_X1C = torch.ones(X, 1, C, device=dev)
    for c0 in range(0, S, C):
        k_XCK = k_BGSK[:, :, c0 : c0 + C].float().reshape(X, -1, K)
        v_XCK = v_BGSK[:, :, c0 : c0 + C].float().reshape(X, -1, K)
        if k_XCK.shape[1] < C:  # a last partial chunk: pad with masked zero keys
            pad = C - k_XCK.shape[1]
            k_XCK = torch.cat([k_XCK, k_XCK.new_zeros(X, pad, K)], dim=1)
            v_XCK = torch.cat([v_XCK, v_XCK.new_zeros(X, pad, K)], dim=1)
        s_XCN = torch.bmm(k_XCK, q_XKN) * scale
        slot_C = torch.arange(c0, c0 + C, device=dev)
        hidden_XCN = slot_C[None, :, None] > pos_XN[:, None, :]
        s_XCN = s_XCN.masked_fill(hidden_XCN, -math.inf)
        m_new = torch.maximum(m_X1N, s_XCN.amax(dim=1, keepdim=True))  # max: order-free
        alpha_X1N = torch.exp(m_X1N - m_new)
        p_XCN = torch.exp(s_XCN - m_new)
        # [V^T; 1] @ P: the weighted values and the weights' sum in one fixed-shape matmul.
        vt1_XK1C = torch.cat([v_XCK.transpose(1, 2), ones_X1C], dim=1)
        pv_XK1N = torch.bmm(vt1_XK1C, p_XCN)
        acc_XKN = acc_XKN * alpha_X1N + pv_XK1N[:, :K]
        den_X1N = den_X1N * alpha_X1N + pv_XK1N[:, K:]
        m_X1N = m_new
    o_XNK = (acc_XKN / den_X1N).transpose(1, 2)[:kv_heads, :N]
    # [B*G, T*J, K] -> [B, G, T, J, K] -> [B, H, T, K] (heads g*J + j, as in enable_gqa).
    o_BHTK = o_XNK.reshape(B, G, T, J, K).transpose(2, 3).reshape(B, H, T, K)
    return o_BHTK.to(q_BHTK.dtype)
