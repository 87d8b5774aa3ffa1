"""CUDA IPC: stored versions in a writer's GPU memory, read by processes on the same host.

``put(..., memory="cuda")`` keeps the stored copy in the writer's own GPU memory instead of
host shared memory: the put is a device-to-device copy, and a reader on the same host opens
the slot with a CUDA IPC handle and copies device to device too (NVLink or the same GPU), so
a GPU-to-GPU weight sync never touches host memory. benchmarks/store_sync.py ``--memory
cuda`` measures it against the host path and a device ``copy_`` of the same bytes.

Lifecycle:
- The writer's store handle owns a :class:`DeviceVolume` (registered with the controller as
  a volume of kind ``"cuda"`` owned by its writer connection; :class:`CudaIpcTransport`
  registers it again if that connection is replaced). Slots are carved from a few large
  ``cudaMalloc`` allocations (tidal/store/transports/cuda/memory.py); each new slot's
  allocation handle, offset and the allocation's size go to the controller with
  ``put_handles`` before any byte is written.
- Slots the controller destroys come back in the next ``put_begin`` / ``put_commit`` reply;
  their memory goes to a pool and is handed to the next new slot of the same size and
  device. It is never ``cudaFree``d while the writer's store is open: CUDA leaves freeing
  exported memory that another process still has open undefined, and readers keep it open
  (see below). A reader only touches a slot while it holds a lease on the version that owns
  it, so memory moved to another slot is never read through the old one.
- A reader opens each allocation once (:class:`Imports`) and keeps it open until its store
  closes (or, past that, until its last zero-copy view of it goes). The writer's memory is
  freed when the writer's store closes or its process exits; its versions are then lost
  (``VolumeLostError``), as for a dead volume.
- Within one process (two store handles, or a handle reading its own writes) IPC handles
  cannot be opened; the reader uses the writer's tensors directly (``_LOCAL``).

Ordering: a put does not wait for its copies. It queues them on the volume's copy stream of
each GPU (one stream per GPU for every put: :meth:`DeviceVolume.copy_stream`), which starts
after the work the caller queued on its current stream; the caller's stream then waits for
the copy stream, so the caller's later kernels (an optimizer step rewriting the weights)
run after the copies. After the copies the put records the volume's interprocess event of
that GPU and commits. A reader opens that event once (its IPC handle travels with the
slots' handles) and, before issuing its copies, waits for it from the host with a deadline
(:func:`_await_writer`: usually it has long completed, one query); a device-side wait could
hang the reader's stream for good if the writer died mid-put. Its own copies are then waited
for with a plain stream synchronize before its lease is released. The event's latest record
follows every earlier put (one copy stream), so a reader never copies bytes still being
written. On the H200 the put's host wait for its own copies was 1.1 ms of a 3.1 ms
put. A streaming reader (``get(..., wait=)`` already waiting) copies each slot once the
writer reported it, and waits for the writer's event at the first report: a put with
reserved slots (a key's third put on) queues all its copies and records its event before it
learns that a reader streams, then reports every slot at once, before the copies ran. A put
without reserved slots copies slot by slot and waits, so its reports come after the bytes.
``put_async`` and friends wait for the copies before their future is done
(tidal/store/streams.py).

CUDA runtime calls go through ``ctypes`` to the ``libcudart`` that torch loaded
(tidal/store/transports/cuda/runtime.py); no extension is compiled.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tidal.store import ops
from tidal.store.conn import Conn
from tidal.store.errors import StoreError
from tidal.store.ops import VolumeInfo
from tidal.store.progress import Progress
from tidal.store.transports import Gate, ReadJob, Transport, WriteJob
from tidal.store.transports.cuda.batch import BatchCopier
from tidal.store.transports.cuda.copies import CopyPlan, CopyPlans
from tidal.store.transports.cuda.gather import GatherCopier
from tidal.store.transports.cuda.memory import (
    _LOCAL,
    DeviceVolume,
    Imports,
    Item,
    is_local,
    narrow,
    numel,
)
from tidal.store.transports.cuda.runtime import device_uuid, runtime


@functools.cache
def copier() -> GatherCopier | BatchCopier:
    """Issues this process's raw device copies: one gather kernel where Triton is installed
    (tidal/store/transports/cuda/gather.py), else batched through the driver torch loaded
    (tidal/store/transports/cuda/batch.py), else one runtime call a copy."""
    rt = runtime()
    with open("/proc/self/maps") as f:
        paths = {ln.split()[-1] for ln in f if "/libcuda.so" in ln}
    batch = BatchCopier(sorted(paths)[0] if paths else None, rt.memcpy_async)
    return GatherCopier(batch) if importlib.util.find_spec("triton") else batch


def warm_up(device: int | None = None, timeout: float = 120.0) -> bool:
    """Build this process's device-copy kernel now and wait for it (at most ``timeout``
    seconds); returns whether it is built (False without Triton, or if the build failed).

    Without it the kernel is built in the background on the first ``memory="cuda"`` put or
    get of a state dict, and the copies of the first second or so (several on a cold
    Triton cache) go through the slower driver calls while the compiler competes for the
    interpreter. A process that syncs weights every step (an RL generator) calls it at
    start. Raises StoreError without CUDA."""
    cp = copier()
    if not isinstance(cp, GatherCopier):
        return False
    index = torch.cuda.current_device() if device is None else device
    cp.build(index)
    return cp.ready(timeout)


class CudaIpcTransport(Transport):
    """Writes into this handle's device volume; reads other writers' device volumes.

    ``writer_conn`` is the connection that owns this handle's device volume (its puts run
    on it); ``control`` the one reads ask for handles on.
    """

    def __init__(
        self, host: str, writer_conn: Callable[[], Conn], control: Conn, timeout: float = 60.0
    ) -> None:
        self.host = host
        self._timeout = timeout  # seconds a read waits for its device copies
        self._writer_conn = writer_conn
        self._control = control
        self._device: DeviceVolume | None = None
        self._registered = 0  # the writer connection's generation the volume lives on
        self._imports = Imports()
        self._lock = threading.Lock()
        self._write_plans = CopyPlans()
        self._read_plans = CopyPlans()
        self._read_keys: dict[int, tuple[list[ReadJob], str, tuple[Any, ...]]] = {}
        self._write_keys: dict[int, tuple[Any, ...]] = {}  # id(jobs) -> jobs, slots, srcs, key

    # -- writer side ----------------------------------------------------------------------

    def volume_id(self) -> str:
        """This handle's device volume, registered on the writer connection (again if that
        connection was replaced: the old one's versions are lost with it)."""
        conn = self._writer_conn()
        with self._lock:
            if self._device is not None and self._registered == conn.generation:
                return self._device.volume_id
            if not torch.cuda.is_available():
                raise ValueError("memory='cuda' needs a CUDA device; none is available")
            vid = f"cuda.{os.getpid()}.{secrets.token_hex(4)}"
            conn.request(ops.DEVICE_VOLUME, volume_id=vid, host=self.host)
            if self._device is not None:
                self._device.close()
            self._device = DeviceVolume(vid)
            self._registered = conn.generation
            return vid

    def slots_freed(self, slots: list[int]) -> None:
        """Slots the controller destroyed: their memory goes back to the pool."""
        if self._device is not None and slots:
            self._device.release(slots)

    def split_early(self, jobs: list[WriteJob]) -> tuple[list[WriteJob], list[WriteJob]]:
        """Every copy: device copies are asynchronous, so all of them are launched before
        ``put_begin``'s reply is read."""
        return jobs, []

    def prepare_write(self, jobs: list[WriteJob]) -> None:
        """Allocate the slots of ``jobs`` new to this volume and send their IPC handles, so
        readers can open them before any byte is written."""
        device = self._device
        assert device is not None, "prepare_write() after volume_id()"
        new = set(device.missing([j.slot for j in jobs]))
        if not new:
            return  # a steady writer's slots: all allocated, their handles sent
        fresh: list[dict[str, Any]] = []
        for job in (j for j in jobs if j.slot in new):
            slot, src = job.slot, job.src
            index = src.device.index if src.is_cuda else torch.cuda.current_device()
            _, where = device.slot(slot, job.nbytes, index)
            if where is not None:
                fresh.append(
                    {
                        "slot": slot,
                        "uuid": device_uuid(index),
                        **where,
                        "event": device.event(index)[1],
                    }
                )
        if fresh:
            try:
                self._writer_conn().request(
                    ops.PUT_HANDLES, volume_id=device.volume_id, handles=fresh
                )
            except BaseException:
                device.release([h["slot"] for h in fresh])  # unknown to readers
                raise

    def write(
        self, vol: VolumeInfo, jobs: list[WriteJob], progress: Progress, grant: bytes
    ) -> None:
        """Queue every job's copy on the volume's copy streams and return (see "Ordering" in
        the module docstring); with a streaming reader (``progress.reporting``), copy slot
        by slot and wait for the copies, as the reports promise written bytes."""
        if not jobs:
            return
        device = self._device
        assert device is not None and vol.id == device.volume_id, vol.id
        slots, srcs, key = self._write_lists(jobs)
        with device.writing(slots), torch.no_grad():
            self.prepare_write(jobs)
            if progress.reporting:
                dsts = [device.typed(j.slot, j.dtype, tuple(j.src.shape)) for j in jobs]
                devices = {d.device for d in dsts} | {t.device for t in srcs if t.is_cuda}
                with _on_copy_streams(device, devices):
                    for job, dst in zip(jobs, dsts, strict=True):
                        dst.copy_(job.src, non_blocking=True)
                        progress.add(job.slot, job.nbytes, dst.device)
                    progress.synchronize()
            else:  # nobody streams it: the copies of a kept plan, no per-slot work
                plan = self._write_plan(device, jobs, srcs, key)
                with _on_copy_streams(device, plan.devices):
                    plan.run(lambda i: plan_dst(device, jobs, srcs, i), srcs.__getitem__, copier())
                if not all(t.is_cuda for t in srcs):  # host sources (pinned ones copy
                    # asynchronously): the caller may rewrite them once the put returns
                    for d in plan.devices:
                        device.copy_stream(d.index).synchronize()

    def _write_lists(
        self, jobs: list[WriteJob]
    ) -> tuple[list[int], list[torch.Tensor], tuple[Any, ...]]:
        """The slots and sources of ``jobs``; built once per jobs list (a steady writer's
        jobs are kept by its put plan and never changed once made), with the copy plan's key."""
        memo = self._write_keys.get(id(jobs))
        if memo is not None and memo[0] is jobs:
            return memo[1], memo[2], memo[3]
        slots, srcs = [j.slot for j in jobs], [j.src for j in jobs]
        key = (
            tuple(slots),
            tuple([j.dtype for j in jobs]),
            tuple(map(torch.Tensor.data_ptr, srcs)),
            tuple([t.dtype for t in srcs]),
        )
        if len(self._write_keys) >= 32:
            self._write_keys.clear()
        self._write_keys[id(jobs)] = (jobs, slots, srcs, key)
        return slots, srcs, key

    def _write_plan(
        self,
        device: DeviceVolume,
        jobs: list[WriteJob],
        srcs: list[torch.Tensor],
        key: tuple[Any, ...],
    ) -> CopyPlan:
        """The copy plan kept under ``key`` (the slots and sources), built on first use."""

        def build() -> CopyPlan:
            return CopyPlan.of([plan_dst(device, jobs, srcs, i) for i in range(len(jobs))], srcs)

        return self._write_plans.get(key, srcs, build)

    # -- reader side ----------------------------------------------------------------------

    def read(self, vol: VolumeInfo, jobs: list[ReadJob], gate: Gate | None) -> None:
        """Copy what ``jobs`` read, after the writer's copies of the version (its event),
        and wait for them: the caller's lease is released next."""
        devices: set[torch.device] = {j.dst.device for j in jobs if j.dst.is_cuda}
        with torch.no_grad():
            if gate is None:
                devices |= self._copy(vol, jobs)
            else:  # a streaming read: each slot once the writer reported it
                for i, job in enumerate(jobs):
                    gate(job.slot)
                    self._open(vol, [job])  # a slot's handle is registered before it is written
                    if i == 0:  # a writer with its slots reserved queues every copy, records
                        # its event, then reports them all at once, before they ran; one that
                        # reports slot by slot does so once each slot's copies are done
                        _await_writer(self._events(vol), self._timeout, f"volume {vol.id!r}")
                    # into host memory: a synchronous copy
                    job.dst.copy_(self._source(vol, job), non_blocking=job.dst.is_cuda)
        for d in devices:
            torch.cuda.current_stream(d).synchronize()

    def views(self, vol: VolumeInfo, items: list[Item], keep: object) -> list[torch.Tensor]:
        """Zero-copy reads: a tensor over each (slot, dtype, shape) of ``items``, once the
        writer's copies into them are done. Each tensor's storage holds ``keep`` (the
        caller's lease token) and the slot's mapping until the caller's last view goes."""
        vid = vol.id
        local = _LOCAL.get(vid)
        if local is None:
            missing = set(self._imports.missing(vid, [slot for slot, _, _ in items]))
            if missing:
                sizes = {s: numel(sh) * dt.itemsize for s, dt, sh in items if s in missing}
                self._open_slots(vol, sizes)
            events = self._imports.events(vid)
        else:
            events = local.events()
        _await_writer(events, self._timeout, f"volume {vid!r}")
        if local is not None:
            return local.views(items, keep)
        return self._imports.views(vid, items, keep)

    def _copy(self, vol: VolumeInfo, jobs: list[ReadJob]) -> set[torch.device]:
        """Issue every job's copy, with the plan kept for these slots and destinations (a
        steady reader opens nothing and decides nothing again), after the writer's event;
        returns the devices they run on."""
        key = self._read_key(vol.id, jobs)
        dsts = [j.dst for j in jobs]

        def build() -> CopyPlan:
            self._open(vol, jobs)
            return CopyPlan.of(dsts, [self._source(vol, j) for j in jobs])

        plan = self._read_plans.get(key, dsts, build)
        # the writer's copies of this version come first
        _await_writer(self._events(vol), self._timeout, f"volume {vol.id!r}")
        plan.run(dsts.__getitem__, lambda i: self._source(vol, jobs[i]), copier())
        return plan.devices

    def _events(self, vol: VolumeInfo) -> list[torch.cuda.Event]:
        """The writer's interprocess events of volume ``vol`` (one per GPU), or its own
        events for a volume of this process."""
        local = _LOCAL.get(vol.id)
        return local.events() if local is not None else self._imports.events(vol.id)

    def _read_key(self, volume_id: str, jobs: list[ReadJob]) -> tuple[Any, ...]:
        """The read plan's key for ``jobs``: the slots, boxes and destinations they name.
        Built once per jobs list: a steady reader passes the same list every time (kept by
        its BoundRead, never changed once made), held here so its id is not reused."""
        memo = self._read_keys.get(id(jobs))
        if memo is not None and memo[0] is jobs and memo[1] == volume_id:
            return memo[2]
        key = (
            volume_id,
            tuple(
                [
                    (
                        j.slot,
                        j.dtype,
                        j.shard_shape,
                        j.src_off,
                        j.sizes,
                        j.dst.data_ptr(),
                        j.dst.dtype,
                    )
                    for j in jobs
                ]
            ),
        )
        if len(self._read_keys) >= 32:
            self._read_keys.clear()
        self._read_keys[id(jobs)] = (jobs, volume_id, key)
        return key

    def _source(self, vol: VolumeInfo, job: ReadJob) -> torch.Tensor:
        """The bytes ``job`` reads, as a view of the device slot."""
        local = _LOCAL.get(vol.id)
        if local is not None:  # this process's own volume
            return narrow(local.typed(job.slot, job.dtype, job.shard_shape), job)
        return self._imports.typed(vol.id, job)

    def _open(self, vol: VolumeInfo, jobs: list[ReadJob]) -> None:
        """Open (once) the CUDA IPC handles of the device slots ``jobs`` read."""
        self._open_slots(vol, {j.slot: numel(j.shard_shape) * j.dtype.itemsize for j in jobs})

    def _open_slots(self, vol: VolumeInfo, sizes: dict[int, int]) -> None:
        """Open (once) the CUDA IPC handles of the device slots ``sizes`` (slot: bytes)."""
        vid = vol.id
        if is_local(vid):
            return  # written by this process: read its tensors directly
        if vol.host != self.host:
            raise StoreError(
                f"volume {vid!r} is GPU memory of a writer on host {vol.host.split('/')[0]} "
                "(put with memory='cuda'); CUDA IPC reaches readers on that host only"
            )
        if not torch.cuda.is_available():
            raise StoreError(
                f"volume {vid!r} is GPU memory (put with memory='cuda'); reading it needs "
                "CUDA in this process"
            )
        known = self._imports.volumes()
        if vid not in known and known:
            # A writer this process has not read from yet: close what it holds open of
            # writers that are gone (their GPU memory stays allocated while it is open).
            alive = {
                v["volume"] for v in self._control.request(ops.VOLUMES)["volumes"] if v["alive"]
            }
            if known - alive:
                self._read_plans.clear()  # their slots' memory is closed below
                self._imports.drop_volumes(known - alive)
        missing = self._imports.missing(vid, list(sizes))
        if missing:
            got = self._control.request(ops.SLOT_HANDLES, volume_id=vid, slots=missing)
            for h in got["handles"]:
                self._imports.add(vid, h, sizes[h["slot"]])

    def close(self) -> None:
        self._read_plans.clear()
        self._read_keys.clear()
        self._write_keys.clear()
        self._write_plans.clear()
        self._imports.close()
        if self._device is not None:
            self._device.close()

    def allocations(self) -> int:
        """Device allocations this handle made (tidal.store.testing)."""
        return 0 if self._device is None else self._device.carved


