"""Same-host shared memory: copy straight into and out of a volume's segments.

Steady state: each segment this handle touches is mapped once, read-write (tidal/store/
segments.py caches the mappings; slots are reused as a ring, so a steady training loop maps
nothing new after its first versions) and the copies are ``torch`` copies (multi-threaded on
the host, DMA for CUDA tensors once the mapping is registered with CUDA).

Cold paths, where a mapping would cost a page fault per 4 KB before a single copy:
- a slot that was never written (``WriteJob.fresh``) is filled with ``pwrite`` from a
  contiguous host tensor: the kernel allocates the pages as it copies, with no zeroing pass
  and no faults (on the 2-core dev VM: 2.1 GB/s against 1.0 for mapping and populating,
  memcpy 4.2; benchmarks/store_sync.py's cold put). Each part file of each fresh slot
  (tidal/store/volume.py, ``PART_BYTES``) is one job, the jobs of all slots go to the thread
  pool at once, biggest first: fresh tmpfs pages fill in parallel across files but hardly
  within one, so a 525 MB slot is written by 9 threads into 9 files rather than by one
  (on the H200 host, 3 GB of 114 tensors: 0.336 s, 25% of memcpy, before part files;
  0.2035 s, 57% of the memcpy measured just before it, with them);
- a slot this process has not read before is read with ``preadv`` into a contiguous host
  destination of the stored dtype, when the bytes wanted are contiguous in the slot, in
  pieces that never cross a part file.

Lifecycle: a store handle's :class:`ShmTransport` lives as long as the handle; puts and gets
call ``write`` / ``read`` from their own thread; ``close`` unmaps everything.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import Future, as_completed

import torch

from tidal.store import boxes
from tidal.store.errors import StoreError
from tidal.store.ops import VolumeInfo
from tidal.store.progress import Progress
from tidal.store.segments import Segments
from tidal.store.transports import Gate, ReadJob, Transport, WriteJob
from tidal.store.volume import open_segment, part_path, part_sizes, part_spans, segment_path

_MAX_IO = 1 << 30  # bytes per pwrite/preadv call (Linux caps one call near 2 GiB)
_PIECE = 32 << 20  # bytes a thread reads at a time


@functools.lru_cache(maxsize=4096)
def _prefix(shm_dir: str, store_id: str, volume_id: str) -> str:
    """The checked path of a volume's segments, less the slot number."""
    return segment_path(shm_dir, store_id, volume_id, 1)[:-1]


