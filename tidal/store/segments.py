"""A client's mappings of volumes' shared-memory segments (the same-host transport).

Read-write mappings serve the copies of puts and gets, and are registered with CUDA on the
first device copy so that copy runs as DMA; read-only mappings back zero-copy views
(tidal/store/views.py). Both are cached per segment path: slots are reused as a ring, so a
steady training loop maps nothing new after its first versions. The caches are bounded
(LRU), and swept of segments whose files are gone (deleted keys, dead volumes) every 64
misses and whenever a key's layout changes, since a mapping keeps its memory alive.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import torch

from tidal.store.errors import StoreError
from tidal.store.volume import as_bytes, map_segment

M = TypeVar("M")
_LIMIT = 65536  # mappings per cache
_SWEEP_EVERY = 64  # misses


def _open(path: str, map_: Callable[[], M]) -> M:
    """``map_()``, with an unmappable segment reported as a StoreError."""
    try:
        return map_()
    except OSError as e:
        raise StoreError(f"cannot map shared-memory segment {path}: {e}") from None


class Segments:
    """Cached mappings by segment path; thread-safe."""

    def __init__(self) -> None:
        self._rw: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._ro: OrderedDict[str, mmap.mmap] = OrderedDict()  # views still alive keep theirs
        self._pinned: dict[str, bool] = {}  # read-write mapping -> registered with CUDA
        self._misses = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rw) + len(self._ro)

    def readwrite(self, path: str, nbytes: int) -> torch.Tensor:
        """The segment as a flat uint8 tensor sharing its memory."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        open_ = lambda: _open(path, lambda: as_bytes(map_segment(path, nbytes)))  # noqa: E731
        return self._cached(self._rw, path, open_, self._unpin)

    def readonly(self, path: str, nbytes: int) -> mmap.mmap:
        """The segment mapped read-only, for zero-copy views."""
        open_ = lambda: _open(path, lambda: map_segment(path, nbytes, writable=False))  # noqa: E731
        return self._cached(self._ro, path, open_, lambda *_: None)

    def _cached(
        self,
        cache: OrderedDict[str, M],
        path: str,
        open_: Callable[[], M],
        evict: Callable[[str, M], None],
    ) -> M:
        with self._lock:
            hit = cache.get(path)
            if hit is not None:
                cache.move_to_end(path)
                return hit
        mapped = open_()
        with self._lock:
            cache[path] = mapped
            self._misses += 1
            if self._misses >= _SWEEP_EVERY:
                self._sweep()
            while len(cache) > _LIMIT:
                evict(*cache.popitem(last=False))
        return mapped

    def pin(self, path: str, seg: torch.Tensor) -> bool:
        """Register a read-write mapping with CUDA (once) so device copies run as DMA: on
        the H200 host an unpinned segment moved 11 GB/s device->host and 7 GB/s host->device
        (benchmarks/store_sync.py --device cuda). Returns True when a device copy may be
        asynchronous. Fallback: where registration fails, copies stay pageable."""
        with self._lock:
            ok = self._pinned.get(path)
            if ok is None and seg.numel():
                rc = torch.cuda.cudart().cudaHostRegister(seg.data_ptr(), seg.numel(), 1)
                ok = self._pinned[path] = int(rc) == 0
        return bool(ok)

    def _unpin(self, path: str, seg: torch.Tensor) -> None:
        if self._pinned.pop(path, False):
            torch.cuda.cudart().cudaHostUnregister(seg.data_ptr())

    def sweep(self) -> None:
        """Drop the mappings of segments whose files are gone."""
        with self._lock:
            self._sweep()

    def _sweep(self) -> None:
        self._misses = 0
        for path in [p for p in self._rw if not os.path.exists(p)]:
            self._unpin(path, self._rw.pop(path))
        for path in [p for p in self._ro if not os.path.exists(p)]:
            del self._ro[path]

    def close(self) -> None:
        with self._lock:
            for path, seg in self._rw.items():
                self._unpin(path, seg)
            self._rw.clear()
            self._ro.clear()
