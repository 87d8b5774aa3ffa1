"""Batch-invariant Triton kernels: each output row's reduction order is fixed by the shapes
of the weights and the block sizes below, never by the number of rows.

The GPU path of batch-invariant mode (tidal/models/batch_invariant.py, opt-in with
`use_triton(True)` or TIDAL_BI_TRITON=1): one kernel launch per op instead of the torch
path's fixed-shape blocks of library calls. Each kernel tiles its rows with a fixed block
and reduces with a fixed order inside the row:

- `matmul(a, b, bias, parts)`: C = A @ B (+ bias). K is cut into `parts` equal parts (the
  mode's `K_PARTS` where K divides into them), each part accumulated over K blocks of
  `block_k` in increasing order (`tl.dot`, fp32 accumulator), the parts summed by the same
  fixed pairwise tree as the torch path (`tree_sum`), so a row-parallel layer's TP ranks
  compute whole subtrees (tidal/models/batch_invariant_tp.py). The tile sizes do not depend
  on M, and a row's tile holds whatever other rows: its result is the same.
- `rms_norm(x, weight, eps)`: one program per row, fp32 sum of squares over blocks of the
  row, `tl.sum` of the block; outputs as `aten._fused_rms_norm` (rows in x's dtype, rstd in
  fp32).
- `log_softmax(x)` and `token_logprobs(x, targets)`: one program per row, an online max and
  sum over fixed blocks of the vocabulary (lane by lane, then combined by `tl.max` and
  `tl.sum`); a token's log-prob is the same expression as the log-softmax's entry, so the two
  agree bit for bit.
- `attention(q, k, v, q_pos)`: causal GQA attention for prefill and decode alike. The
  queries of a key head are rows (t, j) cut into blocks of `block_q`; the keys are cut into
  splits of `split` slots (a fixed size, not a fixed count), each split a program that runs
  an online softmax over chunks of `block_s` keys in increasing order and writes its partial
  max, sum and values; the splits are combined in split order (`tree_sum`). Splits and chunks
  past a query's position are exact no-ops (weights exp(-inf) = 0, rescale exp(0) = 1), so a
  query gets the same bits as the only query of a decode step, as one of a prefill of any
  length, and whatever other sequences share the batch.

Each launch is a custom op (`torch.library.triton_op`, `torch.ops.tidal.bi_*`), so
`torch.compile` keeps it in its graph. Every kernel runs under Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported) on CPU tensors: tests/kernels/ checks
values against torch and bitwise invariance there on small shapes, and on CUDA under the
`gpu` marker.

Shape legend: M rows, K reduction dim, N output columns, V vocabulary, D model width, B batch,
H query heads, G key/value heads, J = H / G, T queries, S key slots, X = B * G key heads,
Q = T * J query rows per key head, W splits.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from tidal.models.batch_invariant import tree_sum

# Block sizes: fixed per kernel (never chosen from M). Tests pass smaller ones to keep the
# interpreter fast; the GPU uses these defaults.
MATMUL_BLOCKS = (64, 64, 32)
"""(block_m, block_n, block_k) of `matmul`."""
ROW_BLOCK = 1024
"""Elements of a row per step of `rms_norm`, `log_softmax` and `token_logprobs`."""
ATTENTION_BLOCKS = (16, 64, 256)
"""(block_q, block_s, split) of `attention`: query rows per program, keys per chunk, keys
per split (a multiple of block_s)."""


@triton.jit
def _part_dot(
    a_ptr, b_ptr, rm, rn, M, N, p, Kp, sam, sak, sbk, sbn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Part p's product (K from p * Kp to (p + 1) * Kp) for a [BLOCK_M, BLOCK_N] tile, K
    blocks in increasing order."""
    k0 = p * Kp
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, Kp, BLOCK_K):
        rk = kb + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + rm[:, None] * sam + (k0 + rk)[None, :] * sak,
            mask=(rm[:, None] < M) & (rk[None, :] < Kp),
            other=0.0,
        )
        b = tl.load(
            b_ptr + (k0 + rk)[:, None] * sbk + rn[None, :] * sbn,
            mask=(rk[:, None] < Kp) & (rn[None, :] < N),
            other=0.0,
        )
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def _matmul_kernel(
    a_ptr,
    b_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    Kp,
    sam,
    sak,
    sbk,
    sbn,
    scm,
    scn,
    HAS_BIAS: tl.constexpr,
    PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # The parts summed by a fixed pairwise tree (tree_sum's order), for 1, 2, 4 or 8 parts.
    acc = _part_dot(
        a_ptr, b_ptr, rm, rn, M, N, 0, Kp, sam, sak, sbk, sbn, BLOCK_M, BLOCK_N, BLOCK_K
    )  # fmt: skip
    if PARTS >= 2:
        acc += _part_dot(
            a_ptr, b_ptr, rm, rn, M, N, 1, Kp, sam, sak, sbk, sbn, BLOCK_M, BLOCK_N, BLOCK_K
        )  # fmt: skip
    if PARTS >= 4:
        acc_23 = _part_dot(
            a_ptr, b_ptr, rm, rn, M, N, 2, Kp, sam, sak, sbk, sbn, BLOCK_M, BLOCK_N, BLOCK_K
        ) + _part_dot(
            a_ptr, b_ptr, rm, rn, M, N, 3, Kp, sam, sak, sbk, sbn, BLOCK_M, BLOCK_N, BLOCK_K
        )  # fmt: skip
        acc += acc_23
    if PARTS >= 8:
        acc_45 = _part_dot(
            a_ptr, b_ptr, rm, rn, M, N, 4, Kp, sam, sak, sbk, sbn, BLOCK_M, BLOCK_N, BLOCK_K
        ) + _part_dot(
            a_ptr, b_ptr, rm, rn, M, N, 5, Kp, sam, sak, sbk, sbn, BLOCK_M, BLOCK_N, BLOCK_K
        )  # fmt: skip
        acc_67 = _part_dot(
            a_ptr, b_ptr, rm, rn, M, N, 6, Kp, sam, sak, sbk, sbn, BLOCK_M, BLOCK_N, BLOCK_K
        ) + _part_dot(
            a_ptr, b_ptr, rm, rn, M, N, 7, Kp, sam, sak, sbk, sbn, BLOCK_M, BLOCK_N, BLOCK_K
        )  # fmt: skip
        acc += acc_45 + acc_67
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc, mask=mask)


