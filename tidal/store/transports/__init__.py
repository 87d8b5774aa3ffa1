"""How shard bytes move between a client's tensors and a volume: one module per transport.

Every transport implements :class:`Transport`. A client (tidal/store/session.py) picks one
per volume, the fastest both sides support:

- ``shm`` (tidal/store/transports/shm.py): the volume's shared-memory segments, mapped into
  this process when the volume is on this host. One copy each way, no system call per byte.
- ``cuda_ipc`` (tidal/store/transports/cuda/ipc.py): a writer's own GPU memory
  (``put(..., memory="cuda")``), opened by readers on the same host with CUDA IPC handles
  and copied device to device. Its helpers sit beside it in ``cuda/``: ``runtime`` (the CUDA
  runtime calls through ctypes), ``memory`` (a writer's device volume and a reader's opened
  ones), ``copies`` (copy plans kept per layout), ``gather`` (one Triton kernel for a state
  dict's copies) and ``batch`` (the driver's batched copy, without Triton).
- ``tcp`` (tidal/store/transports/tcp.py): ``vol_write`` / ``vol_read`` messages to the
  volume's data port, several connections in parallel, bytes received straight into the
  destination. Works between any two hosts.

An RDMA transport (GPU-direct reads between hosts) would be a fourth module here: a class
with the same two methods, registering its memory (pinned host or GPU slots) with the NIC
when the volume creates a slot and reading remote slots by their keys, with the volume's
address and keys published through the controller's volume record (tidal/store/ops.py
``s_volume``), and ``Session.transport_for`` choosing it when both sides have the library.
It is not written: no transfer library is installed on the machines tidal is tested on.

Lifecycle: a store handle makes its transports when it is created (CUDA IPC on its first use)
and closes them in ``Store.close()``; every method is called from the thread running a put or
a get of that handle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tidal.store.progress import Progress

Dims = tuple[int, ...]
Gate = Callable[[int], None]  # streaming reads: returns once the slot's bytes are in place


@dataclass(slots=True)
class WriteJob:
    """Copy ``src`` (a local shard) into ``slot``, stored as ``dtype`` (a cast if it
    differs). ``fresh``: the slot was just created and was never written."""

    slot: int
    src: torch.Tensor
    dtype: torch.dtype
    fresh: bool = False
    nbytes: int = -1  # derived below when not given

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            self.nbytes = self.src.numel() * self.dtype.itemsize


@dataclass(slots=True)
class ReadJob:
    """Copy the sub-box ``src_off``/``sizes`` of the shard in ``slot`` (of ``shard_shape``,
    stored as ``dtype``) into ``dst``, a view of the destination of exactly that size.
    ``whole``: the box is the whole shard (no narrowing)."""

    slot: int
    shard_shape: Dims
    dtype: torch.dtype
    src_off: Dims
    sizes: Dims
    dst: torch.Tensor
    whole: bool = False

    @property
    def shard_nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shard_shape:
            n *= s
        return n


class Transport(Protocol):
    """Moves bytes of one kind of volume (``vol`` is the controller's record of it,
    tidal/store/ops.py ``s_volume``)."""

    def write(
        self, vol: dict[str, Any], jobs: list[WriteJob], progress: Progress, grant: bytes
    ) -> None:
        """Copy every job's bytes into its slot; report each slot to ``progress``. On
        return the bytes are in place (device copies synchronized)."""
        ...

    def read(self, vol: dict[str, Any], jobs: list[ReadJob], gate: Gate | None) -> None:
        """Copy every job into its destination (after ``gate(slot)`` when streaming); on
        return the copies are done."""
        ...

    def close(self) -> None: ...
