"""The checkpoint writer process: writes DCP data files from a shared staging segment, so the
byte writing of a background save (torch.save per tensor, file writes, fsync) runs on another
interpreter's GIL and not on the trainer's.

Run by tidal/train/checkpoint/writer_process.py as `python -P writer_child.py PPID FD NBYTES`
(stdlib and torch only, so it starts without the trainer's path): FD is the staging segment,
a memfd the trainer passed down, mapped here at once. Messages are JSON lines, requests on
stdin and replies on stdout (stderr is the trainer's):

    {"op": "write", "files": [{"path": P, "items": [ITEM, ...]}, ...], "piece_bytes": N}
        ITEM: {"fqn": K, "bytes": BASE64}  or
              {"fqn": K, "offset": O, "dtype": "float32", "shape": [..]}  (a tensor at byte
              O of the segment, contiguous)
    -> {"progress": N} after each item, then {"ok": true, "files": [[[offset, length], ...]]}
       (per file, per item: where DCP's reader finds it) or {"ok": false, "error": "..."}

Each file is written exactly as DCP's FileSystemWriter writes it (its own `_write_item`),
then fsynced. With `piece_bytes`, the bytes are hashed as they are written: a CRC32 of every
`piece_bytes` of each item, saved beside the file as `P.crc32` (JSON {"piece_bytes": N,
"chunks": {"<offset>": [crc, ...]}}, fsynced), which the commit folds into the marker
(tidal/train/checkpoint/checksum.py) instead of reading the file back.

The process exits when stdin closes (the trainer is done, or gone) and is killed by the
kernel when the trainer dies (PR_SET_PDEATHSIG), so a trainer never leaves a
writer behind; a writer killed mid-file leaves only a `.partial` folder without `.metadata`.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import io
import json
import math
import mmap
import os
import signal
import sys
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import (
    SerializationFormat,
    _StorageWriterTransforms,
    _write_item,
)
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

_PR_SET_PDEATHSIG = 1
_DTYPES = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def _die_with_parent(ppid: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: stdin's EOF still ends the loop
        pass
    if os.getppid() != ppid:  # the trainer died before prctl took effect
        os._exit(1)


def _tensor(mapping: mmap.mmap | None, item: dict[str, Any]) -> torch.Tensor:
    """The staged tensor, over exactly its own bytes of the segment (torch.save writes a
    tensor's whole storage, so a view of the whole segment would write all of it)."""
    dtype = _DTYPES[item["dtype"]]
    shape = [int(s) for s in item["shape"]]
    count = math.prod(shape)
    start = int(item["offset"])
    size = len(mapping) if mapping is not None else 0
    if start < 0 or start + count * dtype.itemsize > size:
        raise ValueError(f"{item['fqn']}: its bytes lie outside the staging segment")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mapping, dtype=dtype, count=count, offset=start).view(shape)


class HashingStream:
    """A file being written, hashed on the way: a CRC32 of every `piece` bytes counted from
    the last `begin()` (whole pieces of a large write on several threads)."""

    def __init__(self, raw: io.BufferedWriter, piece: int):
        self.raw, self.piece = raw, piece
        self.crcs: list[int] = []
        self._fill = 0  # bytes in the last, unfinished piece

    def begin(self) -> None:
        self.crcs, self._fill = [], 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        pos, piece = 0, self.piece
        if self._fill:  # finish the open piece
            pos = min(piece - self._fill, len(view))
            self.crcs[-1] = zlib.crc32(view[:pos], self.crcs[-1])
            self._fill = (self._fill + pos) % piece
        whole = (len(view) - pos) // piece
        if whole:
            starts = range(pos, pos + whole * piece, piece)
            self.crcs += _pool().map(lambda a: zlib.crc32(view[a : a + piece]), starts)
            pos += whole * piece
        if pos < len(view):
            self.crcs.append(zlib.crc32(view[pos:]))
            self._fill = len(view) - pos
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="crc")


def write_files(
    mapping: mmap.mmap | None,
    files: list[dict[str, Any]],
    report: Callable[[dict], None],
    piece: int | None = None,
) -> list[list[list[int]]]:
    """Write each file of a request; returns each item's (offset, length) in its file.
    With `piece`, also each file's checksums, as `<file>.crc32` (see the module docstring)."""
    transforms = _StorageWriterTransforms(None)
    out = []
    done = 0
    for f in files:
        path = f["path"]
        results = []
        chunks: dict[str, list[int]] = {}
        with open(path, "wb") as raw:
            stream: Any = HashingStream(raw, piece) if piece else raw
            for item in f["items"]:
                if piece:
                    stream.begin()
                data: io.BytesIO | torch.Tensor
                if "bytes" in item:
                    kind, data = WriteItemType.BYTE_IO, _bytes_io(item["bytes"])
                else:
                    kind, data = WriteItemType.TENSOR, _tensor(mapping, item)
                wi = WriteItem(index=MetadataIndex(item["fqn"]), type=kind)
                r = _write_item(
                    transforms,
                    stream,
                    data,
                    wi,
                    os.path.basename(path),
                    SerializationFormat.TORCH_SAVE,
                )
                results.append([r.storage_data.offset, r.storage_data.length])
                if piece:
                    chunks[str(r.storage_data.offset)] = stream.crcs
                done += 1
                report({"progress": done})
            raw.flush()
            os.fsync(raw.fileno())
        if piece:
            with open(path + ".crc32", "w") as side:
                json.dump({"piece_bytes": piece, "chunks": chunks}, side)
                side.flush()
                os.fsync(side.fileno())
        out.append(results)
    return out


def _bytes_io(text: str) -> io.BytesIO:
    return io.BytesIO(base64.b64decode(text))


def main(argv: list[str]) -> int:
    ppid, fd, nbytes = int(argv[1]), int(argv[2]), int(argv[3])
    _die_with_parent(ppid)
    # Ctrl-C reaches the whole process group: the trainer finishes its step and saves, and
    # this process must finish the write it is doing rather than die with the interrupt.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # a stray print must not corrupt the replies
    mapping = mmap.mmap(fd, nbytes) if nbytes else None
    os.close(fd)

    def report(msg: dict[str, Any]) -> None:
        replies.write(json.dumps(msg) + "\n")

    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") != "write":
            report({"ok": False, "error": f"unknown request {request.get('op')!r}"})
            continue
        try:
            files = write_files(mapping, request["files"], report, request.get("piece_bytes"))
            report({"ok": True, "files": files})
        except Exception as e:  # reported to the trainer, which raises it
            report({"ok": False, "error": f"{type(e).__name__}: {e}"})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