def path_of(vol: VolumeInfo, slot: int) -> str:
    """The segment file of ``slot`` in the shm volume ``vol`` (its components checked once
    per volume; the slot id is an int the wire schema checked)."""
    return _prefix(vol.shm_dir, vol.store_id, vol.id) + str(slot)


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor (any dtype, numpy or not)."""
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def _contiguous_box(shape: tuple[int, ...], offs: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
    """Whether a sub-box of a C-contiguous tensor is one contiguous run of elements."""
    full = True  # every dimension after this one is whole
    for d in range(len(shape) - 1, -1, -1):
        if not full and sizes[d] != 1:
            return False
        full = full and offs[d] == 0 and sizes[d] == shape[d]
    return True


class ShmTransport(Transport):
    def __init__(self, host: str, segments: Segments) -> None:
        self.host = host
        self.segments = segments
        self._reachable: dict[str, bool] = {}
        self._read_before: set[str] = set()  # segments this process read with preadv

    def reaches(self, vol: VolumeInfo) -> bool:
        """Whether ``vol``'s segments are on this host and accessible to this process."""
        key = f"{vol.host}|{vol.shm_dir}|{vol.store_id}|{vol.id}"
        ok = self._reachable.get(key)
        if ok is None:
            ok = vol.kind == "shm" and vol.host == self.host
            ok = ok and os.access(vol.shm_dir, os.R_OK | os.X_OK)
            self._reachable[key] = ok
        return ok

    def _map(self, path: str, nbytes: int) -> torch.Tensor:
        return self.segments.readwrite(path, nbytes)

    # ---------------------------------------------------------------- writes

    def write(
        self, vol: VolumeInfo, jobs: list[WriteJob], progress: Progress, grant: bytes
    ) -> None:
        cold = [j.fresh and _plain_host(j.src, j.dtype) for j in jobs]
        if any(cold):
            self._pwrite(vol, [j for j, c in zip(jobs, cold, strict=True) if c], progress)
        warm = [j for j, c in zip(jobs, cold, strict=True) if not c]
        paths = [path_of(vol, j.slot) for j in warm]
        views = self.segments.typed_all(
            [(p, j.nbytes, j.dtype, tuple(j.src.shape)) for p, j in zip(paths, warm, strict=True)]
        )
        with torch.no_grad():
            for job, path, dst in zip(warm, paths, views, strict=True):
                src = job.src
                pinned = src.is_cuda and self.segments.pin(path, self._map(path, job.nbytes))
                dst.copy_(src, non_blocking=pinned)
                progress.add(job.slot, job.nbytes, src.device if pinned else None)
        progress.synchronize()

    def _pwrite(self, vol: VolumeInfo, jobs: list[WriteJob], progress: Progress) -> None:
        """Fill fresh slots with pwrite, one job per part file, the parts of every slot at
        once in parallel threads, biggest first (the longest start first); report each slot
        from this thread once its parts are written (the report goes out on a connection
        this thread holds)."""

        def fill(path: str, size: int, data: memoryview) -> None:
            fd = open_segment(path, size, writable=True)
            try:
                done = 0
                while done < len(data):
                    done += os.pwrite(fd, data[done : done + _MAX_IO], done)
            except OSError as e:
                raise StoreError(
                    f"cannot write {size} bytes into {path}: {e.strerror} (is the "
                    "shared-memory file system full? delete keys or lower retention)"
                ) from None
            finally:
                os.close(fd)

        parts = []  # (job index, part file, its size, the bytes for it)
        left = []  # parts of each job not yet written
        for i, job in enumerate(jobs):
            sizes = part_sizes(job.nbytes)
            left.append(len(sizes))
            if not sizes:
                continue
            path, data, at = path_of(vol, job.slot), _bytes(job.src), 0
            for k, n in enumerate(sizes):
                parts.append((i, part_path(path, k), n, data[at : at + n]))
                at += n
        parts.sort(key=lambda p: -p[2])
        pool = self.segments.threads()
        futures: dict[Future[None], int] = {
            pool.submit(fill, path, n, data): i for i, path, n, data in parts
        }
        try:
            for i, job in enumerate(jobs):
                if not left[i]:  # no bytes: nothing to write
                    progress.add(job.slot, job.nbytes)
            for fut in as_completed(futures):
                fut.result()
                i = futures[fut]
                left[i] -= 1
                if not left[i]:
                    progress.add(jobs[i].slot, jobs[i].nbytes)
        finally:
            for fut in futures:  # nothing may still write once this returns
                fut.cancel()
                if not fut.cancelled():
                    fut.exception()

    # ---------------------------------------------------------------- reads

    def read(self, vol: VolumeInfo, jobs: list[ReadJob], gate: Gate | None) -> None:
        paths = [path_of(vol, j.slot) for j in jobs]
        sizes = [j.shard_nbytes for j in jobs]
        cold = [self._first_read(p, j) for p, j in zip(paths, jobs, strict=True)]
        if gate is None and any(cold):  # first reads: preadv in parallel threads
            self._pread_all(
                [(p, j, n) for p, j, n, c in zip(paths, jobs, sizes, cold, strict=True) if c]
            )
        views: list[torch.Tensor | None] = [None] * len(jobs)
        if gate is None:  # map (and populate) the others up front, in parallel
            warm = [i for i, c in enumerate(cold) if not c]
            got = self.segments.typed_all(
                [(paths[i], sizes[i], jobs[i].dtype, jobs[i].shard_shape) for i in warm]
            )
            for i, view in zip(warm, got, strict=True):
                views[i] = view
        devices: set[torch.device] = set()  # CUDA devices with copies in flight
        with torch.no_grad():
            for job, path, n, c, known in zip(jobs, paths, sizes, cold, views, strict=True):
                if c and gate is None:
                    continue  # read above
                if gate is not None:
                    gate(job.slot)  # streaming: wait until the writer put it in place
                if c:
                    self._pread(path, job, n, 0, None)
                    continue
                view = (
                    known
                    if known is not None
                    else self.segments.typed_all([(path, n, job.dtype, job.shard_shape)])[0]
                )
                asynchronous = job.dst.is_cuda and self.segments.pin(path, self._map(path, n))
                src = view if job.whole else boxes.narrow(view, job.src_off, job.sizes)
                job.dst.copy_(src, non_blocking=asynchronous)
                if asynchronous:
                    devices.add(job.dst.device)
        for d in devices:  # the lease is released after this: the copies must be done
            torch.cuda.current_stream(d).synchronize()

    def _first_read(self, path: str, job: ReadJob) -> bool:
        """Whether to read ``job`` with preadv: a slot not mapped here and not read before,
        a contiguous host destination of the stored dtype, contiguous bytes in the slot."""
        return (
            path not in self._read_before
            and not self.segments.has(path)
            and _plain_host(job.dst, job.dtype)
            and _contiguous_box(job.shard_shape, job.src_off, job.sizes)
        )

    def _pread_all(self, jobs: list[tuple[str, ReadJob, int]]) -> None:
        """Read jobs with preadv from a thread pool, in pieces of at most ``_PIECE`` bytes
        that never cross a part file (reads of one file run in parallel, unlike writes)."""
        pieces = []
        for path, job, n in jobs:
            start = 0  # of the piece, in the destination's bytes
            for _, _, size in part_spans(_offset(job), job.dst.numel() * job.dtype.itemsize):
                for at in range(0, size, _PIECE):
                    pieces.append((path, job, n, start + at, min(_PIECE, size - at)))
                start += size
        pool = self.segments.threads()
        futures = [
            pool.submit(self._pread, path, job, n, start, size)
            for path, job, n, start, size in pieces
        ]
        try:
            for fut in futures:
                fut.result()
        finally:
            for fut in futures:  # nothing may still write into a destination after this
                if not fut.cancel():
                    fut.exception()

    def _pread(self, path: str, job: ReadJob, nbytes: int, start: int, size: int | None) -> None:
        """Bytes ``start``.. (``size`` of them, or all) of the job's destination, by preadv
        from the part files of the slot (``path`` its part 0, ``nbytes`` its size)."""
        data = _bytes(job.dst)
        data = data[start : start + size] if size is not None else data[start:]
        sizes = part_sizes(nbytes)
        done = 0
        for part, at, n in part_spans(_offset(job) + start, len(data)):
            file = part_path(path, part)
            fd = open_segment(file, sizes[part], writable=False)
            try:
                end = done + n
                while done < end:
                    got = os.preadv(fd, [data[done : min(end, done + _MAX_IO)]], at)
                    if got == 0:
                        raise StoreError(f"segment {file} ended early")
                    done += got
                    at += got
            finally:
                os.close(fd)
        if len(self._read_before) > 65536:  # a hint only: forget, rather than grow
            self._read_before.clear()
        self._read_before.add(path)

    def check(self, vol: VolumeInfo, slot: int) -> None:
        """Raise StoreError if the segment of ``slot`` is not there (forced transport)."""
        if not os.path.exists(path_of(vol, slot)):
            raise StoreError(
                f"transport='shm' but the segments of volume {vol.id!r} are not on this host"
            )

    def close(self) -> None:
        self.segments.close()


def _offset(job: ReadJob) -> int:
    """Where the job's box starts in its slot, in bytes (the box is contiguous there)."""
    base = 0
    stride = job.dtype.itemsize
    for d in range(len(job.shard_shape) - 1, -1, -1):
        base += job.src_off[d] * stride
        stride *= job.shard_shape[d]
    return base


def _plain_host(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """A contiguous host tensor of ``dtype``: its bytes can go to a file as they are."""
    return t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()
