"""Host copies of a state dict for background saves.

Two ways, one per `checkpoint.async_mode`:

- `copy_to_host` ("async"): a fresh pageable copy of every tensor, made in the calling
  thread; the step waits for the whole device-to-host copy (and the allocation).
- `PinnedStaging` ("async_with_pinned_mem"): host buffers allocated once (pinned on CUDA) and
  reused by every later save; with `shared=True` they all lie in one shared-memory segment
  (tidal/train/checkpoint/writer_process.py, page-locked on CUDA) that the writer process
  reads. `stage()` only queues the copies: on CUDA on a side stream that
  first waits for the work already queued on the compute stream (so it copies the weights the
  last optimizer step wrote), on CPU for the writer thread to run. The training step continues;
  `wait_before_update()` must run before the next in-place update of the weights (the optimizer
  step): on CUDA it makes the compute stream wait for the copy's event (the host does not
  block), on CPU it waits for the writer thread's copy. `wait_copied()` (writer thread) blocks
  until the buffers hold the copy.

Lifecycle: the Checkpointer (main thread) owns one PinnedStaging and calls `stage()` in a
save, `wait_before_update()` before every optimizer step; its writer thread calls
`run_host_copy()` (CPU) or `wait_copied()` (CUDA) and then reads the buffers. One save at a
time: the Checkpointer waits for the previous save before staging the next.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.distributed._state_dict_utils import _create_cpu_state_dict
from torch.distributed.tensor import DTensor

from tidal.train.checkpoint.writer_process import SharedSegment


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _host_buffer(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    """An uninitialized host tensor shaped like `t` (a DTensor: a DTensor of the same layout
    whose local shard is on the host), pinned when asked."""
    if isinstance(t, DTensor):
        # torch's own staging helper: it builds the host DTensor (`.to("cpu")`, once) and
        # swaps in a pinned local shard.
        host = _create_cpu_state_dict({"t": t}, pin_memory=pinned)["t"]
        if host is t:  # a 0-dim DTensor is returned as is; copy it unpinned
            host = t.detach().to("cpu", copy=True)
        return host
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)


def _shared_buffers(
    tensors: dict[str, torch.Tensor], pin: bool
) -> tuple[SharedSegment, dict[str, torch.Tensor]]:
    """Host buffers shaped like `tensors`, all in one new shared segment (a DTensor gets a
    host DTensor of the same layout whose local shard lies in the segment)."""
    locals_ = [_local(t) for t in tensors.values()]
    offsets, nbytes = SharedSegment.layout(locals_)
    segment = SharedSegment(nbytes, pin=pin)
    buffers: dict[str, torch.Tensor] = {}
    for (k, t), local, offset in zip(tensors.items(), locals_, offsets, strict=True):
        view = segment.view(offset, local)
        if isinstance(t, DTensor):
            host = t.detach().to("cpu")  # torch's own staging makes host DTensors this way
            assert isinstance(host, DTensor)
            host._local_tensor = view
            buffers[k] = host
        else:
            buffers[k] = view
    return segment, buffers


def _copy_into(
    buffers: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], *, non_blocking: bool
) -> None:
    for k, src in tensors.items():
        _local(buffers[k]).copy_(_local(src).detach(), non_blocking=non_blocking)


def _tensors(flat: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def copy_to_host(flat: dict[str, Any]) -> dict[str, Any]:
    """`flat` with every tensor (or DTensor's local shard) copied to fresh CPU memory."""
    out = dict(flat)
    for k, v in _tensors(flat).items():
        out[k] = v.detach().to("cpu", copy=True)
    return out


def _signature(tensors: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], Any]]:
    return [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]


class PinnedStaging:
    """Reusable host buffers for a state dict (see the module docstring)."""

    def __init__(self, device: torch.device, *, shared: bool = False):
        self.cuda = device.type == "cuda"
        self.device = device
        self.shared = shared
        self.segment: SharedSegment | None = None
        self._buffers: dict[str, torch.Tensor] | None = None
        self._signature: list | None = None
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._event: torch.cuda.Event | None = None
        self._sources: dict[str, torch.Tensor] | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._update_waits = False
        self.bytes = 0

    def stage(self, flat: dict[str, Any]) -> dict[str, Any]:
        """Queue the copy of `flat`'s tensors into the buffers; returns `flat` with the
        buffers in place of the tensors (valid once `wait_copied()` returns)."""
        tensors = _tensors(flat)
        signature = _signature(tensors)
        if self._buffers is None or signature != self._signature:
            # Allocated (and pinned) once, reused by every later save of the same state.
            self._buffers = None
            self.close()
            if self.shared:
                self.segment, self._buffers = _shared_buffers(tensors, self.cuda)
            else:
                self._buffers = {k: _host_buffer(v, self.cuda) for k, v in tensors.items()}
            self._signature = signature
            self.bytes = sum(_local(v).numel() * v.element_size() for v in tensors.values())
        self._copied.clear()
        self._sources = tensors  # alive until copied: the side stream reads them
        if self.cuda:
            assert self._stream is not None
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                _copy_into(self._buffers, tensors, non_blocking=True)
            self._event = self._stream.record_event()
        self._update_waits = True
        return {**flat, **self._buffers}

    def run_host_copy(self) -> None:
        """Writer thread, CPU tensors: copy into the buffers now."""
        try:
            if not self.cuda and self._sources is not None:
                assert self._buffers is not None
                _copy_into(self._buffers, self._sources, non_blocking=False)
        finally:
            self._done()  # even on failure: the training thread must not wait forever

    def wait_copied(self) -> None:
        """Writer thread: block until the buffers hold the staged values."""
        if self.cuda and self._event is not None:
            self._event.synchronize()
            self._done()
        self._copied.wait()

    def _done(self) -> None:
        self._sources = None
        self._copied.set()

    def wait_before_update(self) -> None:
        """Main thread, before the weights or optimizer state change in place."""
        if not self._update_waits:
            return
        self._update_waits = False
        if self.cuda:
            assert self._event is not None
            torch.cuda.current_stream(self.device).wait_event(self._event)
        else:
            self._copied.wait()

    def close(self) -> None:
        """Release the shared segment (its memory goes once the writer has unmapped it)."""
        segment, self.segment = self.segment, None
        if segment is not None:
            self._buffers = self._signature = None
            segment.close()

    def abandon(self) -> None:
        """Release a staged copy that will not be written (its save failed to start)."""
        self._done()
        self._update_waits = False