def matmul(
    a_MK: torch.Tensor,
    b_KN: torch.Tensor,
    bias_N: torch.Tensor | None = None,
    *,
    parts: int = 1,
    blocks: tuple[int, int, int] = MATMUL_BLOCKS,
) -> torch.Tensor:
    """a @ b (+ bias) in a's dtype, K in `parts` (1, 2, 4 or 8) equal parts summed by a fixed
    tree; a row's result does not depend on M."""
    K = a_MK.shape[1]
    if parts not in (1, 2, 4, 8) or K % parts:
        raise ValueError(f"matmul: parts={parts} must be 1, 2, 4 or 8 and divide K={K}")
    if b_KN.shape[0] != K:
        raise ValueError(f"matmul: shapes {tuple(a_MK.shape)} and {tuple(b_KN.shape)} differ in K")
    return torch.ops.tidal.bi_matmul(a_MK, b_KN, bias_N, parts, *blocks).to(a_MK.dtype)


@triton_op("tidal::bi_matmul", mutates_args=())
def _matmul_op(
    a_MK: torch.Tensor,
    b_KN: torch.Tensor,
    bias_N: torch.Tensor | None,
    parts: int,
    bm: int,
    bn: int,
    bk: int,
) -> torch.Tensor:
    """`matmul`'s launch, in fp32 (a custom op: torch.compile and CUDA graphs see one op)."""
    M, K = a_MK.shape
    N = b_KN.shape[1]
    out_MN = torch.empty(M, N, device=a_MK.device, dtype=torch.float32)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    wrap_triton(_matmul_kernel)[grid](
        a_MK, b_KN, bias_N if bias_N is not None else out_MN, out_MN, M, N, K // parts,
        a_MK.stride(0), a_MK.stride(1), b_KN.stride(0), b_KN.stride(1),
        out_MN.stride(0), out_MN.stride(1),
        HAS_BIAS=bias_N is not None, PARTS=parts, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
    )  # fmt: skip
    return out_MN


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, D, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        rd = d0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * D + rd, mask=rd < D, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / D + eps)
    tl.store(rstd_ptr + row, rstd)
    for d0 in range(0, D, BLOCK):
        rd = d0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * D + rd, mask=rd < D, other=0.0).to(tl.float32)
        y = x * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + rd, mask=rd < D, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * D + rd, y.to(y_ptr.dtype.element_ty), mask=rd < D)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float | None, *, block: int = ROW_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim: (rows in x's dtype, rstd [..., 1] in fp32), as
    `aten._fused_rms_norm` returns them."""
    D = x.shape[-1]
    x_MD = x.reshape(-1, D).contiguous()
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    y_MD, rstd_M = torch.ops.tidal.bi_rms_norm(x_MD, weight, eps, block)
    return y_MD.view(x.shape), rstd_M.view(*x.shape[:-1], 1)


@triton_op("tidal::bi_rms_norm", mutates_args=())
def _rms_norm_op(
    x_MD: torch.Tensor, weight: torch.Tensor | None, eps: float, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    M, D = x_MD.shape
    y_MD = torch.empty_like(x_MD)
    rstd_M = torch.empty(M, device=x_MD.device, dtype=torch.float32)
    if M:
        wrap_triton(_rms_norm_kernel)[(M,)](
            x_MD, weight if weight is not None else x_MD, y_MD, rstd_M, D, eps,
            HAS_W=weight is not None, BLOCK=block,
        )  # fmt: skip
    return y_MD, rstd_M


@triton.jit
def _row_lse(x_ptr, row, V, BLOCK: tl.constexpr):
    """(max, sum of exp(x - max)) of a row: lane-wise online max and sum over blocks of the
    row in increasing order, then the lanes combined."""
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        rv = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * V + rv, mask=rv < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # A lane that has seen only -inf keeps m = -inf: rescale by 0 there, not exp(nan).
        scale = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
        s = s * scale + tl.where(m_new == float("-inf"), 0.0, tl.exp(x - m_new))
        m = m_new
    m_row = tl.max(m, axis=0)
    s_row = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - m_row)), axis=0)
    return m_row, s_row


@triton.jit
def _log_softmax_kernel(x_ptr, y_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m_row, s_row = _row_lse(x_ptr, row, V, BLOCK)
    log_s = tl.log(s_row)
    for v0 in range(0, V, BLOCK):
        rv = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * V + rv, mask=rv < V, other=0.0).to(tl.float32)
        tl.store(
            y_ptr + row * V + rv, ((x - m_row) - log_s).to(y_ptr.dtype.element_ty), mask=rv < V
        )


@triton.jit
def _token_logprobs_kernel(x_ptr, t_ptr, y_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m_row, s_row = _row_lse(x_ptr, row, V, BLOCK)
    x_t = tl.load(x_ptr + row * V + tl.load(t_ptr + row)).to(tl.float32)
    tl.store(y_ptr + row, (x_t - m_row) - tl.log(s_row))


def log_softmax(x: torch.Tensor, *, dtype: torch.dtype | None = None, block: int = ROW_BLOCK):
    """log-softmax over the last dim, computed in fp32; returned in `dtype` (x's by default)."""
    V = x.shape[-1]
    x_MV = x.reshape(-1, V).contiguous()
    to_fp32 = (dtype or x.dtype) == torch.float32
    if not to_fp32 and dtype not in (None, x.dtype):
        raise ValueError(f"log_softmax: dtype {dtype} is neither fp32 nor x's {x.dtype}")
    return torch.ops.tidal.bi_log_softmax(x_MV, to_fp32, block).view(x.shape)


@triton_op("tidal::bi_log_softmax", mutates_args=())
def _log_softmax_op(x_MV: torch.Tensor, to_fp32: bool, block: int) -> torch.Tensor:
    M, V = x_MV.shape
    y_MV = torch.empty(M, V, device=x_MV.device, dtype=torch.float32 if to_fp32 else x_MV.dtype)
    if M:
        wrap_triton(_log_softmax_kernel)[(M,)](x_MV, y_MV, V, BLOCK=block)
    return y_MV


def token_logprobs(x: torch.Tensor, targets: torch.Tensor, *, block: int = ROW_BLOCK):
    """fp32 log-softmax of each row of x [..., V] at its target [...]: bitwise the entry
    `log_softmax(x.float())` has there, without writing the other V - 1."""
    V = x.shape[-1]
    x_MV = x.reshape(-1, V).contiguous()
    t_M = targets.reshape(-1).contiguous()
    if t_M.shape[0] != x_MV.shape[0]:
        raise ValueError(f"token_logprobs: {t_M.shape[0]} targets for {x_MV.shape[0]} rows")
    return torch.ops.tidal.bi_token_logprobs(x_MV, t_M, block).view(targets.shape)


@triton_op("tidal::bi_token_logprobs", mutates_args=())
def _token_logprobs_op(x_MV: torch.Tensor, t_M: torch.Tensor, block: int) -> torch.Tensor:
    M, V = x_MV.shape
    y_M = torch.empty(M, device=x_MV.device, dtype=torch.float32)
    if M:
        wrap_triton(_token_logprobs_kernel)[(M,)](x_MV, t_M, y_M, V, BLOCK=block)
    return y_M


@triton.jit
def _attention_split_kernel(
    q_ptr,  # [X, Q, K] fp32, contiguous
    pos_ptr,  # [X, Q] int32
    k_ptr,
    v_ptr,  # [B, G, S, K], strides below
    m_ptr,
    l_ptr,  # [W, X, Q] fp32
    acc_ptr,  # [W, X, Q, K] fp32
    X,
    Q,
    S,
    G,
    skb,
    skg,
    sks,
    svb,
    svg,
    svs,
    scale,
    K: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SPLIT: tl.constexpr,
):
    x = tl.program_id(0)
    rq = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    w = tl.program_id(2)
    b, g = x // G, x % G
    rk = tl.arange(0, K)
    qmask = rq < Q
    q = tl.load(q_ptr + (x * Q + rq)[:, None] * K + rk[None, :], mask=qmask[:, None], other=0.0)
    pos = tl.load(pos_ptr + x * Q + rq, mask=qmask, other=0)
    m = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
    den = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q, K), dtype=tl.float32)
    for c0 in range(w * SPLIT, w * SPLIT + SPLIT, BLOCK_S):
        rs = c0 + tl.arange(0, BLOCK_S)
        kv_mask = (rs < S)[:, None]
        k = tl.load(
            k_ptr + b * skb + g * skg + rs[:, None] * sks + rk[None, :], mask=kv_mask, other=0.0
        ).to(tl.float32)
        v = tl.load(
            v_ptr + b * svb + g * svg + rs[:, None] * svs + rk[None, :], mask=kv_mask, other=0.0
        ).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(rs[None, :] > pos[:, None], float("-inf"), s)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # Rows that have seen no visible key yet (m_new = -inf): weights 0, rescale 1.
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
        p = tl.where(m_new[:, None] == float("-inf"), 0.0, tl.exp(s - m_new[:, None]))
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        den = den * alpha + tl.sum(p, axis=1)
        m = m_new
    out = (w * X + x) * Q + rq
    tl.store(m_ptr + out, m, mask=qmask)
    tl.store(l_ptr + out, den, mask=qmask)
    tl.store(acc_ptr + out[:, None] * K + rk[None, :], acc, mask=qmask[:, None])


