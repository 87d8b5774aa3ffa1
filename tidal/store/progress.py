"""A writer's progress reports, for readers that stream a version while it is written.

A put reports the slots it has filled every ``PROGRESS_BYTES``, or every eighth of its bytes
if that is more (one round trip each: a 3 GB put of GPU memory takes about 2 ms, and 47
reports of 64 MB made its streamed sync 10x slower). Copies from or to CUDA memory are
asynchronous: their chunk is reported once an event recorded after its copies has completed,
keeping one chunk in flight so the copy engines never wait for the report.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PROGRESS_BYTES = 64 << 20
MAX_REPORTS = 8  # a put reports at most this often (each report is a round trip)


class Progress:
    """Collects written slots; ``report(slots)`` tells the controller about them."""

    def __init__(
        self, report: Callable[[list[int]], None] | None, every: int | None = None
    ) -> None:
        """``report=None``: nobody streams this version; only the devices are tracked."""
        self._report = report
        self._every = PROGRESS_BYTES if every is None else every
        self._slots: list[int] = []
        self._bytes = 0
        self._devices: set[torch.device] = set()
        self._inflight: tuple[list[torch.cuda.Event], list[int]] | None = None
        self.devices: set[torch.device] = set()  # every CUDA device a copy ran on

    @property
    def reporting(self) -> bool:
        """Whether a streaming reader waits for these reports."""
        return self._report is not None

    def add(self, slot: int, nbytes: int, device: torch.device | None = None) -> None:
        """Slot ``slot`` was copied (on ``device``'s current stream when a CUDA device)."""
        if device is not None and device.type == "cuda":
            self.devices.add(device)
        if self._report is None:
            return
        self._slots.append(slot)
        self._bytes += nbytes
        if device is not None and device.type == "cuda":
            self._devices.add(device)
        if self._bytes >= self._every:
            self._flush()

    def _flush(self) -> None:
        assert self._report is not None, "only a reporting Progress flushes"
        slots, devices = self._slots, self._devices
        self._slots, self._bytes, self._devices = [], 0, set()
        if not devices:
            self._report(slots)
            return
        events = []
        for d in devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(d))
            events.append(ev)
        prev, self._inflight = self._inflight, (events, slots)
        if prev is not None:
            for ev in prev[0]:
                ev.synchronize()
            self._report(prev[1])

    def synchronize(self) -> None:
        """Wait for every device copy, on the streams they ran on (the slots left unreported
        are covered by the commit)."""
        for d in self.devices:
            torch.cuda.current_stream(d).synchronize()
