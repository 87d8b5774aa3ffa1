"""benchmarks/store_controller.py runs against the controller's current ops (it stopped
once when put_handles gained a field) and prints its four medians."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "store_controller.py"


def test_store_controller_benchmark_runs():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "8"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert re.fullmatch(
        r"N=8: begin \d+ us, commit \d+ us, acquire \d+ us, release \d+ us\n", out
    ), out
