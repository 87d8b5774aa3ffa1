"""benchmarks/serve.py end to end on CPU at a tiny size: the server subprocess starts, both
sides run the same requests and the figures are written."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "serve.py"


def test_serve_benchmark_smoke(tmp_path, capsys):
    for module in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(module)
    spec = importlib.util.spec_from_file_location("serve_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["serve_bench"] = bench
    try:
        spec.loader.exec_module(bench)
        out = tmp_path / "serve.json"
        argv = ["--flavor", "tiny", "--clients", "4", "--requests", "2", "--prompt-len", "8"]
        argv += ["--max-tokens", "4", "--max-batch", "4", "--rounds", "1", "--json", str(out)]
        assert bench.main(argv) == 0
    finally:
        del sys.modules["serve_bench"]
    figures = json.loads(out.read_text())
    assert figures["server_tok_s"] > 0 and figures["python_api_tok_s"] > 0
    assert "server / python API" in capsys.readouterr().out
