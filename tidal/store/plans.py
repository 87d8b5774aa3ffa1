"""Plans: what a put declares once, and which bytes a get copies where.

Put side: :func:`describe` turns the tensors of one put into the layout the controller keeps
as a put plan (names, global shapes, stored dtypes, boxes) and the local shards to copy.
:class:`PutPlan` is the client's record of a declared plan: its id on the controller, the
volume it writes to and the slots reserved for its next put. A repeated put of the same
layout looks its plan up by a cheap :func:`fingerprint` and sends no per-tensor metadata.

Get side: :func:`decode_layout` reads a version's layout from an ``acquire`` reply (the
controller sends it only when the client's cached signature is stale) and :func:`read_plan`
intersects each destination window with every stored shard; plans are cached per (key,
stored layout, destination windows), so a steady reader recomputes nothing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tidal.store import boxes, ops, wire
from tidal.store.boxes import Dims, Path
from tidal.store.transports import WriteJob


def stored_dtype(t: torch.Tensor, cast: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor is stored as: ``cast`` for floating point tensors, else its own."""
    return cast if cast is not None and t.dtype.is_floating_point else t.dtype


def fingerprint(items: list[tuple[Path, torch.Tensor]], cast: torch.dtype | None) -> tuple:
    """A key for the layout of ``items``: equal for puts that declare the same plan."""
    out: list[tuple[Any, ...]] = []
    for path, t in items:
        if isinstance(t, DTensor):
            out.append(
                (
                    path,
                    tuple(t.shape),
                    t.dtype,
                    tuple(t.placements),
                    id(t.device_mesh),
                    tuple(t._local_tensor.shape),
                )
            )
        else:
            out.append((path, tuple(t.shape), t.dtype))
    return (cast, tuple(out))


def describe(
    items: list[tuple[Path, torch.Tensor]], cast: torch.dtype | None
) -> tuple[list[dict[str, Any]], list[torch.Tensor], int]:
    """The declarations of a put (``ops.s_decl``), its local shards, and the size of the
    largest DTensor mesh among them (0 without DTensors)."""
    decls, locals_ = [], []
    meshes = 0
    for path, value in items:
        if value.dim() > ops.MAX_DIMS:
            raise ValueError(
                f"{boxes.path_str(path) or 'the tensor'} has {value.dim()} dimensions; "
                f"tidal.store carries at most {ops.MAX_DIMS}"
            )
        shape, offs, sizes, local = boxes.window(value)
        if isinstance(value, DTensor):
            meshes = max(meshes, value.device_mesh.size())
        decls.append(
            {
                "name": list(path),
                "shape": list(shape),
                "dtype": wire.dtype_name(stored_dtype(value, cast)),
                "offsets": list(offs),
                "sizes": list(sizes),
            }
        )
        locals_.append(local)
    return decls, locals_, meshes


def local_shards(items: list[tuple[Path, torch.Tensor]]) -> list[torch.Tensor]:
    """The local tensors of a put whose plan is already known."""
    return [t.to_local() if isinstance(t, DTensor) else t for _, t in items]


@dataclass(slots=True)
class PutPlan:
    """A layout declared on the controller (``put_declare``) by one writer connection."""

    plan_id: int
    volume: ops.VolumeInfo
    generation: int  # the writer connection's generation it was declared on
    dtypes: list[torch.dtype]  # stored dtype per tensor
    nbytes: list[int]  # stored bytes per local shard
    puts: int = 0  # puts made with it: from the second on, each reserves the next one's slots
    reservation: dict[str, Any] | None = None  # ops.s_reservation: slots for the next put
    # The copies of a reservation's slots, by (slots, fresh slots), for the tensors the
    # writer last put with this plan (cleared when they change: Writer.put).
    jobs: dict[tuple[Any, ...], list[WriteJob]] = field(default_factory=dict)


PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types a kept put or read may be reused for (not DTensors: their boxes depend on
their mesh and placements, not only on their local tensor)."""


def identity(tensors: list[torch.Tensor]) -> tuple[Any, ...] | None:
    """What must not change for a kept put or read of ``tensors`` to stay right: which
    tensor objects (the keeper holds them, so an id is not reused meanwhile), their
    addresses and their shapes (what ``resize_``, ``set_`` or ``.data =`` would change; a
    dtype or strides do not change without the address). None when one has no address (a
    sparse tensor, say: never kept, and refused with a clear error on the full path)."""
    try:
        ptrs = tuple(map(torch.Tensor.data_ptr, tensors))
    except RuntimeError:
        return None
    return (tuple(map(id, tensors)), ptrs, tuple([t.shape for t in tensors]))


def check_strided(path: Path, t: torch.Tensor) -> None:
    """TypeError unless ``t`` is a dense (strided) tensor, the only kind the store holds."""
    if t.layout != torch.strided:
        raise TypeError(
            f"{boxes.path_str(path) or 'the tensor'} is a {t.layout} tensor; tidal.store "
            "holds dense tensors (convert it with .to_dense())"
        )


@dataclass(slots=True)
class Stored:
    """A stored tensor's layout, as decoded from an ``acquire`` reply."""

    shape: Dims
    dtype: torch.dtype
    boxes: list[tuple[Dims, Dims]]
    first: int  # index of its first shard in the reply's flat slot list


def decode_layout(meta: list[dict[str, Any]]) -> dict[Path, Stored]:
    stored: dict[Path, Stored] = {}
    first = 0
    for m in meta:
        found = [(tuple(b["offsets"]), tuple(b["sizes"])) for b in m["boxes"]]
        stored[tuple(m["name"])] = Stored(tuple(m["shape"]), wire.DTYPES[m["dtype"]], found, first)
        first += len(found)
    return stored


@dataclass(slots=True, frozen=True)
class Copy:
    """Copy a sub-box of stored shard ``shard`` into the destination's local tensor."""

    dest: int  # index into the destination list
    shard: int  # index into the flat slot list
    shard_shape: Dims
    src_off: Dims  # relative to the stored shard
    dst_off: Dims  # relative to the destination's local tensor
    sizes: Dims
    whole_src: bool = False  # the box is the whole stored shard
    whole_dst: bool = False  # the box is the whole local destination


Window = tuple[Path, Dims, Dims, torch.Tensor]  # path, box offsets, box sizes, local tensor


def read_plan(stored: dict[Path, Stored], windows: list[Window]) -> list[Copy]:
    """For each destination window, the overlap with every stored shard."""
    out = []
    for d, (path, offs, sizes, _) in enumerate(windows):
        s = stored[path]
        if boxes.numel(sizes) == 0:
            continue
        for k, (b_off, b_size) in enumerate(s.boxes):
            if len(s.shape) == 0:
                out.append(Copy(d, s.first + k, (), (), (), (), True, True))
                continue
            hit = boxes.intersect(offs, sizes, b_off, b_size)
            if hit is None:
                continue
            h_off, h_size = hit
            src_off = tuple(a - b for a, b in zip(h_off, b_off, strict=True))
            dst_off = tuple(a - b for a, b in zip(h_off, offs, strict=True))
            out.append(
                Copy(
                    d,
                    s.first + k,
                    b_size,
                    src_off,
                    dst_off,
                    h_size,
                    whole_src=h_size == b_size,
                    whole_dst=h_size == sizes,
                )
            )
    return out


class ReadPlans:
    """An LRU cache of read plans by (key, stored layout signature, destination windows)."""

    def __init__(self, limit: int = 256) -> None:
        self._plans: OrderedDict[tuple[Any, ...], list[Copy]] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()
        self.built = 0  # plans computed (diagnostics: a steady reader builds none)

    def get(
        self, key: str, sig: str, stored: dict[Path, Stored], windows: list[Window]
    ) -> list[Copy]:
        plan_key = (key, sig, tuple((p, o, z) for p, o, z, _ in windows))
        plan = self._plans.get(plan_key)
        if plan is None:
            plan = read_plan(stored, windows)
            with self._lock:
                self.built += 1
                self._plans[plan_key] = plan
                while len(self._plans) > self._limit:
                    self._plans.popitem(last=False)
        return plan
