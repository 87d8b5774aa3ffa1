"""The trainer's side of the checkpoint writer process (tidal/train/checkpoint/writer_child.py).

Why: a background save written by a thread of the trainer (DCP's FileSystemWriter: a
`torch.save` per tensor into a Python stream, then fsync) shares the trainer's GIL and its CUDA
context. On the H200 the steps that ran beside the write of an 18 GB pinned save were slowed by
16.4 s in all, 49.9x the 0.33 s device-to-host copy (benchmarks/checkpoint.py, before this
file); on CPU a loop of small ops beside the thread writer waited 0.2-0.4 s per GB for the GIL,
and beside this process about none (benchmarks/checkpoint_stall.py). Here DCP still plans the
save in the trainer (keys, chunks, file names, the collectives, `.metadata`), and only the
bytes of the data files are written by a child process, from staging buffers it shares with
the trainer, in exactly FileSystemWriter's format.

- `SharedSegment`: one anonymous shared-memory file (memfd) holding every staging buffer of a
  state dict, registered with CUDA (page-locked) when the trainer trains on CUDA, so the
  device-to-host copy runs at pinned speed. Nothing to clean up on a crash: the memory goes
  with the last process that maps it.
- `WriterProcess`: the child, started once per trainer rank with the segment's fd (and again
  if it dies, or if the segment changes), stopped by `close()`; it exits on its own when the
  trainer's pipe closes and is killed by the kernel when the trainer dies.
- `ProcessFileSystemWriter`: DCP's FileSystemWriter whose `write_data` hands the writing to
  the child and waits (GIL released) for its reply.

Lifecycle: the Checkpointer (main thread) owns the segment (through PinnedStaging) and one
WriterProcess; `start()` runs on the main thread before a save goes to the background (so the
child's parent-death signal follows the main thread); the save's background thread calls
`dcp.save(storage_writer=ProcessFileSystemWriter(...))`, whose `write_data` calls
`WriterProcess.write`; one save at a time. The child dying mid-save raises CheckpointError
(the save fails, the partial folder stays incomplete); the next save starts a new child.
"""

from __future__ import annotations

import base64
import io
import json
import mmap
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from tidal.train.checkpoint import checksum
from tidal.train.checkpoint.layout import CheckpointError

_CHILD = Path(__file__).with_name("writer_child.py")
_ALIGN = 64  # bytes: every buffer starts aligned for any dtype
ITEM_TIMEOUT_S = 600.0
"""Seconds the trainer waits for the writer to report the next item before it kills the
writer and fails the save (a hung disk must not hang the run)."""


def available() -> bool:
    """A writer process needs memfd (Linux)."""
    return hasattr(os, "memfd_create")


