"""One driver call for a state dict's device copies: ``cuMemcpyBatchAsync``.

A put or get of GPU memory copies every tensor of a state dict (tidal/store/transports/
copies.py). Issued one ``cudaMemcpyAsync`` at a time, the launches cost about 8.8 us of
host time each on the H200 (1 ms for 114 tensors, as long as the copies of a small model
themselves). CUDA 12.8 added a batched copy: one call, an array of (dst, src, size), copies
in stream order with no order among themselves. :class:`BatchCopier` builds the arrays once
per copy plan and issues the batch; where the driver lacks the call, or a batch fails, it
copies one pair at a time instead (``Loop``), and says so once.

The driver API is used (``libcuda``, loaded by torch) rather than the runtime's, because its
symbols name their argument lists: ``cuMemcpyBatchAsync_v2`` (CUDA 13 drivers) takes no
failure index, ``cuMemcpyBatchAsync`` (12.8 and later) does; the runtime's one name changed
its arguments between 12.8 and 13.0. Device pointers and stream handles are the same values
in both APIs, and the runtime makes the device's primary context current
(``torch.cuda.device``) before a call.

The call refuses the legacy default stream (handle 0: torch's default stream) with
``CUDA_ERROR_INVALID_VALUE``, so callers on that stream issue the batch on a side stream
ordered after and before it (:class:`~tidal.store.transports.cuda.copies.CopyPlan`); the
first H200 run, which passed stream 0, fell back to the loop with that error.
tests/store/test_gpu.py checks the bytes against the one-at-a-time copies and that the batch
was the path taken.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Callable
from typing import Any

Pairs = list[tuple[int, int, int]]  # (dst, src, nbytes) device pointers
Loop = Callable[[Pairs, int], None]  # one copy call per pair on a stream

_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_MEM_LOCATION_TYPE_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):  # CUmemcpyAttributes (v1)
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _Location),
        ("dstLocHint", _Location),
        ("flags", ctypes.c_uint),
    ]


class Batch:
    """The argument arrays of one batched copy (kept with its copy plan: made once)."""

    def __init__(self, pairs: Pairs, device: int) -> None:
        n = len(pairs)
        self.pairs = pairs
        self.count = n
        self.dsts = (ctypes.c_uint64 * n)(*(d for d, _, _ in pairs))
        self.srcs = (ctypes.c_uint64 * n)(*(s for _, s, _ in pairs))
        self.sizes = (ctypes.c_size_t * n)(*(k for _, _, k in pairs))
        where = _Location(_MEM_LOCATION_TYPE_DEVICE, device)
        self.attrs = (_Attributes * 1)(_Attributes(_SRC_ACCESS_ORDER_STREAM, where, where, 0))
        self.attr_idxs = (ctypes.c_size_t * 1)(0)  # one attribute for every copy
        self.fail = ctypes.c_size_t(0)


class BatchCopier:
    """Issues a plan's copies on a stream: one batched driver call where the driver has it,
    else ``loop`` (one call a pair)."""

    def __init__(
        self, driver_path: str | None, loop: Loop, call: Callable[[Batch, int], int] | None = None
    ) -> None:
        """``call``: the batched copy (returns a CUresult) when not the driver's from
        ``driver_path``; tests pass a stand-in to steer the fallback."""
        self._loop = loop
        self._call = call
        if call is None and driver_path is not None:
            self._call = _batch_call(ctypes.CDLL(driver_path))
        self.supported = self._call is not None  # the driver has the call
        self.batches = 0  # batched calls made (tidal.store.testing, the GPU tests)

    @property
    def batching(self) -> bool:
        """Whether copies go batched: the driver has the call and no batch has failed."""
        return self._call is not None

    def prepare(self, pairs: Pairs, device: int) -> Batch | Pairs:
        """What ``run`` takes for these pairs: their arrays when batching pays (2 or more)."""
        return Batch(pairs, device) if self._call is not None and len(pairs) > 1 else pairs

    def run(self, prepared: Batch | Pairs, stream: int) -> None:
        if not isinstance(prepared, Batch):
            self._loop(prepared, stream)
            return
        call = self._call
        if call is None:  # prepared before a batch failed
            self._loop(prepared.pairs, stream)
            return
        if stream == 0:
            raise ValueError("cuMemcpyBatchAsync refuses the legacy default stream")
        rc = call(prepared, stream)
        if rc == 0:
            self.batches += 1
            return
        # A documented fallback: copy one pair at a time from now on (each copy rewrites the
        # same bytes, so what the failed batch may have done is harmless).
        self._call = None
        warnings.warn(
            f"tidal.store: cuMemcpyBatchAsync failed (CUresult {rc}); copying one tensor at a "
            "time from now on",
            RuntimeWarning,
            stacklevel=2,
        )
        self._loop(prepared.pairs, stream)


def _batch_call(lib: ctypes.CDLL) -> Callable[[Batch, int], int] | None:
    """The driver's batched copy as f(batch, stream) -> CUresult, or None without one."""
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    common = [vp, vp, vp, sz, vp, vp, sz]  # dsts, srcs, sizes, count, attrs, attrIdxs, numAttrs
    f: Any = getattr(lib, "cuMemcpyBatchAsync_v2", None)
    if f is not None:  # CUDA 13 drivers: no failure index
        f.restype, f.argtypes = ctypes.c_int, [*common, vp]

        def v2(b: Batch, stream: int) -> int:
            return int(f(b.dsts, b.srcs, b.sizes, b.count, b.attrs, b.attr_idxs, 1, stream))

        return v2
    f = getattr(lib, "cuMemcpyBatchAsync", None)
    if f is not None:  # CUDA 12.8 and later: a failure index before the stream
        f.restype, f.argtypes = ctypes.c_int, [*common, ctypes.POINTER(sz), vp]

        def v1(b: Batch, stream: int) -> int:
            return int(
                f(
                    b.dsts,
                    b.srcs,
                    b.sizes,
                    b.count,
                    b.attrs,
                    b.attr_idxs,
                    1,
                    ctypes.byref(b.fail),
                    stream,
                )
            )

        return v1
    return None
