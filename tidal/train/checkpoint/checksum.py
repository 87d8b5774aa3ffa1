"""CRC32 checksums of a checkpoint's data, written into its marker at commit and checked as
the bytes are read back, so that damaged bytes of the right size (a bad disk, a partial copy,
a stray write) fail the load with the file and key named instead of training on garbage.

DCP stores every saved chunk (one tensor shard, or one bytes entry) as a byte range of a data
file, listed in `.metadata`. A checksum covers each `PIECE`-sized piece of each range, so that
both the save and the load can hash the pieces of a large range on several threads (zlib
releases the GIL) and a reader checks exactly the ranges it reads, nothing more.

In the marker: `"crc32": {"piece_bytes": PIECE, "files": {"<file>": {"<offset>": [crc of
piece 0, crc of piece 1, ...]}}}`. A checkpoint without that field (written before checksums,
or by another tool) loads with the size check alone.
"""

from __future__ import annotations

import json
import os
import queue
import zlib
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader

from tidal.train.checkpoint.layout import CheckpointError

PIECE = 64 << 20
"""Bytes per checksum: small enough to spread a large tensor over threads, large enough to
keep the marker short (about 300 entries for an 18 GB checkpoint)."""

Checksums = dict[str, Any]


@cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="tidal-crc")


# A forked child inherits the pool without its threads: it makes its own.
os.register_at_fork(after_in_child=_pool.cache_clear)


def _pieces(offset: int, length: int, piece: int) -> list[tuple[int, int]]:
    return [(o, min(piece, offset + length - o)) for o in range(offset, offset + length, piece)]


class _Reader:
    """Reads file ranges and hashes them, into buffers reused across the pieces of one call
    (fresh 64 MiB allocations would fault pages in on every piece) and freed with it."""

    def __init__(self) -> None:
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()

    def crc(self, path: Path, offset: int, length: int) -> int:
        try:
            buf = self._free.get_nowait()
        except queue.Empty:
            buf = bytearray(length)
        if len(buf) < length:
            buf = bytearray(length)  # grows to the largest piece, at most PIECE
        view = memoryview(buf)[:length]
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                got = os.preadv(fd, [view], offset)
            finally:
                os.close(fd)
            if got != length:
                raise CheckpointError(f"{path}: ends inside bytes {offset:,}..{offset + length:,}")
            return zlib.crc32(view)
        finally:
            view.release()
            self._free.put(buf)


def _from_writer(folder: Path, name: str, offsets: set[int]) -> dict[str, list[int]] | None:
    """The checksums the writer process made of `name` as it wrote it (`<name>.crc32`), if
    they cover every chunk in pieces of PIECE bytes; the side file is removed either way."""
    side = folder / (name + ".crc32")
    try:
        data = json.loads(side.read_text())
    except (OSError, ValueError):
        return None
    finally:
        side.unlink(missing_ok=True)
    chunks = data.get("chunks", {})
    if data.get("piece_bytes") != PIECE or set(chunks) != {str(o) for o in offsets}:
        return None
    return chunks


def compute(folder: Path) -> Checksums:
    """Checksums of every chunk `.metadata` lists in the DCP folder `folder`: the writer
    process's where it hashed a file as it wrote it, else read back from the file (so they
    cover what reached it)."""
    storage = FileSystemReader(str(folder)).read_metadata().storage_data
    by_file: dict[str, list[tuple[int, int]]] = {}
    for s in storage.values():
        by_file.setdefault(s.relative_path, []).append((s.offset, s.length))
    files: dict[str, dict[str, list[int]]] = {}
    jobs = []
    for name, chunks in sorted(by_file.items()):
        hashed = _from_writer(folder, name, {off for off, _ in chunks})
        if hashed is not None:
            files[name] = hashed
            continue
        for off, length in sorted(set(chunks)):
            jobs += [(name, off, o, n) for o, n in _pieces(off, length, PIECE)]
    reader = _Reader()
    crcs = _pool().map(lambda j: reader.crc(folder / j[0], j[2], j[3]), jobs)
    for (name, off, _, _), crc in zip(jobs, crcs, strict=True):
        files.setdefault(name, {}).setdefault(str(off), []).append(crc)
    return {"piece_bytes": PIECE, "files": files}


def expected(checksums: Checksums, name: str, offset: int) -> list[int] | None:
    """The checksums of the chunk at `offset` of file `name` (None: not covered)."""
    return checksums.get("files", {}).get(name, {}).get(str(offset))


def verify(folder: Path, checksums: Checksums, chunks: list[tuple[str, int, int, str]]) -> None:
    """Check the `chunks` (file name, offset, length, key) of `folder` against `checksums`
    ({}: none to check), on several threads, before they are read.

    Raises:
        CheckpointError: naming the file, the key and the bytes that fail.
    """
    if not checksums:
        return
    piece = int(checksums["piece_bytes"])
    jobs = []
    for name, off, length, key in sorted(set(chunks)):
        crcs = expected(checksums, name, off)
        if crcs is None:
            continue  # a chunk the marker does not cover: the size checks only
        pieces = _pieces(off, length, piece)
        if len(pieces) != len(crcs):
            raise CheckpointError(
                f"{folder / name} (key {key}): {length:,} bytes do not match the marker's "
                "checksums; the checkpoint is corrupt"
            )
        jobs += [(name, off, key, o, n, crc) for (o, n), crc in zip(pieces, crcs, strict=True)]
    reader = _Reader()
    got = _pool().map(lambda j: reader.crc(folder / j[0], j[3], j[4]), jobs)
    for (name, off, key, o, n, want), crc in zip(jobs, got, strict=True):
        if crc != want:
            raise CheckpointError(
                f"{folder / name} (key {key}): bytes {o - off:,}..{o - off + n:,} of the chunk "
                "fail their checksum; the file is corrupt"
            )
