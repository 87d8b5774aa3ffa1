"""A checkpoint folder on disk, and how a save becomes visible all at once.

    <checkpoint.folder>/
      step-10/                 a complete checkpoint
        .metadata              DCP's index: every key, its global shape, dtype and file
        __0_0.distcp ...       DCP data, one file per rank
        tidal.json             what was saved: step, contents, model flavor and args,
                               parallel layout, and the weights' layout ("tidal")
        COMPLETE               the marker, written last: the name and size of every file above,
                               and a CRC32 of every 64 MiB of each saved chunk
      step-20.partial/         a save in progress, or one cut short: never loaded

A save writes into `step-N.partial/` (DCP fsyncs every file it writes), then the coordinator
(rank 0) writes tidal.json, fsyncs the folder, renames it to `step-N` (atomic on POSIX file
systems), fsyncs the parent and writes COMPLETE (through a temporary file, fsync and rename).
Only a folder named `step-N` with a COMPLETE whose sizes match its files counts as a
checkpoint, so a process killed at any instant of a save leaves every earlier checkpoint as it
was and the half-written one recognizably incomplete. Deleting a checkpoint removes COMPLETE
first, so a deletion cut short leaves an incomplete folder, never a corrupt complete one.
Incomplete folders are removed by the next save of the same run (the run lock guarantees that
no other run is writing).

Nothing here knows of tensors or ranks: the functions are plain file-system operations.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MARKER = "COMPLETE"
INFO = "tidal.json"
DCP_METADATA = ".metadata"
FORMAT = "tidal-dcp/1"
_STEP_RE = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt, or does not fit this run."""


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step}"


def partial_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step}.partial"


@dataclass
class Scan:
    """The checkpoints of a folder: complete ones by step, and incomplete entries."""

    complete: dict[int, Path] = field(default_factory=dict)
    incomplete: list[Path] = field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        return sorted(self.complete)

    def describe_incomplete(self) -> str:
        return ", ".join(p.name for p in sorted(self.incomplete)) or "none"


def scan(folder: Path) -> Scan:
    """Sort the entries of `folder` into complete checkpoints and incomplete leftovers (a
    missing folder has neither)."""
    out = Scan()
    if not folder.is_dir():
        return out
    for entry in folder.iterdir():
        m = _STEP_RE.match(entry.name)
        if m and entry.is_dir() and (entry / MARKER).is_file():
            out.complete[int(m.group(1))] = entry
        elif m or entry.name.endswith(".partial"):
            out.incomplete.append(entry)
    return out


def is_checkpoint(path: Path) -> bool:
    """A folder with a tidal marker, or a plain DCP folder (a `.metadata` file)."""
    return (path / MARKER).is_file() or (path / DCP_METADATA).is_file()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _files(path: Path) -> dict[str, int]:
    return {
        p.name: p.stat().st_size
        for p in sorted(path.iterdir())
        if p.is_file() and p.name != MARKER and not p.name.endswith(".tmp")
    }


def commit(
    partial: Path, final: Path, info: dict[str, Any], checksums: dict[str, Any] | None = None
) -> None:
    """Make the finished save in `partial` the checkpoint `final` (see the module docstring).
    An existing `final` (a step saved again after resuming from an earlier one) is retired
    first: its marker goes, then the folder. `checksums` (tidal/train/checkpoint/checksum.py)
    go into the marker."""
    write_atomic(partial / INFO, json.dumps(info, indent=1) + "\n")
    fsync_dir(partial)
    retired = None
    if final.exists():
        (final / MARKER).unlink(missing_ok=True)
        retired = final.with_name(final.name + ".replaced.partial")
        shutil.rmtree(retired, ignore_errors=True)
        os.rename(final, retired)
    os.rename(partial, final)
    fsync_dir(final.parent)
    marker = {"format": FORMAT, "step": info["step"], "files": _files(final)}
    if checksums is not None:
        marker["crc32"] = checksums
    write_atomic(final / MARKER, json.dumps(marker, indent=1) + "\n")
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def remove(path: Path) -> None:
    """Delete a checkpoint folder, its marker first."""
    marker = path / MARKER
    if marker.exists():
        marker.unlink()
        fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)


def remove_incomplete(folder: Path) -> list[Path]:
    """Delete the incomplete entries of `folder`; returns what was removed."""
    leftovers = scan(folder).incomplete
    for entry in leftovers:
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    return leftovers


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {what}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); the checkpoint is corrupt") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object; the checkpoint is corrupt")
    return data


def read_marker(path: Path) -> dict[str, Any]:
    """The COMPLETE marker of the checkpoint `path` ({} when it has none)."""
    if not (path / MARKER).is_file():
        return {}
    return _read_json(path / MARKER, "the checkpoint is incomplete")


def read_info(path: Path) -> dict[str, Any]:
    """The tidal.json of the checkpoint `path` ({} when it has none), without the marker's
    checks (`verify` makes them).

    Raises:
        CheckpointError: an unreadable tidal.json.
    """
    if not (path / INFO).is_file():
        return {}
    return _read_json(path / INFO, "the checkpoint is incomplete")


def verify(path: Path) -> dict[str, Any]:
    """Check a checkpoint folder before anything is loaded from it and return its tidal.json
    (empty for a plain DCP folder without one, e.g. written by another tool).

    Raises:
        CheckpointError: naming the file that is missing, truncated or unreadable.
    """
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    marker_path = path / MARKER
    if not marker_path.exists():
        if (path / DCP_METADATA).is_file() and not (path / INFO).exists():
            return {}  # a DCP folder from elsewhere: no sizes to check
        raise CheckpointError(f"{path} is incomplete (no {MARKER} marker: its save did not finish)")
    marker = _read_json(marker_path, "the checkpoint is incomplete")
    files = marker.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{marker_path}: no file list; the checkpoint is corrupt")
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing; the checkpoint is incomplete")
        actual = f.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"{f}: {actual:,} bytes, the save wrote {size:,}; the file is truncated or corrupt"
            )
    return _read_json(path / INFO, "the checkpoint is incomplete")
