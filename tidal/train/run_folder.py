"""The run folder (`job.output_dir`) across restarts, and Ctrl-C that stops after a step.

- `check_output_dir`: the folder is a directory this process can write (created if missing);
  the first check of `tidal train` and of `tidal rl`, before anything else runs.
- One run at a time: rank 0 holds an exclusive `flock` on `<output_dir>/.lock` for the run's
  lifetime (the kernel drops it when the process ends, even by SIGKILL), so two runs never
  write the same metrics.jsonl or checkpoints. The lock file names the holder (host, pid,
  start time) for the error a second run gets.
- A fresh run refuses a folder whose metrics.jsonl already holds records (an earlier run's);
  a resumed run appends to it after a `{"event": "resume", "step": N}` record, so the records
  after the last resume event supersede earlier ones of the same steps.
- `StopOnInterrupt`: during the training loop SIGINT (Ctrl-C, or torchrun forwarding it to
  every rank) sets a flag instead of raising; the loop finishes the current step, and every
  rank agrees on the stop through one small all-reduce on a gloo group, so all ranks stop
  after the same step. A second Ctrl-C more than a second after the first (torchrun's
  forwarded copy arrives at once) raises KeyboardInterrupt and abandons the step.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

METRICS = "metrics.jsonl"
LOCK = ".lock"


class RunFolderError(ValueError):
    """The output folder is in use or holds another run."""


def check_output_dir(output_dir: str | Path) -> Path:
    """`job.output_dir` as a directory this process can write, created if missing (with its
    parents). Shared by `tidal train` and `tidal rl`, whose errors name the same field.

    Raises:
        ValueError: the path is a file, cannot be created, or is not writable.
    """
    out = Path(output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"job.output_dir {str(out)!r} is a file; it must be a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"job.output_dir {str(out)!r} cannot be created: {e.strerror or e}"
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"job.output_dir {str(out)!r} is not writable")
    return out


class RunLock:
    """An exclusive lock on a folder while this object lives (or until `release`); the
    kernel drops it when the process ends, however it ends.

    Raises:
        RunFolderError: another process holds it (named from the lock file).
    """

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / LOCK
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+")  # noqa: SIM115 - held for the run's lifetime
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self._file.close()
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunFolderError(
                f"{self.path.parent} is in use by another run ({self._holder()}); wait for it "
                "to finish, or choose another --job.output_dir"
            ) from None
        note = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        self._file.truncate(0)
        self._file.write(json.dumps(note) + "\n")
        self._file.flush()

    def _holder(self) -> str:
        try:
            note = json.loads(self.path.read_text() or "{}")
            return f"pid {note['pid']} on {note['host']}, started {note['started']}"
        except (OSError, ValueError, KeyError):
            return "holder unknown"

    def release(self) -> None:
        self._file.close()  # closing the descriptor drops the lock


def check_fresh(output_dir: str | Path, *, resuming: bool, checkpointing: bool) -> None:
    """A fresh run must not mix its metrics into an earlier run's.

    Raises:
        RunFolderError: `output_dir/metrics.jsonl` holds records and this run does not
            resume that run; the message says what to do.
    """
    metrics = Path(output_dir) / METRICS
    if resuming or not metrics.is_file() or metrics.stat().st_size == 0:
        return
    with open(metrics, "rb") as f:
        lines = sum(1 for _ in f)
    how = (
        "it left no complete checkpoint to resume from"
        if checkpointing
        else "resume it with --checkpoint.enable true if it saved checkpoints"
    )
    raise RunFolderError(
        f"job.output_dir {output_dir} holds an earlier run ({METRICS} has {lines} records); "
        f"{how}. Choose another --job.output_dir or delete the folder"
    )


def read_records(output_dir: str | Path) -> list[dict[str, Any]]:
    """The records of `output_dir/metrics.jsonl` as the run stands: a resume event at step N
    drops the earlier records of later steps (the resumed run wrote them again); the events
    themselves, blank lines and a last line cut short by a killed run are left out. [] when
    there is no metrics.jsonl."""
    path = Path(output_dir) / METRICS
    if not path.is_file():
        return []
    out: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if record.get("event") == "resume":
            out = [r for r in out if r.get("step", 0) <= record["step"]]
        elif "event" not in record:
            out.append(record)
    return out


class StopOnInterrupt:
    """SIGINT asks the training loop to stop after the current step (see the module
    docstring). `install()` before the loop (or use it as a context manager), `requested()`
    after each step, `uninstall()` after the loop.

    `group`: a gloo process group over all ranks for the agreement (None in one process);
    `announce`: say on stderr that the run will stop (rank 0).
    """

    REPEAT_S = 1.0

    def __init__(self, group: Any = None, *, announce: bool = True) -> None:
        self.group = group
        self.announce = announce
        self.flag = False
        self.first_at = 0.0
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        """Take over SIGINT (from the main thread only; elsewhere this does nothing)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True

    def uninstall(self) -> None:
        """Give SIGINT back to the handler it had."""
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def __enter__(self) -> StopOnInterrupt:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if not self.flag:
            self.flag, self.first_at = True, now
            if self.announce:  # os.write: a handler may interrupt a print of the main thread
                os.write(
                    2, b"\ninterrupt: stopping after this step (Ctrl-C again to stop at once)\n"
                )
        elif now - self.first_at > self.REPEAT_S:
            raise KeyboardInterrupt

    def requested(self) -> bool:
        """Whether to stop now; the same answer on every rank."""
        if self.group is None:
            return self.flag
        flag = torch.tensor([int(self.flag)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
