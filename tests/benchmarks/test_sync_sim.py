"""benchmarks/sync_sim.py: the weight-sync simulator's arithmetic, its calibration replays
and its input checks (CPU only, no store, well under a second)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "sync_sim.py"
TOLERANCE = 0.15  # a held-out replay lands within 15% of the measured figure


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("sync_sim", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sync_sim"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules["sync_sim"]


CASES = [
    {},  # the headline: 1T FP8, 256 -> 8 x TP 16
    {"params": 235e9, "dtype_bytes": 2, "trainer_gpus": 64, "replicas": 4, "tp": 8},
    {"params": 8e9, "dtype_bytes": 2, "trainer_gpus": 8, "replicas": 8, "tp": 1},
    {"params": 70e9, "dtype_bytes": 2, "trainer_gpus": 32, "replicas": 1, "tp": 4},
    {"params": 1e12, "trainer_gpus": 512, "replicas": 2, "tp": 32, "nic_scope": "node"},
    {"params": 1e9, "trainer_gpus": 1, "replicas": 1, "tp": 1, "replicated_frac": 0.0},
]


@pytest.mark.parametrize("kw", CASES)
def test_prediction_never_below_the_bound(sim, kw):
    case = sim.Case(**kw)
    for path in sim.PATHS:
        p = sim.predict(case, path)
        assert p.bound > 0 and p.total >= p.bound, (path, p)
        assert p.phases["network"] >= p.bound * (1 - 1e-12), (path, p)
        assert p.total >= max(p.phases.values())


def test_the_headline_bound_is_perplexitys(sim):
    """1 TB into 8 replicas of 16 GPUs at 50 GB/s a GPU: each GPU takes its 1/16 (+ the
    replicated share) in ~1.25 s, the figure Perplexity gives for its own run."""
    p = sim.predict(sim.Case(replicated_frac=0.0), "design, GPU-direct")
    assert p.bound == pytest.approx(1.25)
    assert "generator NICs" in p.bottleneck
    assert p.total < 1.3 * 1.25  # the design stays near the bound; as built it does not
    assert sim.predict(sim.Case(), "as built (TCP)").ratio > 10


def test_doubling_the_nic_shrinks_the_network_phase(sim):
    design = "design, GPU-direct", "design, host-staged"
    for path in design:
        slow = sim.predict(sim.Case(nic_gbps=50), path)
        fast = sim.predict(sim.Case(nic_gbps=100), path)
        assert fast.phases["network"] == pytest.approx(slow.phases["network"] / 2), path
        assert fast.total < slow.total and fast.bound == pytest.approx(slow.bound / 2)
    # As built, TCP (~9 GB/s a process, measured) caps the network phase long before a
    # 50 GB/s NIC does: a faster NIC helps only below that.
    tcp = "as built (TCP)"
    assert sim.predict(sim.Case(nic_gbps=100), tcp).phases["network"] == pytest.approx(
        sim.predict(sim.Case(nic_gbps=50), tcp).phases["network"]
    )
    slow, fast = (sim.predict(sim.Case(nic_gbps=n), tcp) for n in (0.5, 1.0))
    assert fast.phases["network"] < slow.phases["network"]


def test_a_relay_pulls_a_node_s_bytes_once(sim):
    """8 TP-1 replicas on one node: with the relay the node pulls the model once over its 8
    NICs (then NVLink); without it (as built) every GPU pulls the whole model."""
    case = sim.Case(params=8e9, dtype_bytes=2, trainer_gpus=64, replicas=8, tp=1)
    design = sim.predict(case, "design, GPU-direct")
    assert design.phases["network"] == pytest.approx(16e9 / (8 * 50e9))
    assert design.phases["relay"] > 0
    assert sim.predict(case, "as built (TCP)").phases["network"] > 8 * design.phases["network"]


def test_the_controller_bounds_a_sync_of_many_small_shards(sim):
    """One process serves every op: with thousands of GPUs and a small model its busy time,
    not the network, sets the total."""
    case = sim.Case(params=1e9, trainer_gpus=4096, replicas=512, tp=8)
    p = sim.predict(case, "design, GPU-direct")
    assert p.phases["controller"] > 10 * p.phases["network"]
    assert p.total >= p.phases["controller"]


def test_nic_per_node_is_eight_times_slower(sim):
    gpu, node = sim.Case(nic_scope="gpu"), sim.Case(nic_scope="node")
    assert sim.lower_bound(node)[0] == pytest.approx(8 * sim.lower_bound(gpu)[0])


def test_pipeline(sim):
    assert sim.pipeline([1.0], 8) == pytest.approx(1.0)
    assert sim.pipeline([1.0, 1.0], 1) == pytest.approx(2.0)
    assert sim.pipeline([1.0, 1.0], 8) == pytest.approx(9 / 8)
    assert sim.pipeline([0.0, 0.0], 8) == 0.0


def test_calibration_replays_land_near_the_measured_figures(sim):
    rows = sim.calibrate()
    assert {r.role for r in rows} == {"fit", "check"}
    assert sum(r.role == "check" for r in rows) >= 5
    for r in rows:
        tol = 1e-3 if r.role == "fit" else TOLERANCE
        assert abs(r.ratio - 1) <= tol, (r.name, r.predicted, r.measured)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"trainer_gpus": 0}, "trainer_gpus must be >= 1"),
        ({"replicas": 0}, "replicas must be >= 1"),
        ({"tp": 0}, "tp must be >= 1"),
        ({"tp": 3}, "tp=3 and gpus_per_node=8: one must divide the other"),
        ({"tp": 12}, "tp=12 and gpus_per_node=8"),
        ({"nic_gbps": -50.0}, "nic_gbps must be > 0"),
        ({"nic_gbps": 0.0}, "nic_gbps must be > 0"),
        ({"params": 0.0}, "params must be > 0"),
        ({"dtype_bytes": -1.0}, "dtype_bytes must be > 0"),
        ({"trainer_gpus": 100}, "trainer_gpus=100 is not a multiple of gpus_per_node=8"),
        ({"replicated_frac": 1.0}, "replicated_frac must be in [0, 1)"),
        ({"nic_scope": "rack"}, "nic_scope must be 'gpu' or 'node'"),
    ],
)
def test_bad_inputs_name_the_field(sim, kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        sim.Case(**kw)


def test_unknown_path(sim):
    with pytest.raises(ValueError, match="path must be one of"):
        sim.predict(sim.Case(), "carrier pigeon")


def test_command_line(sim, tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert sim.main(["--json", str(out)]) == 0
    text = capsys.readouterr().out
    for want in ("lower bound 1.251 s", "Perplexity", "checkpoint-engine", "verl", "calibration"):
        assert want in text
    data = json.loads(out.read_text())
    assert data["case"] == dataclasses.asdict(sim.Case())
    assert [p["path"] for p in data["paths"]] == list(sim.PATHS)
    assert all(p["total"] >= data["bound_s"] for p in data["paths"])
    assert len(data["calibration"]) == len(sim.calibrate())
    assert sim.main(["--calibrate"]) == 0
    assert "lower bound" not in capsys.readouterr().out


def test_command_line_errors():
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--tp", "3"], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2
    assert "sync_sim: error: tp=3" in p.stderr and "Traceback" not in p.stderr
