"""Storage volume: owns the memory that holds stored shards.

A volume keeps one CPU shared-memory segment per slot (a file under ``/dev/shm``). Slots are
created once and reused for later versions of the same shard (the controller hands a freed
slot to the next writer of the same key, tensor and size), because the first touch of fresh
shared memory costs page faults: 0.5-0.7 GB/s for a first write against 12 GB/s for a
rewrite on the 2-core development VM (benchmarks/store_sync.py prints the first round and
the steady state). Pages are allocated with ``posix_fallocate`` when a slot is created.
Writers and readers on the volume's host map the segment and copy straight in or out;
remote peers go through
``vol_write`` / ``vol_read`` over TCP, which this class serves from the same memory.

Lifecycle: the process that runs a :class:`~tidal.store.server.Server` with a volume owns it;
``close()`` unlinks every segment. A standalone volume (``python -m tidal.store volume``)
registers with a controller and exits when the controller goes away.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import socket
import threading

import torch

from tidal.store import wire
from tidal.store.errors import StoreError


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def new_store_id() -> str:
    """A store id naming the owning process: ``<pid namespace>.<pid>x<random>``, so segments
    left by a killed process can be recognised and removed (:func:`reap_stale`)."""
    return f"{_pid_namespace()}.{os.getpid()}x{secrets.token_hex(3)}"


def reap_stale(shm_dir: str = "/dev/shm") -> int:
    """Unlink segments of stores whose owning process is gone; returns how many.

    Only segments created in this pid namespace are considered (another container sharing
    ``/dev/shm`` has other pids), and a live or reused pid keeps its segments.
    """
    ns = _pid_namespace()
    n = 0
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return 0
    for name in names:
        m = re.fullmatch(r"tidal-(\d+)\.(\d+)x[0-9a-f]+-.+", name)
        if m is None or ns == 0 or int(m.group(1)) != ns:
            continue
        try:
            os.kill(int(m.group(2)), 0)
            continue  # owner alive (or a reused pid: keep, to be safe)
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            n += 1
        except OSError:
            pass
    return n


def map_segment(path: str, nbytes: int) -> torch.Tensor:
    """Map an existing segment as a flat uint8 tensor sharing its memory."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    size = os.stat(path).st_size
    if size != nbytes:
        raise StoreError(f"segment {path} has {size} bytes, expected {nbytes}")
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def byte_view(t: torch.Tensor, shape: tuple[int, ...], itemsize: int) -> torch.Tensor:
    """View flat uint8 memory as ``shape`` with a trailing dimension of ``itemsize`` bytes."""
    n = itemsize
    for s in shape:
        n *= s
    return t[:n].view(*shape, itemsize)


class Volume:
    """Shared-memory segments indexed by slot id (the controller allocates the ids)."""

    def __init__(
        self,
        volume_id: str,
        store_id: str,
        shm_dir: str = "/dev/shm",
        capacity: int | None = None,
    ) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", volume_id):
            raise ValueError(f"volume id {volume_id!r}: use 1-64 characters [A-Za-z0-9_.-]")
        self.volume_id = volume_id
        self.capacity = capacity
        self.shm_prefix = os.path.join(shm_dir, f"tidal-{store_id}-{volume_id}-")
        self.used = 0
        self._segments: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def path(self, slot: int) -> str:
        return f"{self.shm_prefix}{slot}"

    def create(self, slot: int, nbytes: int) -> None:
        with self._lock:
            if slot in self._segments:
                raise StoreError(f"volume {self.volume_id}: slot {slot} already exists")
            if self.capacity is not None and self.used + nbytes > self.capacity:
                raise StoreError(
                    f"volume {self.volume_id} is full: {self.used} of {self.capacity} bytes "
                    f"used, cannot add {nbytes}; delete keys or lower retention (keep)"
                )
            if nbytes:
                path = self.path(slot)
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.ftruncate(fd, nbytes)
                    # Allocate the pages now: a full tmpfs fails here with a clear error
                    # instead of SIGBUS in a writer, and the first write into the segment
                    # runs at 4.4 GB/s instead of 0.7 GB/s (page faults) on the dev VM.
                    try:
                        os.posix_fallocate(fd, 0, nbytes)
                    except OSError as e:
                        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                            raise
                        # fallback: a file system without fallocate faults pages on write
                except OSError as e:
                    os.close(fd)
                    os.unlink(path)
                    raise StoreError(
                        f"volume {self.volume_id}: cannot allocate {nbytes} bytes in "
                        f"{os.path.dirname(path)}: {e.strerror}"
                    ) from None
                os.close(fd)
            self._segments[slot] = map_segment(self.path(slot), nbytes)
            self.used += nbytes

    def destroy(self, slots: list[int]) -> None:
        with self._lock:
            for slot in slots:
                seg = self._segments.pop(slot, None)
                if seg is None:
                    continue
                self.used -= seg.numel()
                if seg.numel():
                    try:
                        os.unlink(self.path(slot))
                    except FileNotFoundError:
                        pass

    def segment(self, slot: int) -> torch.Tensor:
        try:
            return self._segments[slot]
        except KeyError:
            raise StoreError(f"volume {self.volume_id} has no slot {slot}") from None

    def write_from(self, sock: socket.socket, slot: int, offset: int, nbytes: int) -> None:
        """Receive ``nbytes`` from the socket straight into the slot at ``offset``."""
        seg = self.segment(slot)
        if offset + nbytes > seg.numel():
            wire.discard(sock, nbytes)
            raise ValueError(
                f"write of {nbytes} bytes at offset {offset} exceeds slot {slot} "
                f"of {seg.numel()} bytes"
            )
        if nbytes:
            wire.recv_into(sock, seg[offset : offset + nbytes].numpy().data)

    def read_view(
        self,
        slot: int,
        shape: list[int],
        itemsize: int,
        offsets: list[int],
        sizes: list[int],
    ) -> memoryview:
        """Bytes of a sub-box of the shard stored in ``slot``, contiguous (copied if needed)."""
        seg = self.segment(slot)
        n = itemsize
        for s in shape:
            n *= s
        if n != seg.numel():
            raise ValueError(f"slot {slot} holds {seg.numel()} bytes, shape {shape} needs {n}")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise ValueError(f"box {offsets}/{sizes} does not match shape {shape}")
        for o, s, d in zip(offsets, sizes, shape, strict=True):
            if o + s > d:
                raise ValueError(f"box {offsets}/{sizes} exceeds shape {shape}")
        view = byte_view(seg, tuple(shape), itemsize)
        for d, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
            view = view.narrow(d, o, s)
        if not view.is_contiguous():
            view = view.contiguous()
        return view.reshape(-1).numpy().data

    def close(self) -> None:
        self.destroy(list(self._segments))