def attention(
    q_BHTK: torch.Tensor,
    k_BGSK: torch.Tensor,
    v_BGSK: torch.Tensor,
    q_pos_BT: torch.Tensor,
    *,
    blocks: tuple[int, int, int] = ATTENTION_BLOCKS,
) -> torch.Tensor:
    """Causal GQA attention (key slot s holds position s; a query at p sees slots 0..p), in
    fp32, output in q's dtype; the same arguments as tidal.models.batch_invariant.attention.
    The head dim K must be a power of two (a Triton block)."""
    B, H, T, K = q_BHTK.shape
    G = k_BGSK.shape[1]
    if H % G or K & (K - 1):
        raise ValueError(f"attention: {H} heads over {G} key heads, head dim {K} (a power of 2)")
    block_q, block_s, split = blocks
    if split % block_s:
        raise ValueError(f"attention: split {split} is not a multiple of block_s {block_s}")
    J, X = H // G, B * G
    Q = T * J
    q_XQK = q_BHTK.float().view(B, G, J, T, K).transpose(2, 3).reshape(X, Q, K).contiguous()
    pos_XQ = q_pos_BT[:, None, :, None].expand(B, G, T, J).reshape(X, Q).to(torch.int32)
    k, v = k_BGSK, v_BGSK
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    m_WXQ, l_WXQ, acc_WXQK = torch.ops.tidal.bi_attention_splits(
        q_XQK, pos_XQ.contiguous(), k, v, G, block_q, block_s, split
    )
    # Splits combined in split order; splits past a query's position add exact zeros.
    m_XQ = m_WXQ.amax(0)
    w_WXQ = torch.exp(m_WXQ - m_XQ)  # a split with no visible key: exp(-inf) = 0
    o_XQK = tree_sum(acc_WXQK * w_WXQ[..., None]) / tree_sum(l_WXQ * w_WXQ)[..., None]
    o_BHTK = o_XQK.view(B, G, T, J, K).transpose(2, 3).reshape(B, H, T, K)
    return o_BHTK.to(q_BHTK.dtype)


