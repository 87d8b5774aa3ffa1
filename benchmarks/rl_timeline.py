"""One timeline of `tidal rl`'s roles from their profiler traces, and where each role's time
went over the steps they share.

    tidal rl --config rl_addition_135m --rl.mode async --loss.tis_cap 2 \\
        --profiler.enable true --profiler.start_step 10 --profiler.end_step 14
    python benchmarks/rl_timeline.py RUN_DIR --out timeline.json

It reads the traces `--profiler.enable` wrote under RUN_DIR/profile, a folder per role
(trainer/rank<R>_step<N>-<M>.json, generator<g>/rank<R>_step<N>-<M>.json: the newest of each
rank; tidal/rl/distributed/profile.py), then

- writes one Chrome/Perfetto trace (--out, gzipped when it ends in .gz; open it in
  https://ui.perfetto.dev), a process lane per role (per rank when a role has several), CPU
  threads first, then GPU streams. Each torch.profiler trace gives its timestamps in
  microseconds after its own `baseTimeNanoseconds` (Unix time): they are moved onto one
  axis, starting at 0, whose Unix time is the merged trace's baseTimeNanoseconds;
- prints, per lane, over the window all traces cover (from the latest start of a step range
  to the earliest end of one): the wall time, the busy time (on a GPU, at least one of its
  kernels or copies running; on CPU, the time outside its waits, the rl/wait* ranges), idle
  % (100 - busy %), the waits, and each rl/ range's total; then the time at least two lanes
  were busy at once, and the time none was (on one GPU: the GPU idle). On one GPU without
  MPS the processes' kernels take turns: that overlap is about 0, so the roles' busy shares
  add up to at most 100%.

--json writes the summary as JSON.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path
from typing import Any

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
"""Event categories of work on a GPU (kineto's)."""
STEP_SPANS = ("train_step ", "batch ")
"""The ranges of a role's steps (the trainer's steps, a generator's batches)."""
WAIT = "rl/wait"
"""Prefix of the ranges of a role waiting for another (tidal.rl.report.SPANS)."""
TRACE = re.compile(r"rank(\d+)_step(\d+)-(\d+)\.json$")

Interval = tuple[float, float]


def find_traces(folder: Path) -> dict[str, Path]:
    """The newest trace of each rank of each role folder in `folder`, by lane name: the role
    ("trainer", "generator0"), with "/rank<R>" when the role has several ranks."""
    found: dict[str, dict[int, Path]] = {}
    for path in sorted(folder.glob("*/rank*_step*.json")):
        m = TRACE.search(path.name)
        if m is None:
            continue
        ranks = found.setdefault(path.parent.name, {})
        rank = int(m.group(1))
        if rank not in ranks or path.stat().st_mtime > ranks[rank].stat().st_mtime:
            ranks[rank] = path
    if not found:
        raise FileNotFoundError(
            f"no role traces in {folder} (expected <role>/rank<R>_step<N>-<M>.json): run "
            "tidal rl with --profiler.enable true"
        )

    def order(role: str) -> tuple[int, int, str]:
        digits = role.removeprefix("generator")
        return (role != "trainer", int(digits) if digits.isdigit() else 0, role)

    lanes = {}
    for role in sorted(found, key=order):
        ranks = found[role]
        for rank in sorted(ranks):
            lanes[role if len(ranks) == 1 else f"{role}/rank{rank}"] = ranks[rank]
    return lanes


def load(paths: dict[str, Path]) -> dict[str, dict]:
    return {name: json.loads(path.read_text()) for name, path in paths.items()}


def shifts(traces: dict[str, dict]) -> tuple[dict[str, float], int]:
    """Per trace the microseconds to add to its timestamps to put them on one axis starting
    at its first event, and that axis's 0 in Unix nanoseconds."""
    base = {n: int(t.get("baseTimeNanoseconds", 0)) for n, t in traces.items()}
    origin = min(base.values())
    offset = {n: (b - origin) / 1000 for n, b in base.items()}
    starts = [
        float(e["ts"]) + offset[n]
        for n, t in traces.items()
        for e in t.get("traceEvents", [])
        if e.get("ph") != "M" and "ts" in e
    ]
    first = min(starts, default=0.0)
    return {n: o - first for n, o in offset.items()}, origin + round(first * 1000)


def _gpu_threads(events: list[dict]) -> set[tuple[Any, Any]]:
    return {(e.get("pid"), e.get("tid")) for e in events if e.get("cat") in GPU_CATS}


def merge(traces: dict[str, dict]) -> dict[str, Any]:
    """One Chrome trace of `traces` (lane name -> torch.profiler trace): a process per lane,
    every event on the common time axis (`shifts`)."""
    shift, base_ns = shifts(traces)
    out: list[dict] = []
    for lane, (name, trace) in enumerate(traces.items(), start=1):
        events = trace.get("traceEvents", [])
        gpu = _gpu_threads(events)
        names = {
            (e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
            for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"
        }
        tids: dict[tuple[Any, Any], int] = {}
        for e in events:
            if e.get("ph") == "M":
                continue
            e = dict(e)
            key = (e.get("pid"), e.get("tid"))
            e["pid"], e["tid"] = lane, tids.setdefault(key, len(tids) + 1)
            if "ts" in e:
                e["ts"] = float(e["ts"]) + shift[name]
            if e.get("ph") in ("s", "t", "f") and isinstance(e.get("id"), int):
                e["id"] += lane << 40  # flow ids (CPU launch -> kernel) stay within a lane
            out.append(e)
        out.append(_meta("process_name", lane, 0, name=name))
        out.append(_meta("process_sort_index", lane, 0, sort_index=lane))
        for (pid, tid), new in tids.items():
            label = names.get((pid, tid)) or f"thread {tid}"
            if (pid, tid) in gpu:
                label = f"GPU {pid} {names.get((pid, tid)) or f'stream {tid}'}"
            out.append(_meta("thread_name", lane, new, name=label))
            order = new + (10_000 if (pid, tid) in gpu else 0)  # GPU streams last
            out.append(_meta("thread_sort_index", lane, new, sort_index=order))
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": base_ns,
        "otherData": {"lanes": list(traces)},
    }


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}


