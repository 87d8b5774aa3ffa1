"""benchmarks/rl.py --smoke: the benchmark's two `tidal rl` runs at tiny sizes on CPU."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rl_benchmark_smoke():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, "benchmarks/rl.py", "--smoke", "--steps", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    for name in ("addition", "llama3_1b"):
        assert f"-- {name}: 2 steps" in p.stdout
    assert p.stdout.count("weight sync, trainer blocked") == 2
    assert p.stdout.count("weight sync, generator blocked") == 2
    assert "idle share of the loop's wall time" in p.stdout
    assert "steps/hour" in p.stdout and "new tokens/s" in p.stdout
