"""The GPU memory behind ``memory="cuda"`` slots: a writer's :class:`DeviceVolume` and a
reader's :class:`Imports` of other processes' volumes (used by
tidal/store/transports/cuda/ipc.py).

Slots are carved from allocations of ``ARENA_BYTES`` (a slot of a quarter of that or more
gets an allocation of its own), each one ``cudaMalloc`` with one IPC handle. A slot is
(allocation, offset); the controller holds each slot's allocation handle, offset and the
allocation's size (``span``). Carving keeps a version's tensors in a few allocations, so a
zero-copy read makes one tensor storage per allocation and a cheap strided view per tensor
instead of a storage per tensor (``views``).

Lifecycle:
- The writer carves slots as puts need them. Memory of a destroyed slot goes to a pool keyed
  by size and device and is reused by the next new slot of that size; nothing is freed while
  the writer's store is open (freeing exported memory that a reader still has open is
  undefined in CUDA), and everything at its close.
- A reader opens each allocation once, on the first slot it reads there, and keeps it open
  while its table (or a read plan, or a zero-copy view) holds it: the mapping is closed when
  its last holder goes (:class:`_Opened`).
- Within one process IPC handles cannot be opened: readers use the writer's volume directly
  through ``_LOCAL``.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tidal.store.errors import StoreError
from tidal.store.transports import ReadJob
from tidal.store.transports.cuda.runtime import as_tensor, device_index, runtime

ARENA_BYTES = 256 << 20  # slots are carved from allocations this big
ALIGN = 512  # each slot starts at a multiple of this

Item = tuple[int, torch.dtype, tuple[int, ...]]  # a zero-copy read: slot, dtype, shape

# Device volumes of this process by id: IPC handles cannot be opened in the process that
# made them, so same-process readers use the writer's tensors through this table. It only
# ever holds volumes of live Store handles of this process (weak values).
_LOCAL: weakref.WeakValueDictionary[str, DeviceVolume] = weakref.WeakValueDictionary()


def is_local(volume_id: str) -> bool:
    """Whether ``volume_id`` is a device volume of this process."""
    return volume_id in _LOCAL


class _Arena:
    """One allocation of a writer's volume, carved into slots from its start."""

    __slots__ = ("ptr", "span", "device", "used", "handle", "flat")

    def __init__(self, span: int, device: int) -> None:
        with torch.cuda.device(device):
            self.ptr = runtime().malloc(span)
        self.span, self.device, self.used = span, device, 0
        self.handle = runtime().handle(self.ptr)
        self.flat = as_tensor(self.ptr, span, device)