def plan_dst(
    device: DeviceVolume, jobs: list[WriteJob], srcs: list[torch.Tensor], i: int
) -> torch.Tensor:
    """Where job ``i`` of a put copies to: its slot, viewed as the source's shape."""
    return device.typed(jobs[i].slot, jobs[i].dtype, tuple(srcs[i].shape))


@contextlib.contextmanager
def _on_copy_streams(volume: DeviceVolume, devices: set[torch.device]) -> Iterator[None]:
    """Run the block's copies on ``volume``'s copy stream of each device: after the work the
    caller queued so far, and before the caller's later work; then record the volume's
    event there, for readers to wait on."""
    streams = []
    for d in devices:
        current, copy = torch.cuda.current_stream(d), volume.copy_stream(d.index)
        copy.wait_stream(current)
        streams.append((d, current, copy))
    with contextlib.ExitStack() as stack:
        for _, _, copy in streams:
            stack.enter_context(torch.cuda.stream(copy))
        try:
            yield
        finally:
            for d, current, copy in streams:
                volume.event(d.index)[0].record(copy)
                current.wait_stream(copy)


def _await_writer(events: list[torch.cuda.Event], timeout: float, what: str) -> None:
    """Wait until the writer's copies recorded on ``events`` are done, at most ``timeout``
    seconds (polled: a writer that died mid-put never completes its event)."""
    deadline = None
    for ev in events:
        polls = 0
        while not ev.query():
            now = time.monotonic()
            deadline = deadline or now + timeout
            if now > deadline:
                raise StoreError(
                    f"the writer's device copies into {what} did not finish in {timeout:g} s "
                    "(did its process die during a put?)"
                )
            polls += 1
            time.sleep(0 if polls < 1000 else 0.0005)