@triton_op("tidal::bi_attention_splits", mutates_args=())
def _attention_splits_op(
    q_XQK: torch.Tensor,
    pos_XQ: torch.Tensor,
    k_BGSK: torch.Tensor,
    v_BGSK: torch.Tensor,
    G: int,
    block_q: int,
    block_s: int,
    split: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each split's partial max, sum and values: [W, X, Q], [W, X, Q], [W, X, Q, K]."""
    X, Q, K = q_XQK.shape
    S = k_BGSK.shape[2]
    W = max(1, triton.cdiv(S, split))
    dev = q_XQK.device
    m_WXQ = torch.empty(W, X, Q, device=dev, dtype=torch.float32)
    l_WXQ = torch.empty(W, X, Q, device=dev, dtype=torch.float32)
    acc_WXQK = torch.empty(W, X, Q, K, device=dev, dtype=torch.float32)
    if X * Q:
        k, v = k_BGSK, v_BGSK
        wrap_triton(_attention_split_kernel)[(X, triton.cdiv(Q, block_q), W)](
            q_XQK, pos_XQ, k, v, m_WXQ, l_WXQ, acc_WXQK, X, Q, S, G,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            1.0 / math.sqrt(K), K=K, BLOCK_Q=block_q, BLOCK_S=block_s, SPLIT=split,
        )  # fmt: skip
    return m_WXQ, l_WXQ, acc_WXQK
