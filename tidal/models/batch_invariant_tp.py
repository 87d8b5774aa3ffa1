"""Batch-invariant mode under tensor parallelism: the mode's kernels on DTensor shards, and
sums over ranks in a fixed order.

`BatchInvariantMode` (tidal/models/batch_invariant.py) calls into this module for two kinds
of ops:

- An op it replaces (matmul, row reduction, log-softmax, RMSNorm) with DTensor arguments:
  `dtensor_op` runs the same replacement on the local shards and wraps the result with the
  placements DTensor itself would give, where the placements make each shard's result a slice
  of the whole result (a column-parallel matmul, a row-parallel matmul's partial sums, a norm
  over rows sharded by sequence). DTensor's own dispatch (a C++ fast path since torch 2.10)
  runs local kernels outside Python dispatch modes, so it cannot be left to DTensor. Other
  placements run DTensor's kernels.
- The functional all-reduce and reduce-scatter (sum) that turn a row-parallel layer's
  Partial output into Replicate or Shard (sequence parallel): `COLLECTIVES` gathers every
  rank's partial sums and adds them by `tree_sum` in rank order, so every rank gets the
  same bits whatever the transport's reduction order.

With the mode's split of every matmul's K into `K_PARTS` parts summed by a fixed tree, a
row-parallel layer on TP ranks (a power of two up to K_PARTS) computes whole subtrees of that
tree on each rank and the fixed-order sum adds them as its top levels: TP 2 gives the bits of
TP 1 (tests/parallel/test_bitwise_layouts.py).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from tidal.models.batch_invariant import fixed_order_mm, k_parts, tree_sum

_aten = torch.ops.aten
_MATMULS = (_aten.mm.default, _aten.addmm.default)
_ROW_OPS: tuple = (
    _aten.mean.dim,
    _aten.sum.dim_IntList,
    _aten._log_softmax.default,
    _aten._softmax.default,
)
if hasattr(_aten, "_fused_rms_norm"):
    _ROW_OPS = (*_ROW_OPS, _aten._fused_rms_norm.default)


def dtensor_op(func, impl, args: tuple, kwargs: dict):
    """func(*args) with DTensor arguments, by `impl` (the mode's replacement) on the local
    shards where the placements allow it, else by DTensor's own kernels."""
    out = None
    if func in _MATMULS and not kwargs:
        out = _matmul(func, impl, args)
    elif func in _ROW_OPS:
        out = _row_op(func, impl, args, kwargs)
    return func(*args, **kwargs) if out is None else out


def _one_dim(*xs) -> bool:
    """All DTensors on one 1-D mesh (the TP mesh), no plain tensors among them."""
    if not all(isinstance(x, DTensor) for x in xs):
        return False
    mesh = xs[0].device_mesh
    return mesh.ndim == 1 and all(x.device_mesh == mesh for x in xs)


def _wrap(local: torch.Tensor, like: DTensor, placement, shape: tuple[int, ...]) -> DTensor:
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local,
        like.device_mesh,
        [placement],
        run_check=False,
        shape=torch.Size(shape),
        stride=stride,
    )


def _matmul(func, impl, args):
    """mm(a, b) or addmm(bias, a, b) of a linear layer: column-parallel (a Replicate, b =
    W^T Shard(1): out Shard(1)), row-parallel (a Shard(1), b Shard(0): out Partial, no bias),
    row-sharded (a Shard(0), b Replicate) or replicated."""
    bias, (a, b) = (args[0], args[1:]) if func is _aten.addmm.default else (None, args)
    if not _one_dim(a, b) or (bias is not None and not _one_dim(bias, a)):
        return None
    pa, pb = a.placements[0], b.placements[0]
    pbias = bias.placements[0] if bias is not None else None
    if pa.is_replicate() and pb == Shard(1) and pbias in (None, Shard(0)):
        out = Shard(1)
    elif pa == Shard(1) and pb == Shard(0) and bias is None:
        out = Partial()
    elif pa == Shard(0) and pb.is_replicate() and pbias in (None, Replicate()):
        out = Shard(0)
    elif pa.is_replicate() and pb.is_replicate() and pbias in (None, Replicate()):
        out = Replicate()
    else:
        return None
    local = [x.to_local() for x in args]
    if isinstance(out, Partial):
        # This rank's run of the whole weight's K parts (its subtrees of the sum's tree).
        W = a.device_mesh.size()
        parts = max(1, k_parts(a.shape[1]) // W)
        result = fixed_order_mm(local[0], local[1], parts)
    else:
        result = impl(func, *local)
    return _wrap(result, a, out, (a.shape[0], b.shape[1]))


def _row_op(func, impl, args, kwargs):
    """A reduction or normalization over the last dim of x = args[0], whose shards hold whole
    rows (x not sharded on its last dim; other tensor arguments, RMSNorm's weight, replicated):
    the result keeps x's placement and its leading dims."""
    x = args[0]
    others = [a for a in args[1:] if isinstance(a, torch.Tensor)]
    if not _one_dim(x, *others) or any(not o.placements[0].is_replicate() for o in others):
        return None
    p = x.placements[0]
    if isinstance(p, Shard) and p.dim % x.dim() == x.dim() - 1:
        return None
    if isinstance(p, Partial):
        return None
    local_args = [a.to_local() if isinstance(a, DTensor) else a for a in args]
    result = impl(func, *local_args, **kwargs)

    def wrap(r: torch.Tensor) -> DTensor:
        shape = (*x.shape[: min(r.dim(), x.dim() - 1)], *r.shape[x.dim() - 1 :])
        return _wrap(r, x, p, shape)

    return tuple(wrap(r) for r in result) if isinstance(result, tuple) else wrap(result)


def _gathered(x: torch.Tensor, group_name) -> tuple[torch.Tensor, int, int]:
    """Every rank's x, stacked in rank order: [W, *x.shape]; with W and this rank's index."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    W, rank = group.size(), torch.distributed.get_rank(group)
    c10d = torch.ops._c10d_functional
    out = c10d.all_gather_into_tensor.default(x.contiguous(), W, group_name)
    return c10d.wait_tensor.default(out).view(W, *x.shape), W, rank


def _all_reduce(func, x, op, group_name):
    """A sum over ranks in a fixed order: every rank's partial sums gathered and added by
    `tree_sum` in rank order (a row-parallel layer's Partial output made Replicate)."""
    if op.lower() != "sum":
        return func(x, op, group_name)
    parts_W, _, _ = _gathered(x, group_name)
    return tree_sum(parts_W)


def _reduce_scatter(func, x, op, group_size, group_name):
    """reduce_scatter (sum) as `_all_reduce`, then this rank's chunk of dim 0 (a row-parallel
    layer's Partial output made Shard(1) under sequence parallel)."""
    if op.lower() != "sum":
        return func(x, op, group_size, group_name)
    parts_W, W, rank = _gathered(x, group_name)
    return tree_sum(parts_W).chunk(W)[rank].contiguous()


_c10d = torch.ops._c10d_functional
COLLECTIVES: dict = {
    _c10d.all_reduce.default: _all_reduce,
    _c10d.reduce_scatter_tensor.default: _reduce_scatter,
}
"""The functional collectives the mode replaces in the forward pass."""
