"""Side CUDA streams for the store's non-blocking calls.

``put_async`` / ``get_async`` (and their state-dict forms) on CUDA tensors copy on a side
stream of the store, not on the caller's stream, so the copies overlap the caller's next
kernels (a trainer's next forward and backward) instead of queueing between them.
benchmarks/store_overlap.py measures the step time with and without it.

Ordering: at the call, an event is recorded on the caller's current stream of every device
involved; the side stream waits for it before its first copy, so the copies see every write
the caller queued before the call (an optimizer step, say). The tensors are marked as used by
the side stream (``record_stream``), so the caching allocator does not hand their memory to
someone else while the copies run. As with every non-blocking call, the caller must not
modify the sources (or read the destinations) until the future is done; it is done once the
copies have finished on the device, not only been queued.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from tidal.store import boxes

T = TypeVar("T")


def cuda_tensors(obj: Any) -> list[torch.Tensor]:
    """The local CUDA tensors of a tensor, DTensor or nested state dict. Input the call
    itself will refuse yields none here: the call reports it."""
    try:
        items: list[tuple[boxes.Path, Any]] = (
            boxes.flatten(obj) if isinstance(obj, Mapping) else [((), obj)]
        )
        locals_ = [boxes.window(t)[3] for _, t in boxes.tensors_of(items)]
    except (TypeError, ValueError):
        return []
    return [t for t in locals_ if t.is_cuda]


class SideStreams:
    """One side stream per CUDA device, created on first use."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = torch.cuda.Stream(device)
            return s

    def wrap(self, fn: Callable[[], T], tensors: list[torch.Tensor]) -> Callable[[], T]:
        """``fn`` to run in another thread with its copies on the side streams of the devices
        of ``tensors``, ordered after the caller's work queued so far (call this in the
        caller's thread). Without CUDA tensors, ``fn`` itself."""
        devices = list(dict.fromkeys(t.device for t in tensors))
        if not devices:
            return fn
        ready = {}
        for d in devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(d))
            ready[d] = ev

        def run() -> T:
            with contextlib.ExitStack() as stack:
                for d in devices:
                    side = self._stream(d)
                    stack.enter_context(torch.cuda.stream(side))
                    side.wait_event(ready[d])
                    for t in tensors:
                        if t.device == d:
                            t.record_stream(side)
                out = fn()
                # A put of GPU memory returns once its copies are queued (they are ordered
                # before this stream's later work): the future is done when they are.
                for d in devices:
                    self._stream(d).synchronize()
                return out

        return run
