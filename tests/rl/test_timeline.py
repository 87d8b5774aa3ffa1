"""`--profiler.enable` under `tidal rl`: every role traces the window (tidal/rl/distributed/
profile.py), and benchmarks/rl_timeline.py merges the traces onto one clock and reports each
role's busy and idle time; its arithmetic on two synthetic traces, then a tiny async run."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from tests.rl._cli import NO_PLOT, run_rl

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "rl_timeline.py"
B1 = 1_790_000_000_000_000_000  # the trainer trace's baseTimeNanoseconds
B2 = B1 - 5_000_000  # the generator's: 5 ms earlier, so its timestamps are 5000 us larger


@pytest.fixture(scope="module")
def timeline():
    spec = importlib.util.spec_from_file_location("rl_timeline", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rl_timeline"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["rl_timeline"]


def _x(name: str, ts: float, dur: float, *, pid=100, tid=100, cat="cpu_op") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}


def _kernel(ts: float, dur: float) -> dict:
    return _x("gemm", ts, dur, pid=0, tid=7, cat="kernel")


def _traces(kernels: bool = True) -> dict[str, dict]:
    """In absolute microseconds after B1: the trainer's step 0-10000 (waiting 0-1000, kernels
    1000-3000 and 6000-8000), the generator's batch 2000-12000 (waiting 9000-12000, kernels
    3000-6000 and 7500-9000)."""
    trainer = [
        _x("train_step 1", 0, 10_000, cat="user_annotation"),
        _x("rl/wait_rollouts", 0, 1000, cat="user_annotation"),
        _x("rl/train_step", 1000, 7000, cat="user_annotation"),
        {"ph": "s", "id": 5, "pid": 100, "tid": 100, "ts": 1000, "cat": "ac2g", "name": "l"},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7"}},
    ]
    shift = 5000  # the generator's timestamps, after its own base
    generator = [
        _x("batch 1", 2000 + shift, 10_000, cat="user_annotation"),
        _x("rl/wait", 9000 + shift, 3000, cat="user_annotation"),
    ]
    if kernels:
        trainer += [_kernel(1000, 2000), _kernel(6000, 2000)]
        generator += [_kernel(3000 + shift, 3000), _kernel(7500 + shift, 1500)]
    return {
        "trainer": {"baseTimeNanoseconds": B1, "traceEvents": trainer},
        "generator0": {"baseTimeNanoseconds": B2, "traceEvents": generator},
    }


def test_merge_puts_each_role_in_a_lane_on_one_clock(timeline):
    merged = timeline.merge(_traces())
    assert merged["baseTimeNanoseconds"] == B1  # the earliest event, the trainer's step
    events = [e for e in merged["traceEvents"] if e["ph"] != "M"]
    kernels = sorted((e["pid"], e["ts"]) for e in events if e.get("cat") == "kernel")
    assert kernels == [(1, 1000), (1, 6000), (2, 3000), (2, 7500)]
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in merged["traceEvents"]
        if e["ph"] == "M" and e["name"] in ("process_name", "thread_name")
    }
    assert names[(1, 0)] == "trainer" and names[(2, 0)] == "generator0"
    gpu = {e["tid"] for e in events if e.get("cat") == "kernel" and e["pid"] == 1}
    assert [names[(1, t)] for t in gpu] == ["GPU 0 stream 7"]
    flow = next(e for e in events if e["ph"] == "s")
    assert flow["id"] == 5 + (1 << 40)  # ids of different lanes cannot meet
    json.dumps(merged)  # writable as is


def test_summary_counts_kernels_idle_time_and_overlap_over_the_shared_window(timeline):
    s = timeline.summarize(_traces())
    assert s["busy"].startswith("GPU")
    assert s["window_s"] == pytest.approx(0.008)  # 2000-10000: both traces cover it
    assert s["window_start_ns"] == B1 + 2_000_000
    t, g = s["lanes"]["trainer"], s["lanes"]["generator0"]
    assert t["busy_s"] == pytest.approx(0.003)  # 2000-3000 and 6000-8000
    assert t["idle_pct"] == pytest.approx(62.5)
    assert t["wait_s"] == 0  # its wait ended before the window
    assert t["ranges_s"] == {"rl/train_step": pytest.approx(0.006)}
    assert g["busy_s"] == pytest.approx(0.0045)
    assert g["wait_s"] == pytest.approx(0.001)  # 9000-10000
    assert s["overlap_s"] == pytest.approx(0.0005)  # 7500-8000
    assert s["none_busy_s"] == pytest.approx(0.001)  # 9000-10000: no kernel at all


def test_on_cpu_busy_is_the_time_outside_the_waits(timeline):
    s = timeline.summarize(_traces(kernels=False))
    assert s["busy"].startswith("time outside")
    g = s["lanes"]["generator0"]
    assert g["busy_s"] == pytest.approx(0.007) and g["idle_pct"] == pytest.approx(12.5)
    assert s["overlap_s"] == pytest.approx(0.007)  # the trainer waits only before 2000


def test_traces_that_share_no_time_are_an_error(timeline):
    traces = _traces()
    traces["generator0"]["baseTimeNanoseconds"] = B1 + 60 * 10**9
    with pytest.raises(ValueError, match="share no time"):
        timeline.summarize(traces)


def test_find_traces_takes_each_ranks_newest(timeline, tmp_path):
    for rel in ("trainer/rank0_step2-3.json", "trainer/rank1_step2-3.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("{}")
    for i, rel in enumerate(("generator10/rank0_step1-2.json", "generator10/rank0_step2-3.json")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("{}")
        os.utime(tmp_path / rel, (1000 + i, 1000 + i))
    (tmp_path / "generator2").mkdir()
    (tmp_path / "generator2" / "rank0_step2-3.json").write_text("{}")
    lanes = timeline.find_traces(tmp_path)
    assert list(lanes) == ["trainer/rank0", "trainer/rank1", "generator2", "generator10"]
    assert lanes["generator10"].name == "rank0_step2-3.json"
    with pytest.raises(FileNotFoundError, match="--profiler.enable"):
        timeline.find_traces(tmp_path / "trainer")


def test_an_async_run_traces_every_role_and_the_timeline_reads_them(timeline, tmp_path):
    out = tmp_path / "run"
    r = run_rl(
        out,
        "--rl.steps",
        "3",
        "--rl.mode",
        "async",
        "--loss.tis_cap",
        "2",
        *NO_PLOT,
        "--profiler.enable",
        "true",
        "--profiler.start_step",
        "2",
        "--profiler.end_step",
        "2",
        "--profiler.record_shapes",
        "false",
        "--profiler.table",
        "false",
    )
    assert r.returncode == 0, r.stdout
    folder = out / "profile"
    # The generator records its batches up to the trainer's window end + its lag (1 here).
    assert (folder / "trainer" / "rank0_step2-2.json").is_file(), r.stdout
    assert (folder / "generator0" / "rank0_step2-3.json").is_file(), r.stdout
    assert not list(folder.glob("*/*.txt"))  # --profiler.table false
    merged, summary = tmp_path / "timeline.json", tmp_path / "summary.json"
    assert timeline.main([str(out), "--out", str(merged), "--json", str(summary)]) == 0
    s = json.loads(summary.read_text())
    assert list(s["lanes"]) == ["trainer", "generator0"]
    for lane in s["lanes"].values():
        assert 0 <= lane["idle_pct"] <= 100 and lane["wall_s"] > 0
    assert "rl/train_step" in s["lanes"]["trainer"]["ranges_s"]
    events = json.loads(merged.read_text())["traceEvents"]
    lanes = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert lanes == {"trainer": 1, "generator0": 2}
    spans = {(e["pid"], e["name"]) for e in events if e["ph"] == "X"}
    assert (1, "train_step 2") in spans and (2, "batch 2") in spans