class DeviceVolume:
    """A writer's slots in its own GPU memory (see the module docstring)."""

    def __init__(self, volume_id: str) -> None:
        self.volume_id = volume_id
        # slot -> (its allocation, offset, bytes, its memory as a flat tensor)
        self._slots: dict[int, tuple[_Arena, int, int, torch.Tensor]] = {}
        self._pool: dict[tuple[int, int], list[tuple[_Arena, int, torch.Tensor]]] = {}
        self._open_arena: dict[int, _Arena] = {}  # device -> the one new slots come from
        self._owned: list[_Arena] = []  # every allocation, freed at close
        self.carved = 0  # slots carved (not taken from the pool)
        self._writing: set[int] = set()  # slots a put of this process is filling
        self._deferred: list[int] = []  # released while being written: pooled at the end
        self._views: dict[int, dict[tuple[Any, ...], torch.Tensor]] = {}  # slot -> typed views
        self._events: dict[int, tuple[torch.cuda.Event, bytes]] = {}  # device -> (event, handle)
        self._streams: dict[int, torch.cuda.Stream] = {}  # device -> the puts' copy stream
        self._lock = threading.Lock()
        _LOCAL[volume_id] = self

    def event(self, device: int) -> tuple[torch.cuda.Event, bytes]:
        """The interprocess event recorded after this volume's copies on ``device``, and
        its IPC handle (sent with the slots' handles: readers' copies wait for it)."""
        with self._lock:
            have = self._events.get(device)
            if have is None:
                with torch.cuda.device(device):
                    ev = torch.cuda.Event(interprocess=True)
                    ev.record()  # creates it on this device
                have = self._events[device] = (ev, bytes(ev.ipc_handle()))
            return have

    def events(self) -> list[torch.cuda.Event]:
        """Every device's event (same-process readers wait on these objects directly)."""
        with self._lock:
            return [ev for ev, _ in self._events.values()]

    def copy_stream(self, device: int) -> torch.cuda.Stream:
        """The stream every put of this volume copies on, per device: one stream, so the
        event recorded after a put's copies also follows every earlier put's."""
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = torch.cuda.Stream(device)
            return s

    def slot(self, slot: int, nbytes: int, device: int) -> tuple[torch.Tensor, dict | None]:
        """The memory of ``slot``; for a slot new to this volume also where it is (the
        allocation's IPC handle, the offset, the allocation's size) for the controller,
        else None."""
        with self._lock:
            have = self._slots.get(slot)
            if have is not None:
                return have[3], None
            pool = self._pool.get((device, nbytes))
            if pool:
                arena, offset, t = pool.pop()
            else:
                arena, offset = self._carve(max(nbytes, 1), device)
                t = arena.flat[offset : offset + nbytes]
                self.carved += 1
            self._slots[slot] = (arena, offset, nbytes, t)
            return t, {"handle": arena.handle, "offset": offset, "span": arena.span}

    def _carve(self, nbytes: int, device: int) -> tuple[_Arena, int]:
        size = -(-nbytes // ALIGN) * ALIGN
        if size >= ARENA_BYTES // 4:  # big: an allocation of its own
            own = _Arena(size, device)
            self._owned.append(own)
            own.used = size
            return own, 0
        arena = self._open_arena.get(device)
        if arena is None or arena.used + size > arena.span:
            arena = self._open_arena[device] = _Arena(ARENA_BYTES, device)
            self._owned.append(arena)
        offset, arena.used = arena.used, arena.used + size
        return arena, offset

    def missing(self, slots: list[int]) -> list[int]:
        """The slots of ``slots`` not allocated in this volume yet."""
        with self._lock:
            have = self._slots
            return [s for s in slots if s not in have]

    def local(self, slot: int) -> torch.Tensor:
        try:
            return self._slots[slot][3]
        except KeyError:
            raise StoreError(f"device volume {self.volume_id} has no slot {slot}") from None

    def typed(self, slot: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The slot's memory viewed as ``shape`` and ``dtype`` (views are kept: a steady
        writer puts the same layout into the same slots)."""
        views = self._views.setdefault(slot, {})
        view = views.get((dtype, shape))
        if view is None:
            view = views[(dtype, shape)] = self.local(slot).view(dtype).view(shape)
        return view

    def views(self, items: list[Item], keep: object) -> list[torch.Tensor]:
        """Zero-copy reads of this process's own slots (see :func:`_views`)."""
        with self._lock:
            try:
                at = [(self._slots[slot][:2], dt, shape) for slot, dt, shape in items]
            except KeyError as e:
                raise StoreError(f"device volume {self.volume_id} has no slot {e}") from None
        return _views([(a, off, dt, sh) for (a, off), dt, sh in at], lambda a: keep)

    def release(self, slots: list[int]) -> None:
        """Slots the controller destroyed (or never learned of): their memory goes back to
        the pool, once no put of this process is still writing them."""
        with self._lock:
            for slot in slots:
                if slot in self._writing:
                    self._deferred.append(slot)
                    continue
                rec = self._slots.pop(slot, None)
                self._views.pop(slot, None)
                if rec is not None:
                    arena, offset, n, t = rec
                    self._pool.setdefault((arena.device, n), []).append((arena, offset, t))

    @contextlib.contextmanager
    def writing(self, slots: list[int]) -> Iterator[None]:
        """Mark ``slots`` as being written (by one put) until the block ends."""
        with self._lock:
            self._writing.update(slots)
        try:
            yield
        finally:
            with self._lock:
                self._writing.difference_update(slots)
                done = [s for s in self._deferred if s not in self._writing]
                self._deferred = [s for s in self._deferred if s in self._writing]
            self.release(done)

    def close(self) -> None:
        with self._lock:
            owned, self._owned = self._owned, []
            self._slots.clear()
            self._views.clear()
            self._pool.clear()
            self._open_arena.clear()
        _LOCAL.pop(self.volume_id, None)
        for d in {a.device for a in owned}:
            torch.cuda.synchronize(d)
        for arena in owned:
            try:
                runtime().free(arena.ptr)
            except StoreError:
                pass  # the process is exiting or the context is gone: nothing to free


class _Opened:
    """One allocation of another process's device volume, opened in this one. Its IPC
    mapping is closed when the last holder lets go: the reader's table (:class:`Imports`),
    a read plan's source views, or a zero-copy view handed to the caller."""

    __slots__ = ("ptr", "span", "device", "__weakref__")

    def __init__(self, ptr: int, span: int, device: int) -> None:
        self.ptr, self.span, self.device = ptr, span, device
        weakref.finalize(self, _close_quietly, ptr).atexit = False  # exit frees it anyway


def _close_quietly(ptr: int) -> None:
    try:
        runtime().close(ptr)
    except StoreError:
        pass  # the exporter is gone: its memory went with it


class Imports:
    """A reader's opened slots of other processes' device volumes, by (volume, slot)."""

    def __init__(self) -> None:
        # (volume, allocation handle) -> the opened allocation and a tensor over all of it
        self._arenas: dict[tuple[str, bytes], tuple[_Opened, torch.Tensor]] = {}
        # (volume, slot) -> its allocation, offset, and its bytes as a flat tensor
        self._open: dict[tuple[str, int], tuple[_Opened, int, torch.Tensor]] = {}
        self._views: dict[tuple[str, int], dict[tuple[Any, ...], torch.Tensor]] = {}
        self._events: dict[tuple[str, str], torch.cuda.Event] = {}  # (volume, GPU uuid)
        self._lock = threading.Lock()

    def missing(self, volume_id: str, slots: list[int]) -> list[int]:
        with self._lock:
            return [s for s in slots if (volume_id, s) not in self._open]

    def volumes(self) -> set[str]:
        with self._lock:
            return {v for v, _ in self._open}

    def add(self, volume_id: str, h: dict[str, Any], nbytes: int) -> None:
        """Open slot ``h["slot"]`` (an ``ops.s_handle`` record) of ``nbytes``."""
        slot, offset, span = h["slot"], h["offset"], h["span"]
        if offset + nbytes > span:
            raise StoreError(
                f"slot {slot} of device volume {volume_id!r}: {nbytes} bytes at offset "
                f"{offset} do not fit its allocation of {span} bytes"
            )
        with self._lock:
            if (volume_id, slot) in self._open:
                return
            arena = self._arenas.get((volume_id, h["handle"]))
            opened = (volume_id, h["uuid"]) in self._events
        device = device_index(h["uuid"])
        if not opened:
            ev = torch.cuda.Event.from_ipc_handle(device, h["event"])
            with self._lock:
                self._events.setdefault((volume_id, h["uuid"]), ev)
        if arena is None:
            with torch.cuda.device(device):
                o = _Opened(runtime().open(h["handle"]), span, device)
                new = (o, as_tensor(o.ptr, span, device, keep=o))
            with self._lock:  # if another thread opened it meanwhile, ours closes unused
                arena = self._arenas.setdefault((volume_id, h["handle"]), new)
        if arena[0].span != span:
            raise StoreError(
                f"slot {slot} of device volume {volume_id!r} names an allocation of {span} "
                f"bytes that was opened as {arena[0].span}"
            )
        t = arena[1][offset : offset + nbytes]
        with self._lock:
            self._open.setdefault((volume_id, slot), (arena[0], offset, t))

    def drop_volumes(self, gone: set[str]) -> None:
        """Let go of what this process opened of the volumes ``gone`` (dead writers; every
        volume at close): each allocation is closed now, or when its last view goes."""
        with self._lock:
            for k in [k for k in self._open if k[0] in gone]:
                del self._open[k]
                self._views.pop(k, None)
            for a in [a for a in self._arenas if a[0] in gone]:
                del self._arenas[a]
            for ev_key in [e for e in self._events if e[0] in gone]:
                del self._events[ev_key]

    def events(self, volume_id: str) -> list[torch.cuda.Event]:
        """The writer's events of ``volume_id`` (one per GPU its slots are on)."""
        with self._lock:
            return [ev for (v, _), ev in self._events.items() if v == volume_id]

    def get(self, volume_id: str, slot: int) -> torch.Tensor:
        local = _LOCAL.get(volume_id)
        if local is not None:
            return local.local(slot)
        with self._lock:
            try:
                return self._open[(volume_id, slot)][2]
            except KeyError:
                raise StoreError(f"slot {slot} of device volume {volume_id} is not open") from None

    def views(self, volume_id: str, items: list[Item], keep: object) -> list[torch.Tensor]:
        """Zero-copy reads of opened slots (see :func:`_views`); each view also holds its
        allocation's mapping open."""
        with self._lock:
            try:
                at = [(self._open[(volume_id, slot)][:2], dt, sh) for slot, dt, sh in items]
            except KeyError as e:
                raise StoreError(f"slot {e} of device volume {volume_id} is not open") from None
        return _views([(o, off, dt, sh) for (o, off), dt, sh in at], lambda o: (o, keep))

    def typed(self, volume_id: str, job: ReadJob) -> torch.Tensor:
        """The bytes ``job`` reads of an opened slot, as a view of its shape and dtype
        (views are kept: a steady reader reads the same boxes of the same slots)."""
        key = (job.dtype, job.shard_shape, job.src_off, job.sizes)
        with self._lock:
            views = self._views.setdefault((volume_id, job.slot), {})
            view = views.get(key)
            if view is None:
                opened = self._open.get((volume_id, job.slot))
                if opened is None:
                    raise StoreError(f"slot {job.slot} of device volume {volume_id} is not open")
                src = opened[2].view(job.dtype).view(job.shard_shape)
                view = views[key] = narrow(src, job)
            return view

    def close(self) -> None:
        self.drop_volumes(self.volumes())


def _views(
    at: list[tuple[_Arena | _Opened, int, torch.dtype, tuple[int, ...]]],
    holder: Callable[[Any], object],
) -> list[torch.Tensor]:
    """A tensor of each (allocation, offset, dtype, shape) of ``at``: one new storage per
    allocation (``as_tensor``, holding ``holder(allocation)``), shared by strided views of
    it, so the caller's last view of a read lets go of everything the read holds."""
    bases: dict[int, torch.Tensor] = {}
    typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    strides: dict[tuple[int, ...], tuple[int, ...]] = {}
    out = []
    for alloc, offset, dtype, shape in at:
        key = id(alloc)
        base = typed.get((key, dtype))
        if base is None:
            flat = bases.get(key)
            if flat is None:
                flat = as_tensor(alloc.ptr, alloc.span, alloc.device, keep=holder(alloc))
                bases[key] = flat
            base = typed[(key, dtype)] = flat.view(dtype)
        st = strides.get(shape)
        if st is None:
            st = strides[shape] = contiguous_strides(shape)
        out.append(torch.as_strided(base, shape, st, offset // dtype.itemsize))
    return out


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, n = [], 1
    for s in reversed(shape):
        out.append(n)
        n *= max(s, 1)
    return tuple(reversed(out))


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def narrow(src: torch.Tensor, job: ReadJob) -> torch.Tensor:
    """The box of ``src`` that ``job`` reads."""
    if job.whole:
        return src
    for d, (o, s) in enumerate(zip(job.src_off, job.sizes, strict=True)):
        if o != 0 or s != src.shape[d]:
            src = src.narrow(d, o, s)
    return src
