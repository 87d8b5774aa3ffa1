"""Same-host shared memory: copy straight into and out of a volume's mapped segments.

Lifecycle: a store handle's :class:`ShmTransport` maps each segment it touches once, read-write
(tidal/store/segments.py caches the mappings; slots are reused as a ring, so a steady
training loop maps nothing new after its first versions) and unmaps them at ``close``. Puts
and gets of the handle call ``write`` / ``read`` from their own thread; the copies are
``torch`` copies (multi-threaded on the host, DMA for CUDA tensors once the mapping is
registered with CUDA).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tidal.store import layout
from tidal.store.errors import StoreError
from tidal.store.progress import Progress
from tidal.store.segments import Segments
from tidal.store.transports import Gate, ReadJob, WriteJob
from tidal.store.volume import segment_path


def path_of(vol: dict[str, Any], slot: int) -> str:
    """The segment file of ``slot`` in the shm volume ``vol`` (checked components)."""
    return segment_path(vol["shm_dir"], vol["store_id"], vol["id"], slot)


class ShmTransport:
    def __init__(self, host: str, segments: Segments) -> None:
        self.host = host
        self.segments = segments
        self._reachable: dict[str, bool] = {}

    def reaches(self, vol: dict[str, Any]) -> bool:
        """Whether ``vol``'s segments are on this host and accessible to this process."""
        key = f"{vol['host']}|{vol['shm_dir']}|{vol['store_id']}|{vol['id']}"
        ok = self._reachable.get(key)
        if ok is None:
            ok = vol["kind"] == "shm" and vol["host"] == self.host
            ok = ok and os.access(vol["shm_dir"], os.R_OK | os.X_OK)
            self._reachable[key] = ok
        return ok

    def _map(self, vol: dict[str, Any], slot: int, nbytes: int) -> torch.Tensor:
        return self.segments.readwrite(path_of(vol, slot), nbytes)

    def write(
        self, vol: dict[str, Any], jobs: list[WriteJob], progress: Progress, grant: bytes
    ) -> None:
        segs = self.segments.map_all([(path_of(vol, j.slot), j.nbytes) for j in jobs])
        with torch.no_grad():
            for job, dst in zip(jobs, segs, strict=True):
                src = job.src
                pinned = src.is_cuda and self.segments.pin(path_of(vol, job.slot), dst)
                dst.view(job.dtype).view(src.shape).copy_(src, non_blocking=pinned)
                progress.add(job.slot, job.nbytes, src.device if pinned else None)
        progress.synchronize()

    def read(self, vol: dict[str, Any], jobs: list[ReadJob], gate: Gate | None) -> None:
        devices: set[torch.device] = set()  # CUDA devices with copies in flight
        sizes = [layout.numel(j.shard_shape) * j.dtype.itemsize for j in jobs]
        if gate is None:  # map (and populate) them all up front, in parallel
            self.segments.map_all(
                [(path_of(vol, j.slot), n) for j, n in zip(jobs, sizes, strict=True)]
            )
        with torch.no_grad():
            for job, n in zip(jobs, sizes, strict=True):
                if gate is not None:
                    gate(job.slot)  # streaming: wait until the writer put it in place
                seg = self._map(vol, job.slot, n)
                asynchronous = job.dst.is_cuda and self.segments.pin(path_of(vol, job.slot), seg)
                src = seg.view(job.dtype).view(job.shard_shape)
                job.dst.copy_(layout.narrow(src, job.src_off, job.sizes), non_blocking=asynchronous)
                if asynchronous:
                    devices.add(job.dst.device)
        for d in devices:  # the lease is released after this: the copies must be done
            torch.cuda.current_stream(d).synchronize()

    def check(self, vol: dict[str, Any], slot: int) -> None:
        """Raise StoreError if the segment of ``slot`` is not there (forced transport)."""
        if not os.path.exists(path_of(vol, slot)):
            raise StoreError(
                f"transport='shm' but the segments of volume {vol['id']!r} are not on this host"
            )

    def close(self) -> None:
        self.segments.close()
