"""Shared pieces of the tests that run RL as the user does, in processes of their own:
`tidal rl` (`tidal_rl`; `run_rl` with the usual `--config` and `--job.output_dir`), a role
command or the launcher left running (`start_tidal`), `python -m tidal.rl.grpo` or `tidal
train` (`run_module`), and the run folder's step and eval records (`records`).

Every process runs from the repository root with the checkout on PYTHONPATH and one OpenMP
thread (`child_env`). The default config is tests/rl/loop_configs.py:tiny (a seed-initialized
0.3M model on CPU in fp32, 8-token completions, the `digits` reward); every role process
imports that file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "tests/rl/loop_configs.py:tiny"
NO_PLOT = ("--metrics.plot", "false")
"""Skips rl.png where a test does not look at it."""


def child_env() -> dict[str, str]:
    """The environment of a process a test starts: this checkout first, one OpenMP thread."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def start_tidal(*args: str, **kw) -> subprocess.Popen:
    """`python -m tidal ARGS` started from the repository root in a session of its own, its
    output (stderr included) readable as text from `stdout`."""
    return subprocess.Popen(
        [sys.executable, "-m", "tidal", *args],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **kw,
    )


def tidal_rl(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """`python -m tidal rl ARGS` from the repository root; its processes in a session of
    their own, checked to be all gone when it returns."""
    p = start_tidal("rl", *args, **kw)
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert_session_gone(p.pid)
    return subprocess.CompletedProcess(p.args, p.returncode, out, "")


def run_rl(
    out: str | Path, *args: str, config: str = CONFIG, timeout: float = 120
) -> subprocess.CompletedProcess:
    """`tidal rl --config CONFIG --job.output_dir OUT ARGS` (`tidal_rl`)."""
    return tidal_rl("--config", config, "--job.output_dir", str(out), *args, timeout=timeout)


def run_module(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` run to its end from the repository root, its stdout and stderr
    captured apart (`tidal.rl.grpo`: the loop in one process; `tidal train`)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_session_gone(pgid: int, within: float = 30.0) -> None:
    """No process of the session `pgid` is left (every role ended)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)  # waiting for exits, bounded
    os.killpg(pgid, signal.SIGKILL)
    raise AssertionError(f"processes of session {pgid} were still running {within:g} s on")


def records(out_dir: Path) -> tuple[list[dict], list[dict]]:
    """The run's step records and eval records, from its metrics.jsonl."""
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "reward_mean" in r]
    evals = [r for r in lines if "eval_pass1" in r]
    return steps, evals
