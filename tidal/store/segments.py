"""A client's mappings of volumes' shared-memory segments (the same-host transport).

A segment is a slot's part files (tidal/store/volume.py), mapped as one flat range and named
here by the path of its part 0. Read-write mappings serve the copies of puts and gets, and
are registered with CUDA on the first device copy so that copy runs as DMA; read-only
mappings back zero-copy views (tidal/store/views.py). Segments mapped for the first time are
populated before the copy: their pages are faulted in (and, for a fresh slot, allocated) by a
pool of threads, a few tens of MB each, the pieces of every segment of the call at once
rather than segment by segment (fresh pages fill in parallel across part files, hardly within
one), and rather than one 4 KB fault at a time inside the copy (:meth:`Segments.map_all`;
benchmarks/store_sync.py's cold-put row measures it). Both are cached per segment path:
slots are reused as a ring, so a steady training loop maps nothing new after its first
versions. The caches are bounded (LRU), and swept of segments whose files are gone (deleted
keys, dead volumes) every 64 misses and whenever a key's layout changes, since a mapping keeps
its memory alive.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from tidal.store.errors import StoreError
from tidal.store.volume import Mapping, as_bytes, map_segment, populate

M = TypeVar("M")
_LIMIT = 65536  # mappings per cache
_SWEEP_EVERY = 64  # misses


def _map_rw(path: str, nbytes: int) -> torch.Tensor:
    return _open(path, lambda: as_bytes(map_segment(path, nbytes)))


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
        self._ro: OrderedDict[str, Mapping] = OrderedDict()  # views still alive keep theirs
        self._pinned: dict[str, bool] = {}  # read-write mapping -> registered with CUDA
        self._misses = 0
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # populates fresh mappings
        # Typed views of read-write mappings: path -> (dtype, shape) -> view.
        self._typed: dict[str, dict[tuple[torch.dtype, tuple[int, ...]], torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._rw) + len(self._ro)

    def readwrite(self, path: str, nbytes: int) -> torch.Tensor:
        """The segment as a flat uint8 tensor sharing its memory."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        open_ = lambda: _open(path, lambda: as_bytes(map_segment(path, nbytes)))  # noqa: E731
        return self._cached(self._rw, path, open_, self._unpin)

    def map_all(self, segments: list[tuple[str, int]]) -> list[torch.Tensor]:
        """``readwrite`` of each (path, nbytes), populating the ones mapped for the first
        time, all at once over the pool's threads, before returning."""
        out: list[torch.Tensor | None] = []
        fresh: list[tuple[int, str, int]] = []
        with self._lock:
            for i, (path, n) in enumerate(segments):
                hit = self._rw.get(path) if n else torch.empty(0, dtype=torch.uint8)
                if hit is not None and n:
                    self._rw.move_to_end(path)
                out.append(hit)
                if hit is None:
                    fresh.append((i, path, n))
        if fresh:
            segs = [_map_rw(p, n) for _, p, n in fresh]
            populate(
                [(seg.data_ptr(), n, p) for seg, (_, p, n) in zip(segs, fresh, strict=True)],
                self.threads(),
            )
            for seg, (i, p, _) in zip(segs, fresh, strict=True):
                out[i] = self._insert(p, seg)
        return out  # type: ignore[return-value]  # every entry is filled above

    def typed_all(
        self, segments: list[tuple[str, int, torch.dtype, tuple[int, ...]]]
    ) -> list[torch.Tensor]:
        """``map_all`` of each (path, nbytes), as views of ``dtype`` and shape (kept: a
        steady writer or reader sees the same slots in the same layouts)."""
        out: list[torch.Tensor | None] = []
        missing = []
        for i, (path, _, dtype, shape) in enumerate(segments):
            view = self._typed.get(path, {}).get((dtype, shape))
            out.append(view)
            if view is None:
                missing.append(i)
        if missing:
            raw = self.map_all([(segments[i][0], segments[i][1]) for i in missing])
            with self._lock:
                for i, seg in zip(missing, raw, strict=True):
                    path, _, dtype, shape = segments[i]
                    view = seg.view(dtype).view(shape)
                    if path in self._rw:  # not swept meanwhile
                        self._typed.setdefault(path, {})[(dtype, shape)] = view
                    out[i] = view
        return out  # type: ignore[return-value]  # every entry is filled above

    def has(self, path: str) -> bool:
        """Whether ``path`` is mapped read-write here."""
        with self._lock:
            return path in self._rw

    def threads(self) -> ThreadPoolExecutor:
        """The pool that populates fresh mappings and fills fresh slots."""
        with self._lock:
            if self._pool is None:
                n = max(1, min(16, os.cpu_count() or 1))
                self._pool = ThreadPoolExecutor(n, thread_name_prefix="tidal-populate")
            return self._pool

    def readonly(self, path: str, nbytes: int) -> Mapping:
        """The segment mapped read-only, for zero-copy views."""
        open_ = lambda: _open(path, lambda: map_segment(path, nbytes, writable=False))  # noqa: E731
        return self._cached(self._ro, path, open_, lambda *_: None)

    def _insert(self, path: str, seg: torch.Tensor) -> torch.Tensor:
        with self._lock:
            hit = self._rw.get(path)
            if hit is not None:  # another thread mapped it meanwhile
                return hit
            self._rw[path] = seg
            self._misses += 1
            if self._misses >= _SWEEP_EVERY:
                self._sweep()
            while len(self._rw) > _LIMIT:
                self._unpin(*self._rw.popitem(last=False))
        return seg

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
        asynchronous. A slot of several part files is one range of several mappings, which
        one registration covers. Fallback: where registration fails, copies stay pageable."""
        with self._lock:
            ok = self._pinned.get(path)
            if ok is None and seg.numel():
                rc = torch.cuda.cudart().cudaHostRegister(seg.data_ptr(), seg.numel(), 1)
                ok = self._pinned[path] = int(rc) == 0
        return bool(ok)

    def pinned(self) -> int:
        """How many mappings are registered with CUDA."""
        with self._lock:
            return sum(self._pinned.values())

    def _unpin(self, path: str, seg: torch.Tensor) -> None:
        self._typed.pop(path, None)  # every read-write mapping that goes passes here
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
            self._typed.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
