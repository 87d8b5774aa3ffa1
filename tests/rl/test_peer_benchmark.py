"""benchmarks/rl_peer.py: its step-time and time-to-target arithmetic, and a tiny CPU run."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _peer():
    spec = importlib.util.spec_from_file_location("rl_peer", ROOT / "benchmarks" / "rl_peer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_work_times_leave_the_evaluations_out():
    peer = _peer()
    steps = [
        {"step": 1, "elapsed_s": 10.0},
        {"step": 2, "elapsed_s": 11.0},
        {"step": 3, "elapsed_s": 17.0},
        {"step": 4, "elapsed_s": 18.0},
    ]
    # version 0's evaluation ran inside step 1, version 2's inside step 3
    evals = [{"step": 0, "eval_s": 9.0}, {"step": 2, "eval_s": 5.0}]
    assert peer.work_times(steps, evals) == [1.0, 1.0, 1.0, 1.0]


def test_summarize_counts_the_time_to_the_target():
    peer = _peer()
    steps = [{"step": i, "reward_mean": 0.1 * i} for i in range(1, 5)]
    evals = [
        {"step": 0, "eval_pass1": 0.2},
        {"step": 2, "eval_pass1": 0.5},
        {"step": 4, "eval_pass1": 0.6},
    ]
    fig = peer.summarize("x", steps, evals, [5.0, 1.0, 2.0, 1.0], [0, 10, 20, 10], target=0.5)
    assert fig["step_s"] == pytest.approx(4 / 3)  # the first step left out
    assert fig["steps_per_hour"] == pytest.approx(2700)
    assert fig["gen_tokens_per_s"] == pytest.approx(40 / 4)
    assert fig["time_to_target_s"] == pytest.approx(6.0)  # steps 1-2
    assert (fig["pass1_before"], fig["pass1_after"]) == (0.2, 0.6)
    missed = peer.summarize("x", steps, evals, [1.0] * 4, [0] * 4, target=0.9)
    assert missed["time_to_target_s"] is None


def test_peer_benchmark_smoke(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "peer.json"
    cmd = [
        sys.executable,
        "benchmarks/rl_peer.py",
        "--smoke",
        "--no-trl",
        "--only",
        "sync",
        "--steps",
        "2",
        "--work",
        str(tmp_path / "work"),
        "--json",
        str(out),
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "tidal sync" in p.stdout and "s/step" in p.stdout
    figs = json.loads(out.read_text())["figures"]
    assert [f["name"] for f in figs] == ["tidal sync"] and figs[0]["steps"] == 2
    assert "step    2/2" in (tmp_path / "work" / "sync" / "run.log").read_text()  # whole output
    # a second call reads the kept run instead of running it again
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "== tidal sync" not in again.stdout