# -- the summary ---------------------------------------------------------------------------


def union(spans: list[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering `spans`."""
    out: list[Interval] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def clip(spans: list[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(s, lo), min(e, hi)) for s, e in spans if e > lo and s < hi]


def total(spans: list[Interval]) -> float:
    return sum(e - s for s, e in spans)


def complement(spans: list[Interval], lo: float, hi: float) -> list[Interval]:
    """[lo, hi] less the disjoint sorted `spans` (clipped to it)."""
    out, at = [], lo
    for s, e in spans:
        if s > at:
            out.append((at, s))
        at = max(at, e)
    return out + ([(at, hi)] if at < hi else [])


def at_least_two(lanes: list[list[Interval]]) -> float:
    """Time during which at least two of `lanes` (each disjoint intervals) are busy."""
    edges = sorted((t, d) for spans in lanes for s, e in spans for t, d in ((s, 1), (e, -1)))
    busy, last, out = 0, 0.0, 0.0
    for t, d in edges:
        if busy >= 2:
            out += t - last
        busy, last = busy + d, t
    return out


def _spans(events: list[dict], shift: float, keep) -> list[Interval]:
    return [
        (float(e["ts"]) + shift, float(e["ts"]) + shift + float(e.get("dur", 0)))
        for e in events
        if e.get("ph") == "X" and "ts" in e and keep(e)
    ]


def summarize(traces: dict[str, dict]) -> dict[str, Any]:
    """Per lane, over the window every trace covers: wall, busy, idle and wait time, the
    rl/ ranges' totals; and the time at least two lanes were busy (see the module doc)."""
    shift, base_ns = shifts(traces)
    events = {n: t.get("traceEvents", []) for n, t in traces.items()}
    on_gpu = any(e.get("cat") in GPU_CATS for ev in events.values() for e in ev)
    extents = {}
    for n, ev in events.items():
        steps = _spans(ev, shift[n], lambda e: str(e.get("name", "")).startswith(STEP_SPANS))
        spans = steps or _spans(ev, shift[n], lambda e: True)
        if not spans:
            raise ValueError(f"the trace of {n} holds no timed events")
        extents[n] = (min(s for s, _ in spans), max(e for _, e in spans))
    lo, hi = max(s for s, _ in extents.values()), min(e for _, e in extents.values())
    if hi <= lo:
        spans = ", ".join(f"{n} {s / 1e6:.3f}-{e / 1e6:.3f} s" for n, (s, e) in extents.items())
        raise ValueError(f"the traces share no time: {spans}")
    wall, lanes, busy_spans = (hi - lo) / 1e6, {}, []
    for n, ev in events.items():
        waits = union(clip(_spans(ev, shift[n], lambda e: _is_wait(e)), lo, hi))
        if on_gpu:
            busy = union(clip(_spans(ev, shift[n], lambda e: e.get("cat") in GPU_CATS), lo, hi))
        else:
            busy = complement(waits, lo, hi)
        busy_spans.append(busy)
        ranges: dict[str, float] = {}
        for s, e, name in _named(ev, shift[n]):
            part = clip([(s, e)], lo, hi)
            if part:
                ranges[name] = ranges.get(name, 0.0) + total(part) / 1e6
        busy_s, wait_s = total(busy) / 1e6, total(waits) / 1e6
        lanes[n] = {
            "wall_s": wall,
            "busy_s": busy_s,
            "busy_pct": 100 * busy_s / wall,
            "idle_pct": 100 - 100 * busy_s / wall,
            "wait_s": wait_s,
            "wait_pct": 100 * wait_s / wall,
            "ranges_s": dict(sorted(ranges.items())),
        }
    overlap = at_least_two(busy_spans) / 1e6
    none = wall - total(union([x for spans in busy_spans for x in spans])) / 1e6
    return {
        "busy": "GPU kernels and copies" if on_gpu else "time outside the rl/wait ranges",
        "window_s": wall,
        "window_start_ns": base_ns + round(lo * 1000),
        "lanes": lanes,
        "overlap_s": overlap,
        "overlap_pct": 100 * overlap / wall,
        "none_busy_s": none,
        "none_busy_pct": 100 * none / wall,
    }


def _is_wait(e: dict) -> bool:
    return str(e.get("name", "")).startswith(WAIT)


def _named(events: list[dict], shift: float) -> list[tuple[float, float, str]]:
    return [
        (float(e["ts"]) + shift, float(e["ts"]) + shift + float(e.get("dur", 0)), e["name"])
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("rl/") and "ts" in e
    ]


def report(s: dict[str, Any]) -> str:
    lines = [f"window {s['window_s']:.3f} s shared by every trace; busy = {s['busy']}"]
    lines.append(f"{'lane':<18}{'wall s':>9}{'busy s':>9}{'busy %':>8}{'idle %':>8}{'wait %':>8}")
    for n, r in s["lanes"].items():
        lines.append(
            f"{n:<18}{r['wall_s']:>9.3f}{r['busy_s']:>9.3f}{r['busy_pct']:>8.1f}"
            f"{r['idle_pct']:>8.1f}{r['wait_pct']:>8.1f}"
        )
        parts = ", ".join(f"{k} {v:.3f}" for k, v in r["ranges_s"].items())
        lines.append(f"{'':<18}ranges (s): {parts or '-'}")
    lines.append(
        f"at least two lanes busy at once: {s['overlap_s']:.3f} s "
        f"({s['overlap_pct']:.1f}% of the window)"
    )
    lines.append(
        f"no lane busy: {s['none_busy_s']:.3f} s ({s['none_busy_pct']:.1f}% of the window)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="the run's folder (job.output_dir)")
    ap.add_argument("--folder", default="profile", help="profiler.folder of the run")
    ap.add_argument(
        "--out", type=Path, help="merged trace, .json or .json.gz (default: <folder>/timeline.json)"
    )
    ap.add_argument("--json", type=Path, help="write the summary here too")
    args = ap.parse_args(argv)
    folder = args.folder if Path(args.folder).is_absolute() else args.run_dir / args.folder
    paths = find_traces(Path(folder))
    traces = load(paths)
    out = args.out or Path(folder) / "timeline.json"
    text = json.dumps(merge(traces))
    if out.suffix == ".gz":  # Perfetto opens gzipped traces too
        out.write_bytes(gzip.compress(text.encode()))
    else:
        out.write_text(text)
    summary = summarize(traces) | {"traces": {n: str(p) for n, p in paths.items()}}
    print(report(summary))
    print(f"timeline: {out} (https://ui.perfetto.dev)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
