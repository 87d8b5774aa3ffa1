"""The controller's records: keys, versions, tensors, shards, put plans, leases, volumes.

Plain data, no locking: the controller (tidal/store/controller.py) holds one lock over all
of them. A slot id names one allocation of one volume; the controller issues slot ids and
never reuses one for another allocation.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

Name = tuple[Any, ...]
Dims = tuple[int, ...]


@dataclass(slots=True)
class ShardRec:
    offsets: Dims
    sizes: Dims
    slot: int
    volume: str
    nbytes: int


@dataclass(slots=True)
class TensorRec:
    shape: Dims
    dtype: str
    shards: list[ShardRec] = field(default_factory=list)


@dataclass(slots=True)
class VersionRec:
    version: int
    kind: str
    writers: int
    keep: int
    seen: dict[str, int] = field(default_factory=dict)  # writer -> connection id
    done: set[str] = field(default_factory=set)
    plans: dict[str, int] = field(default_factory=dict)  # writer -> plan id
    mine: dict[str, list[int]] = field(default_factory=dict)  # writer -> its slots
    writing: int = 0  # writers that began and have not committed, aborted or left
    tensors: dict[Name, TensorRec] = field(default_factory=dict)
    objects: dict[Name, Any] = field(default_factory=dict)  # non-tensor leaves
    committed: bool = False
    written: set[int] = field(default_factory=set)  # slots whose bytes are in (streaming)
    leases: int = 0
    dropped: str | None = None  # why the version is gone (evicted, deleted, lost, aborted)
    destroy: bool = False  # free its slots for good (not into the ring) once unleased
    sig: str = ""
    # The writers' (plan, replicas) set it was committed with (Writes._publish): versions
    # of one layout share a ReadLayout.
    layout: tuple[Any, ...] | None = None

    def slots_by_plan(self) -> list[int]:
        """The writers' slots, writer by writer in plan id order (ReadLayout.order indexes
        this list)."""
        return [s for w in sorted(self.plans, key=self.plans.__getitem__) for s in self.mine[w]]

    def shards(self) -> list[tuple[Name, ShardRec]]:
        return [(n, s) for n, t in self.tensors.items() for s in t.shards]


@dataclass(slots=True)
class KeyRec:
    kind: str
    keep: int | None = None  # retention set by a put for this key (sticky), else the store's
    versions: dict[int, VersionRec] = field(default_factory=dict)
    next_version: int = 0
    # Freed slots waiting for reuse: (volume, name, nbytes) -> slot ids.
    free: dict[tuple[str, Name, int], list[int]] = field(default_factory=dict)
    gone: OrderedDict[int, str] = field(default_factory=OrderedDict)  # dropped versions
    pruned_for: str = ""  # the layout signature the free ring was last pruned for


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor shard a writer declared: its place in the global tensor."""

    name: Name
    shape: Dims
    dtype: str
    offsets: Dims
    sizes: Dims
    nbytes: int  # 0: an empty shard, nothing to store


@dataclass(slots=True)
class PlanRec:
    """A writer's declared layout of one key (a put plan), owned by one connection."""

    plan: int
    key: str
    kind: str
    conn: int
    writers: int
    keep: int | None
    volume: str
    entries: list[Entry]
    sig: str  # the layout's signature (names, shapes, dtypes, boxes)
    replicas: set[int] = field(default_factory=set)  # entries another writer stored last time
    # Each entry's ring in its key's free slots: (volume, name, nbytes), as KeyRec.free.
    rings: list[tuple[str, Name, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rings = [(self.volume, e.name, e.nbytes) for e in self.entries]


@dataclass(slots=True)
class Reservation:
    """Slots claimed for a writer's next put of a plan, before it names the version."""

    rid: int
    plan: int
    conn: int
    slots: list[int | None]  # per plan entry
    grant: bytes
    fresh: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ReadLayout:
    """What an acquire says of a version's layout, kept per layout (``VersionRec.layout``):
    the same for every version of a steady writer, so an acquire costs no per-tensor work."""

    sig: str
    order: list[int]  # the slots in reply order, as indices into VersionRec.slots_by_plan()
    vols: list[int]  # each slot's volume, as an index into volume_ids
    volume_ids: list[str]
    meta: list[dict[str, Any]]  # ops.s_meta per tensor, for readers without this layout


@dataclass(slots=True)
class Lease:
    key: str
    vrec: VersionRec
    conn: int


class Backend(Protocol):
    """How the controller reaches a volume's memory (tidal/store/backends.py)."""

    def create(self, segments: list[tuple[int, int]]) -> None: ...
    def destroy(self, slots: list[int]) -> None: ...
    def grant(self, slots: list[int], grant: bytes) -> None: ...
    def seal(self, slots: list[int]) -> None: ...
    def alive(self) -> bool: ...
    def close(self) -> None: ...


@dataclass(slots=True)
class VolumeRec:
    volume_id: str
    kind: str  # "shm": host shared memory; "cuda": a writer's GPU memory (CUDA IPC)
    host: str
    address: str
    shm_dir: str
    store_id: str
    backend: Backend
    owner: int | None = None  # the connection it dies with (cuda volumes, registered ones)
    alive: bool = True
    used: int = 0
    handles: dict[int, dict[str, Any]] = field(default_factory=dict)  # cuda: slot -> its
    # ``ops.s_handle`` record (GPU, allocation's IPC handle, offset, span, event's IPC handle)
    freed: list[int] = field(default_factory=list)  # cuda: destroyed, owner not yet told

    def info(self) -> dict[str, Any]:
        """The volume as the wire describes it (ops.s_volume)."""
        return {
            "id": self.volume_id,
            "kind": self.kind,
            "host": self.host,
            "address": self.address,
            "shm_dir": self.shm_dir,
            "store_id": self.store_id,
        }


def name_order(name: Name) -> tuple[Any, ...]:
    return tuple((0, c) if isinstance(c, int) else (1, c) for c in name)


def layout_signature(
    kind: str, tensors: dict[Name, tuple[Dims, str, list[tuple[Dims, Dims]]]]
) -> str:
    """A short hash of a layout: names, shapes, dtypes and the boxes of each tensor."""
    h = hashlib.sha1(kind.encode())
    for n in sorted(tensors, key=name_order):
        shape, dtype, boxes = tensors[n]
        h.update(repr((n, shape, dtype, sorted(boxes))).encode())
    return h.hexdigest()[:20]
