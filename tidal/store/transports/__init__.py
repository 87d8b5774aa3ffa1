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

- ``nixl`` (tidal/store/transports/nixl.py, the extra ``tidal[nixl]``): one-sided READs of a
  volume's slots through NIXL/UCX (RDMA between hosts), straight into the destination; a
  volume registers its slots with its agent once, a reader learns each slot once through
  ``vol_nixl`` on the volume's data port. Used for volumes on other hosts where the machine
  has an RDMA device, or everywhere with ``transport="nixl"``.

Lifecycle: a store handle makes its transports when it is created (CUDA IPC on its first use)
and closes them in ``Store.close()``; every method is called from the thread running a put or
a get of that handle.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tidal.store import progress as progress_
from tidal.store.ops import VolumeInfo
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


class Transport(abc.ABC):
    """Moves bytes of one kind of volume (``vol`` is the controller's record of it,
    tidal/store/ops.py ``s_volume``).

    Put lifecycle, in the thread running the put (tidal/store/writer.py ``Writer._write``):

    1. ``prepare_write(jobs)`` before any byte of ``jobs`` is written or its slots are
       announced: with a reservation, before ``put_begin`` goes out; then for the slots its
       reply adds. Default: nothing (a volume's slots exist once the controller made them).
    2. With a reservation, ``split_early(jobs)`` picks the copies to start before the
       ``put_begin`` reply arrives; the rest wait for it (it says whether a reader streams
       the version, and then they are reported as they land). Default: the first
       ``PROGRESS_BYTES``.
    3. ``write`` the copies.
    4. ``slots_freed(slots)`` with the slots of this transport's memory that the controller
       destroyed (the ``freed`` of ``put_begin`` and ``put_commit`` replies). Default:
       nothing (a volume frees its own segments).

    Get lifecycle: ``read``, in the thread running the get. ``close`` when the store handle
    closes. A new transport implements ``write``, ``read`` and ``close`` (abstract: a class
    without them cannot be made) and overrides a hook only where its memory needs one; the
    put path has no branch per transport.
    """

    def prepare_write(self, jobs: list[WriteJob]) -> None:  # noqa: B027 - a hook, no-op here
        """Make the slots of ``jobs`` ready to be written and opened by readers."""

    def split_early(self, jobs: list[WriteJob]) -> tuple[list[WriteJob], list[WriteJob]]:
        """The jobs to copy before ``put_begin``'s reply, and the rest."""
        return split_jobs(jobs, progress_.PROGRESS_BYTES)  # read per put: tests lower it

    def slots_freed(self, slots: list[int]) -> None:  # noqa: B027 - a hook, no-op here
        """The controller destroyed ``slots`` of this transport's memory."""

    @abc.abstractmethod
    def write(
        self, vol: VolumeInfo, jobs: list[WriteJob], progress: Progress, grant: bytes
    ) -> None:
        """Copy every job's bytes into its slot; report each slot to ``progress``. On
        return the bytes are in place (device copies synchronized)."""

    @abc.abstractmethod
    def read(self, vol: VolumeInfo, jobs: list[ReadJob], gate: Gate | None) -> None:
        """Copy every job into its destination (after ``gate(slot)`` when streaming); on
        return the copies are done."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the transport holds (connections, mappings, device memory); called
        once, when the store handle closes."""


def split_jobs(jobs: list[WriteJob], nbytes: int) -> tuple[list[WriteJob], list[WriteJob]]:
    """The first jobs holding about ``nbytes`` (at least one), and the rest."""
    total = 0
    for i, job in enumerate(jobs):
        total += job.nbytes
        if total >= nbytes:
            return jobs[: i + 1], jobs[i + 1 :]
    return jobs, []
