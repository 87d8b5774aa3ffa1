"""Boxes: where a local tensor sits inside its global tensor, and how two boxes overlap.

A box is ``(offsets, sizes)``, one entry per dimension, in elements of the global tensor.
Writers store one box per shard; a reader asks for the box of its destination (its window)
and copies only the intersection with each stored box, straight into a narrowed view of the
destination. Replicated shards have identical boxes and are stored (and read) once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

Dims = tuple[int, ...]
Path = tuple[str | int, ...]


def window(value: torch.Tensor) -> tuple[Dims, Dims, Dims, torch.Tensor]:
    """The global shape, box offsets, box sizes and local tensor of a tensor or DTensor.

    A plain tensor is its own global tensor (offsets all zero). A DTensor contributes the box
    of its local shard, as DCP computes it (uneven shards included). Partial placements are
    refused: they hold addends, not a window of the value.
    """
    if isinstance(value, DTensor):
        if any(isinstance(p, Partial) for p in value.placements):
            raise ValueError(
                f"DTensor with placements {value.placements} holds partial sums; "
                "redistribute it to Shard/Replicate before storing or loading it"
            )
        global_shape = tuple(value.shape)
        sizes, offsets = compute_local_shape_and_global_offset(
            global_shape, value.device_mesh, value.placements
        )
        local = value.to_local()
        assert tuple(local.shape) == tuple(sizes), (
            f"local shard shape {tuple(local.shape)} != computed box {tuple(sizes)}"
        )
        return global_shape, tuple(offsets), tuple(sizes), local
    if isinstance(value, torch.Tensor):
        shape = tuple(value.shape)
        return shape, (0,) * len(shape), shape, value
    raise TypeError(f"expected a torch.Tensor or DTensor, got {type(value).__name__}")


def numel(sizes: Dims) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def intersect(a_off: Dims, a_size: Dims, b_off: Dims, b_size: Dims) -> tuple[Dims, Dims] | None:
    """The overlap of two boxes, or None when they do not overlap (or the overlap is empty)."""
    offs, sizes = [], []
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size, strict=True):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


def narrow(t: torch.Tensor, offsets: Dims, sizes: Dims) -> torch.Tensor:
    """A view of ``t`` restricted to the box (relative to ``t``'s own origin)."""
    for d, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
        if o != 0 or s != t.shape[d]:
            t = t.narrow(d, o, s)
    return t


def check_cover(global_shape: Dims, boxes: list[tuple[Dims, Dims]]) -> str | None:
    """None if the boxes tile the global tensor exactly (no gap, no partial overlap).

    Identical boxes must already have been deduplicated. Returns a description of the
    problem otherwise.
    """
    total = sum(numel(s) for _, s in boxes)
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            if intersect(*boxes[i], *boxes[j]) is not None:
                return f"shards {boxes[i]} and {boxes[j]} overlap partially"
    want = numel(global_shape)
    if total != want:
        return f"shards cover {total} of {want} elements"
    return None


def flatten(state_dict: Mapping[str, Any], prefix: Path = ()) -> list[tuple[Path, Any]]:
    """Leaves of a nested dict/list state dict as (path, leaf) pairs, in insertion order.
    Leaves are tensors (and DTensors) or plain values; dicts, lists and tuples holding a
    tensor are walked, those holding none are one plain value."""
    if not prefix and type(state_dict) is dict and _flat(state_dict):
        return [((k,), v) for k, v in state_dict.items()]  # a model's state dict: one level
    out: list[tuple[Path, Any]] = []
    items: Any = state_dict.items() if isinstance(state_dict, Mapping) else enumerate(state_dict)
    for k, v in items:
        if isinstance(state_dict, Mapping) and not isinstance(k, str):
            raise TypeError(f"state dict keys must be strings; got {k!r} at {path_str(prefix)}")
        path = (*prefix, k)
        if _holds_tensor(v):
            out.extend(flatten(v, path))  # lists are indexed too
        else:
            out.append((path, v))
    return out


def _flat(d: dict[Any, Any]) -> bool:
    """Whether every key is a str and every value a tensor (so ``flatten`` walks nothing)."""
    return all(isinstance(v, torch.Tensor) for v in d.values()) and all(
        isinstance(k, str) for k in d
    )


def _holds_tensor(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return False  # a leaf itself
    if isinstance(v, Mapping):
        return any(isinstance(x, torch.Tensor) or _holds_tensor(x) for x in v.values())
    if isinstance(v, list | tuple):
        return any(isinstance(x, torch.Tensor) or _holds_tensor(x) for x in v)
    return False


def tensors_of(items: list[tuple[Path, Any]]) -> list[tuple[Path, torch.Tensor]]:
    """The tensor leaves of flattened items."""
    return [(p, v) for p, v in items if isinstance(v, torch.Tensor)]


def unflatten(items: list[tuple[Path, Any]]) -> dict[str, Any]:
    """Inverse of :func:`flatten`; integer path components become list positions."""
    if all(len(p) == 1 and isinstance(p[0], str) for p, _ in items):
        return {str(p[0]): t for p, t in items}  # a one-level state dict
    root: dict[Any, Any] = {}
    for path, t in items:
        node = root
        for comp in path[:-1]:
            node = node.setdefault(comp, {})
        node[path[-1]] = t

    def lists(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        node = {k: lists(v) for k, v in node.items()}
        if (
            node
            and all(isinstance(k, int) for k in node)
            and sorted(node) == list(range(len(node)))
        ):
            return [node[i] for i in range(len(node))]
        return node

    return lists(root)


def path_str(path: Path) -> str:
    return ".".join(str(c) for c in path)
