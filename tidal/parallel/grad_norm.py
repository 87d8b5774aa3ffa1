"""Gradient-norm clipping over parameters that may be DTensors on different meshes.

`torch.nn.utils.clip_grad_norm_` stacks per-parameter norms, which fails when parameters live
on different meshes (FSDP + TP leaves some on the dp mesh only) and does not know about
pipeline stages on other ranks. Here norms are summed per mesh, made whole with
`full_tensor()`, squared-summed into one scalar, and summed over the pipeline group.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm(
    params, max_norm: float, *, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Clip gradients in place to a global L2 norm of `max_norm` (inf: only measure);
    returns the total norm before clipping as a 0-dim local tensor."""
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[g.device_mesh if isinstance(g, DTensor) else None].append(g)
    total_sq = None
    for gs in groups.values():
        norm = torch.nn.utils.get_total_norm(gs, 2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        sq = norm.float() ** 2
        total_sq = sq if total_sq is None else total_sq + sq
    if total_sq is None:
        return torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        # Scale local shards: every placement (Shard, Replicate) scales the same way.
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        torch._foreach_mul_(local, coef.to(local[0].device))
    return total