class SharedSegment:
    """One shared-memory file of `nbytes`, mapped here as flat bytes (see the module
    docstring). `view(offset, like)` gives a buffer over part of it."""

    def __init__(self, nbytes: int, *, pin: bool):
        self.nbytes = nbytes
        self.fd = os.memfd_create("tidal-checkpoint-staging", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self._map = mmap.mmap(self.fd, nbytes) if nbytes else None
        self.bytes = (
            torch.frombuffer(self._map, dtype=torch.uint8)
            if self._map is not None
            else torch.empty(0, dtype=torch.uint8)
        )
        self.base = self.bytes.data_ptr()
        self.pinned = False
        if pin and nbytes:
            rc = torch.cuda.cudart().cudaHostRegister(self.base, nbytes, 1)  # portable
            if int(rc) != 0:
                raise CheckpointError(
                    f"checkpoint staging: cudaHostRegister of {nbytes:,} bytes of shared memory "
                    f"failed (error {int(rc)}); use checkpoint.async_mode=async"
                )
            self.pinned = True

    @staticmethod
    def layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
        """Byte offsets for buffers shaped like `tensors` (aligned), and the total size."""
        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        return offsets, end

    def view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        n = like.numel() * like.element_size()
        return self.bytes[offset : offset + n].view(like.dtype).view(like.shape)

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where `t`'s bytes start in the segment, or None if `t` is not a contiguous buffer
        inside it."""
        n = t.numel() * t.element_size()
        if n == 0 and t.device.type == "cpu":
            return 0  # no bytes: the writer makes an empty tensor
        start = t.data_ptr() - self.base
        if t.device.type != "cpu" or not t.is_contiguous() or start < 0 or start + n > self.nbytes:
            return None
        return start

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base)
            self.pinned = False
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class WriterProcess:
    """The writer child of this trainer rank (see the module docstring)."""

    def __init__(self, item_timeout_s: float = ITEM_TIMEOUT_S):
        self.item_timeout_s = item_timeout_s
        self.proc: subprocess.Popen | None = None
        self._segment: SharedSegment | None = None
        self._lock = threading.Lock()

    def start(self, segment: SharedSegment) -> None:
        """Make sure a live child maps `segment` (main thread)."""
        with self._lock:
            if self.proc is not None and self.proc.poll() is None and self._segment is segment:
                return
            self._stop()
            argv = [
                sys.executable,
                "-P",
                str(_CHILD),
                str(os.getpid()),
                str(segment.fd),
                str(segment.nbytes),
            ]
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=(segment.fd,),
                bufsize=0,  # replies are read with os.read after select: nothing buffered
            )
            self._segment = segment

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def write(self, files: list[dict[str, Any]], piece: int | None = None) -> list[list[list[int]]]:
        """Send one write request and wait for its reply (background thread). `piece`: hash
        each file in pieces of that many bytes as it is written (writer_child.py).

        Raises:
            CheckpointError: the child died, stalled past the timeout, or failed to write.
        """
        proc = self.proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise CheckpointError("the checkpoint writer process was not started")
        msg = {"op": "write", "files": files, "piece_bytes": piece}
        request = memoryview((json.dumps(msg) + "\n").encode())
        try:
            while request:
                request = request[os.write(proc.stdin.fileno(), request) :]
        except OSError:  # BrokenPipeError: the child is gone
            raise self._died(proc, files) from None
        pending = b""
        while True:
            line, newline, rest = pending.partition(b"\n")
            if not newline:  # no whole line yet: wait for more (the pipe is unbuffered here)
                ready, _, _ = select.select([proc.stdout], [], [], self.item_timeout_s)
                if not ready:
                    proc.kill()
                    proc.wait()
                    raise CheckpointError(
                        f"the checkpoint writer process (pid {proc.pid}) reported no progress "
                        f"for {self.item_timeout_s:.0f}s writing {_where(files)}; killed it"
                    )
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    raise self._died(proc, files)
                pending += chunk
                continue
            pending = rest
            reply = json.loads(line)
            if "progress" in reply:
                continue
            if not reply.get("ok"):
                raise CheckpointError(
                    f"the checkpoint writer process failed writing {_where(files)}: "
                    f"{reply.get('error')}"
                )
            return reply["files"]

    def _died(self, proc: subprocess.Popen, files: list[dict[str, Any]]) -> CheckpointError:
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return CheckpointError(
            f"the checkpoint writer process (pid {proc.pid}) died ({how}) while writing "
            f"{_where(files)}; that save is incomplete and will not be loaded"
        )

    def close(self) -> None:
        """Stop the child: close its pipe and wait for it (killed after 30 s)."""
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        proc, self.proc, self._segment = self.proc, None, None
        if proc is None:
            return
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _where(files: list[dict[str, Any]]) -> str:
    return str(Path(files[0]["path"]).parent) if files else "a checkpoint"


class ProcessFileSystemWriter(FileSystemWriter):
    """DCP's FileSystemWriter (one file per rank, fsynced) whose data files are written by
    `writer` from buffers in `segment`; planning, `.metadata` and the format are DCP's own."""

    def __init__(
        self,
        path: str | os.PathLike,
        writer: WriterProcess,
        segment: SharedSegment,
        *,
        hash_pieces: bool = True,
    ):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.writer = writer
        self.segment = segment
        self.piece = checksum.PIECE if hash_pieces else None
        self.write_s = 0.0

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        storage_plan: _StoragePrefix = plan.storage_data
        name = f"{storage_plan.prefix}0{DEFAULT_SUFFIX}"
        bytes_w = [wi for wi in plan.items if wi.type == WriteItemType.BYTE_IO]
        tensor_w = [wi for wi in plan.items if wi.type != WriteItemType.BYTE_IO]
        items: list[dict[str, Any]] = []
        for wi in bytes_w:  # FileSystemWriter's order: bytes first, then tensors
            data = planner.resolve_data(wi)
            assert isinstance(data, io.BytesIO)
            items.append(
                {"fqn": wi.index.fqn, "bytes": base64.b64encode(data.getbuffer()).decode()}
            )
        for wi in tensor_w:
            t = planner.resolve_data(wi)
            assert isinstance(t, torch.Tensor)
            offset = self.segment.offset_of(t)
            assert offset is not None, f"{wi.index.fqn}: not a staging buffer of the segment"
            items.append(
                {
                    "fqn": wi.index.fqn,
                    "offset": offset,
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                }
            )
        start = time.perf_counter()
        placed = self.writer.write(
            [{"path": str(Path(self.path) / name), "items": items}], self.piece
        )[0]
        self.write_s = time.perf_counter() - start
        results = [
            WriteResult(
                index=wi.index,
                size_in_bytes=length,
                storage_data=_StorageInfo(name, offset, length),
            )
            for wi, (offset, length) in zip([*bytes_w, *tensor_w], placed, strict=True)
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut
