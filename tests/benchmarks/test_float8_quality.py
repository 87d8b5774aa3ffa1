"""benchmarks/float8_quality.py --smoke: the float8-against-bf16 quality check end to end on
CPU (tiny model, 8 steps, torchao's emulated float8): both curves, the figures and the PNG."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
SCRIPT = REPO / "benchmarks" / "float8_quality.py"


@pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None or importlib.util.find_spec("matplotlib") is None,
    reason="needs torchao and matplotlib (make setup installs both)",
)
def test_smoke_prints_both_losses_the_gap_and_writes_the_plot(tmp_path):
    png, out = tmp_path / "q.png", tmp_path / "q.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--smoke",
            "--out",
            str(tmp_path / "runs"),
            "--png",
            str(png),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert any(ln.startswith("bf16 ") for ln in lines) and any(
        ln.startswith("tensorwise ") for ln in lines
    ), proc.stdout
    summary = next(ln for ln in lines if ln.strip().startswith("tensorwise final"))
    assert "vs bf16" in summary and "max gap raw" in summary and "smoothed" in summary
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    result = json.loads(out.read_text())
    ref, got = result["curves"]["bf16"], result["curves"]["tensorwise"]
    assert len(ref) == len(got) == 8 and ref != got  # the float8 run really differs
    figures = result["figures"]["tensorwise"]
    assert 0 < figures["max_rel_gap"] < 0.02  # emulated float8 tracks fp32 closely
    assert figures["final_float8"] < ref[0]  # and learns
