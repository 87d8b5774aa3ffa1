"""A CUDA MPS control daemon for the roles of one `tidal rl` job (`rl.mps`).

Without MPS, processes sharing a GPU take turns on it: the trainer's kernels and a
generator's never run at the same time, so on one GPU an asynchronous job can only overlap
the roles' host-side work. Under MPS their kernels share the GPU's SMs at once, and
`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (trainer.sm_percent, generator.sm_percent) caps each
process's share, so that the trainer's large kernels leave room for a generator's small
decode kernels.

The daemon is private to the job: its pipe and log folders are a fresh temporary folder,
named to the roles through their environment, so other processes on the machine keep using
the GPU as before. It changes no setting of the GPU (its compute mode stays as it is) and
is quit when the job ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
TIMEOUT_S = 30.0
"""Longest wait for the control program to start or quit the daemon."""


@contextlib.contextmanager
def mps_daemon(log: Callable[[str], None] = print) -> Iterator[dict[str, str]]:
    """Start a private MPS control daemon; yields the environment variables that make a
    process started inside use it. Quits the daemon on exit.

    Raises:
        ValueError: nvidia-cuda-mps-control is not on PATH, or it failed to start.
    """
    exe = shutil.which(CONTROL)
    if exe is None:
        raise ValueError(
            f"rl.mps needs {CONTROL} on PATH (it comes with the NVIDIA driver); "
            "set --rl.mps false to share the GPU by time-slicing"
        )
    root = Path(tempfile.mkdtemp(prefix="tidal-mps-"))  # short: the pipe is a unix socket
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(root / "log"),
    }
    try:
        for path in env.values():
            Path(path).mkdir()
        started = subprocess.run(
            [exe, "-d"],
            env=_with(env),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
        if started.returncode != 0:
            raise ValueError(
                f"rl.mps: {CONTROL} -d failed (status {started.returncode}): "
                f"{(started.stderr or started.stdout).strip()}"
            )
        log(
            f"tidal rl: roles share the GPU under a CUDA MPS daemon of their own "
            f"({env['CUDA_MPS_PIPE_DIRECTORY']})"
        )
        try:
            yield env
        finally:
            subprocess.run(
                [exe],
                input="quit\n",
                env=_with(env),
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
                check=False,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def role_env(env: dict[str, str], sm_percent: int) -> dict[str, str]:
    """`env` with a role's SM share under MPS (unchanged for 100: no cap)."""
    if sm_percent >= 100:
        return env
    return {**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(sm_percent)}


def _with(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **extra}
