"""One kernel for a state dict's device copies: a Triton gather over a table of chunks.

A put or get of GPU memory copies every tensor of a state dict (tidal/store/transports/
copies.py). On the H200 the host cost of issuing those copies is the largest term left
of a ``memory="cuda"`` sync: 114 ``cudaMemcpyAsync`` calls took 0.85 ms of host time, and
one ``cuMemcpyBatchAsync`` of the same copies still 0.6 ms (the driver checks every pointer
of the batch). This module issues them as one kernel launch: the copies are cut into chunks
of up to ``CHUNK_BYTES`` and listed, once per copy plan, in a table on the device, each row
``(dst address, src address, 4-byte words)``; program ``p`` of the kernel copies row ``p``.

Only pairs whose addresses and sizes are multiples of 4 bytes go through the kernel (every
tensor the caching allocator or ``cudaMalloc`` hands out is; a slice may not be); the others
go to the batched or one-by-one copies (:class:`~tidal.store.transports.cuda.batch.
BatchCopier`), which is also the whole path when Triton is not installed or the kernel
fails to build (said once, in a warning).

Lifecycle: one :class:`GatherCopier` per process (``ipc.copier()``); ``prepare`` runs
once per copy plan and device (it builds the table: one small host-to-device copy), ``run``
at every put or get, from the thread doing it. The first ``prepare`` starts compiling the
kernel in a thread of its own (0.7 s on the H200 host; Triton caches it on disk): until it is
built, copies go through the batch copier, so a first put does not wait for a compiler. A
process that ends while the kernel builds waits for the build at exit.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from tidal.store.transports.cuda.batch import BatchCopier, Pairs

CHUNK_BYTES = 1 << 20  # bytes a kernel program copies (one table row)
_WORDS = CHUNK_BYTES // 4
_BLOCK = 4096  # words a program moves per loop iteration


def _kernel() -> Any:
    """The Triton kernel (built on first use, so importing this module needs no Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gather_copy(table, WORDS: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
        row = table + tl.program_id(0).to(tl.int64) * 3
        dst = tl.load(row).to(tl.pointer_type(tl.int32))
        src = tl.load(row + 1).to(tl.pointer_type(tl.int32))
        n = tl.load(row + 2)
        for start in range(0, WORDS, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            keep = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=keep), mask=keep)

    return gather_copy


@dataclass(slots=True)
class Gather:
    """A plan's copies for one device: the kernel's table, and the pairs it cannot take."""

    table: torch.Tensor  # int64 [rows, 3] on the device
    rows: int
    rest: Any  # BatchCopier.prepare's, for the unaligned pairs (None without any)
    pairs: Pairs  # every pair (the fallback copies them all)
    whole: list[Any] = field(default_factory=list)  # BatchCopier.prepare's of every pair


def word_aligned(pair: tuple[int, int, int]) -> bool:
    """Whether a (dst, src, bytes) copy can go through the kernel: all multiples of 4."""
    return pair[0] % 4 == 0 and pair[1] % 4 == 0 and pair[2] % 4 == 0


def chunk_rows(pairs: Pairs) -> list[tuple[int, int, int]]:
    """The kernel's table: each (dst, src, bytes) copy cut into rows of at most
    ``CHUNK_BYTES``, each ``(dst address, src address, 4-byte words)``."""
    out = []
    for dst, src, n in pairs:
        for off in range(0, n, CHUNK_BYTES):
            out.append((dst + off, src + off, min(CHUNK_BYTES, n - off) // 4))
    return out


class GatherCopier:
    """Issues a plan's copies as one gather kernel (plus the batch copier's for pairs the
    kernel does not take); falls back to the batch copier for good if the kernel fails."""

    def __init__(self, fallback: BatchCopier) -> None:
        self.fallback = fallback
        self._kernel: Any = None  # set by the build thread once compiled
        self._build: threading.Thread | None = None
        self._lock = threading.Lock()
        self.failed = False
        self.launches = 0  # kernel launches (tidal.store.testing, the GPU tests)

    @property
    def batching(self) -> bool:
        """Whether ``run`` may issue a driver batch (which refuses the legacy stream)."""
        return self.fallback.batching

    def ready(self, timeout: float | None = None) -> bool:
        """Whether the kernel is built (waiting up to ``timeout`` seconds for its build)."""
        if self._build is not None:
            self._build.join(timeout)
        return self._kernel is not None

    def build(self, device: int) -> None:
        """Start building the kernel (once per process), in a thread of its own."""
        with self._lock:
            if self._build is not None or self.failed:
                return
            # Not a daemon: a process ending while Triton compiles in a daemon thread dies of
            # SIGABRT ("terminate called without an active exception": the compiler's C++
            # threads are torn down under it). Seen on the H200 with a cold Triton cache, in a
            # reader process that lived 6 s; the interpreter now waits for the build at exit.
            self._build = threading.Thread(
                target=self._compile, args=(device,), name="tidal-gather-build"
            )
            self._build.start()

    def prepare(self, pairs: Pairs, device: int) -> Gather | Any:
        if self.failed or len(pairs) < 2:
            return self.fallback.prepare(pairs, device)
        fits = [p for p in pairs if word_aligned(p)]
        others = [p for p in pairs if not word_aligned(p)]
        if not fits:
            return self.fallback.prepare(pairs, device)
        self.build(device)
        rows = chunk_rows(fits)
        table = torch.tensor(rows, dtype=torch.int64).to(f"cuda:{device}")
        rest = self.fallback.prepare(others, device) if others else None
        return Gather(table, len(rows), rest, pairs)

    def run(self, prepared: Gather | Any, stream: int) -> None:
        if not isinstance(prepared, Gather):
            self.fallback.run(prepared, stream)
            return
        if self._kernel is None:  # building, or failed: the driver copies every pair
            if not prepared.whole:
                prepared.whole.append(
                    self.fallback.prepare(prepared.pairs, prepared.table.device.index)
                )
            self.fallback.run(prepared.whole[0], stream)
            return
        if prepared.rest is not None:
            self.fallback.run(prepared.rest, stream)
        device = prepared.table.device
        if torch.cuda.current_stream(device).cuda_stream == stream:
            self._launch(prepared)
        else:
            with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)):
                self._launch(prepared)

    def _launch(self, prepared: Gather) -> None:
        self._kernel[(prepared.rows,)](prepared.table, WORDS=_WORDS, BLOCK=_BLOCK)
        self.launches += 1

    def _compile(self, device: int) -> None:
        """Build the kernel by running it once on a small copy, on a stream of its own."""
        try:
            kernel = _kernel()
            with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
                src = torch.arange(1024, dtype=torch.int32, device=f"cuda:{device}")
                dst = torch.zeros_like(src)
                table = torch.tensor(
                    [[dst.data_ptr(), src.data_ptr(), 1024]] * 2,
                    dtype=torch.int64,
                    device=f"cuda:{device}",
                )
                kernel[(1,)](table, WORDS=_WORDS, BLOCK=_BLOCK)
                torch.cuda.current_stream().synchronize()
                if not torch.equal(dst, src):
                    raise RuntimeError("the kernel's test copy came back wrong")
            self._kernel = kernel
        except Exception as e:  # no Triton, or a kernel this GPU or compiler refuses
            self.failed = True
            warnings.warn(
                f"tidal.store: the gather-copy kernel is unavailable ({type(e).__name__}: "
                f"{e}); copying through the driver instead",
                RuntimeWarning,
                stacklevel=1,
            )
