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

import os
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


def _crc_file_range(path: Path, offset: int, length: int) -> int:
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), length, offset)
    if len(data) != length:
        raise CheckpointError(f"{path}: ends inside bytes {offset:,}..{offset + length:,}")
    return zlib.crc32(data)


def compute(folder: Path) -> Checksums:
    """Checksums of every chunk `.metadata` lists in the DCP folder `folder` (read back from
    the files, so they cover what reached them)."""
    storage = FileSystemReader(str(folder)).read_metadata().storage_data
    chunks = sorted({(s.relative_path, s.offset, s.length) for s in storage.values()})
    jobs = [
        (name, off, o, n) for name, off, length in chunks for o, n in _pieces(off, length, PIECE)
    ]
    crcs = _pool().map(lambda j: _crc_file_range(folder / j[0], j[2], j[3]), jobs)
    files: dict[str, dict[str, list[int]]] = {}
    for (name, off, _, _), crc in zip(jobs, crcs, strict=True):
        files.setdefault(name, {}).setdefault(str(off), []).append(crc)
    return {"piece_bytes": PIECE, "files": files}


def expected(checksums: Checksums, name: str, offset: int) -> list[int] | None:
    """The checksums of the chunk at `offset` of file `name` (None: not covered)."""
    return checksums.get("files", {}).get(name, {}).get(str(offset))


def check(data: bytes, crcs: list[int], piece: int, what: str) -> None:
    """Raise CheckpointError naming `what` unless the `piece`-sized pieces of `data` (one
    chunk, read whole) have the checksums `crcs`."""
    view = memoryview(data)
    pieces = _pieces(0, len(data), piece)
    if len(pieces) != len(crcs):
        raise CheckpointError(f"{what}: {len(data):,} bytes do not match the marker's checksums")
    got = [zlib.crc32(view[o : o + n]) for o, n in pieces[:1]]  # most chunks: one piece
    got += _pool().map(lambda p: zlib.crc32(view[p[0] : p[0] + p[1]]), pieces[1:])
    for i, (crc, want) in enumerate(zip(got, crcs, strict=True)):
        if crc != want:
            start = i * piece
            raise CheckpointError(
                f"{what}: bytes {start:,}..{start + pieces[i][1]:,} of the chunk fail their "
                "checksum; the file is corrupt"
            )
