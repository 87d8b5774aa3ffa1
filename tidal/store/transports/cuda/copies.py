"""Device-to-device copies of whole state dicts, planned once and replayed.

A put or get of GPU memory (tidal/store/transports/cuda/ipc.py) copies every tensor of a
state dict between the caller's tensors and the stored slots. Deciding how to copy each pair
(same device, same dtype, both contiguous: one raw ``cudaMemcpyAsync``; else ``copy_``) costs
several microseconds of Python a tensor, as long as the copy of a small tensor itself. A
steady writer or reader copies the same tensors to and from the same slots every time, so the
decision is a :class:`CopyPlan`, kept by :class:`CopyPlans` under a key naming the slots and
the caller's memory, and replayed: a put of 114 tensors then costs one ctypes call a tensor.

Lifecycle: each CudaIpcTransport (one per store handle) owns two caches, for its writes and
its reads, used from the thread running the put or get. Slot ids are never reused for other
memory (tidal/store/records.py), so a plan keyed by slot ids stays right while its slots
exist; the transport clears its read plans when it closes a dead writer's slots.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Copier(Protocol):
    """Issues raw device copies on a stream (tidal/store/transports/cuda/batch.py): ``prepare``
    once per plan and device, ``run`` at every replay."""

    @property
    def batching(self) -> bool: ...  # whose calls refuse the legacy default stream
    def prepare(self, pairs: list[tuple[int, int, int]], device: int) -> Any: ...
    def run(self, prepared: Any, stream: int) -> None: ...


_sides: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream of ``device`` for batched copies asked for on its legacy default stream."""
    side = _sides.get(device)
    if side is None:
        side = _sides.setdefault(device, torch.cuda.Stream(device))
    return side


@dataclass(slots=True)
class CopyPlan:
    """How to copy ``srcs[i]`` into ``dsts[i]`` for every i: raw copies by device for
    contiguous pairs of one dtype on one device, ``copy_`` for the others.

    The raw copies of a device go as one batched driver call where the driver has it, else
    one ``cudaMemcpyAsync`` each through ctypes (measured on the H200: 8.8 us of host time
    a call); a torch ``copy_`` costs more. On the H200, for a 3 GB state dict of 114 tensors,
    ``_foreach_copy_`` took 2.14 ms, a loop of ``copy_`` 1.77 ms, and a single flat copy of
    the same bytes about 1.45 ms.
    """

    fast: dict[torch.device, list[tuple[int, int, int]]]  # device -> (dst, src, nbytes)
    fast_pairs: list[int]  # the pairs copied raw (their memory is checked on reuse)
    slow: list[int]  # the pairs copied with copy_
    devices: set[torch.device]  # every CUDA device a copy runs on
    prepared: dict[torch.device, Any] = field(default_factory=dict)  # Copier.prepare's

    @classmethod
    def of(cls, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> CopyPlan:
        fast: dict[torch.device, list[tuple[int, int, int]]] = {}
        fast_pairs, slow = [], []
        devices: set[torch.device] = set()
        for i, (d, s) in enumerate(zip(dsts, srcs, strict=True)):
            for t in (d, s):
                if t.is_cuda:
                    devices.add(t.device)
            if (
                d.is_cuda
                and d.device == s.device
                and d.dtype == s.dtype
                and d.shape == s.shape
                and d.is_contiguous()
                and s.is_contiguous()
            ):
                fast.setdefault(d.device, []).append(
                    (d.data_ptr(), s.data_ptr(), d.numel() * d.element_size())
                )
                fast_pairs.append(i)
            else:
                slow.append(i)
        return cls(fast, fast_pairs, slow, devices)

    def still_fits(self, tensors: list[torch.Tensor]) -> bool:
        """Whether the caller's ``tensors`` (the side not in the store: same addresses, as
        the key says) are still contiguous where the plan copies raw bytes."""
        return all(tensors[i].is_contiguous() for i in self.fast_pairs)

    def run(
        self,
        dst_of: Callable[[int], torch.Tensor],
        src_of: Callable[[int], torch.Tensor],
        copier: Copier,
    ) -> None:
        """Issue the copies, asynchronous on each device's current stream."""
        for i in self.slow:
            dst = dst_of(i)
            dst.copy_(src_of(i), non_blocking=dst.is_cuda)
        for device, pairs in self.fast.items():  # each device's copies from its own context
            with torch.cuda.device(device):
                prepared = self.prepared.get(device)
                if prepared is None:
                    prepared = self.prepared[device] = copier.prepare(pairs, device.index)
                stream = torch.cuda.current_stream(device)
                if stream.cuda_stream or not copier.batching:
                    copier.run(prepared, stream.cuda_stream)
                    continue
                # The batched call refuses the legacy default stream: run it on a side
                # stream that starts after the work queued so far and that the caller's
                # later work (and a synchronize of the default stream) waits for.
                side = _side_stream(device)
                side.wait_stream(stream)
                copier.run(prepared, side.cuda_stream)
                stream.wait_stream(side)


class CopyPlans:
    """A few CopyPlans by key, least recently used first out (a writer alternates between
    the two or three slot sets its key's retention keeps)."""

    def __init__(self, limit: int = 16) -> None:
        self._plans: OrderedDict[Hashable, CopyPlan] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()
        self.built = 0  # plans made (diagnostics: a steady writer or reader makes none)

    def get(
        self, key: Hashable, callers: list[torch.Tensor], build: Callable[[], CopyPlan]
    ) -> CopyPlan:
        """The plan under ``key``, or ``build()``'s (kept). ``callers``: the caller's side of
        each pair, checked against a kept plan."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
        if plan is not None and plan.still_fits(callers):
            return plan
        plan = build()
        with self._lock:
            self.built += 1
            self._plans[key] = plan
            while len(self._plans) > self._limit:
                self._plans.popitem(last=False)
        return plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
