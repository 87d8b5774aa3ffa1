"""Where a training step's GPU time goes, from a profiler trace of tidal's trainer.

Reads a Chrome trace written by ``--profiler.enable`` (``rank0_step<N>-<M>.json``) and sums the
GPU kernels of its recorded steps by kind: GEMMs, attention, the optimizer, Triton
kernels made by inductor (the compiled blocks' fused memory-bound ops), other elementwise and
reduction kernels, copies and memsets; then the share of the step the GPU was busy and the
gaps where it waited for the host.

    python benchmarks/train_throughput.py --modes compile --steps 24 \\
        --set profiler.enable=true --set profiler.start_step=20 --set profiler.end_step=21 \\
        --set profiler.folder=outputs/prof
    python benchmarks/step_breakdown.py outputs/prof/rank0_step20-21.json
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

# First match wins: kernel names of cuBLAS/CUTLASS/cuDNN GEMMs, SDPA backends, torch's
# optimizers, inductor, and the ATen elementwise/reduction families.
KINDS = [
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn_generated.*(mha|attn)", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|sm90_|cublas|matmul", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|fused_optimizer|foreach", re.I)),
    ("inductor (triton)", re.compile(r"^triton_", re.I)),
    ("copy / memset", re.compile(r"memcpy|memset|copy_kernel|CatArrayBatched", re.I)),
    ("elementwise / reduce (aten)", re.compile(r"elementwise|reduce|vectorized|unrolled", re.I)),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def _events(trace: dict | list) -> list[dict]:
    """A Chrome trace's events (the object form holds them under ``traceEvents``)."""
    return trace if isinstance(trace, list) else trace.get("traceEvents", [])


def breakdown(trace: dict | list) -> dict:
    """The recorded window's steps: wall time per step, GPU busy time per step, kernel time by
    kind per step and the longest GPU idle gap, all in ms.

    The window runs from the first ``train_step`` span's start to the end of the last span or
    the last kernel, whichever is later: the trainer does not wait for the device at each step,
    so a step's span ends while its kernels still run and the next span begins by waiting for
    them. Per-step figures are the window's divided by its step count."""
    events = _events(trace)
    steps = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "user_annotation"
        and str(e.get("name", "")).startswith("train_step")
    ]
    if not steps:
        raise SystemExit(
            "no 'train_step' spans in this trace: was it written by --profiler.enable?"
        )
    t0 = min(e["ts"] for e in steps)
    kernels = sorted(
        (
            e
            for e in events
            if e.get("ph") == "X"
            and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
            and e["ts"] + e["dur"] > t0
        ),
        key=lambda e: e["ts"],
    )
    t1 = max([e["ts"] + e["dur"] for e in steps] + [k["ts"] + k["dur"] for k in kernels])
    by_kind: dict[str, float] = defaultdict(float)
    busy_end, busy, gap = t0, 0.0, 0.0
    for k in kernels:
        s, e = max(k["ts"], t0), k["ts"] + k["dur"]
        by_kind[kind_of(k["name"]) if k.get("cat") == "kernel" else "copy / memset"] += e - s
        if s > busy_end:
            gap = max(gap, s - busy_end)
        busy += max(0.0, e - max(s, busy_end))  # union of kernel intervals (streams overlap)
        busy_end = max(busy_end, e)
    n = len(steps)
    return {
        "steps": n,
        "wall_ms": (t1 - t0) / 1e3 / n,
        "gpu_busy_ms": busy / 1e3 / n,
        "longest_idle_ms": gap / 1e3,
        "kernels_ms": {k: v / 1e3 / n for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("trace", help="a rank<R>_step<N>-<M>.json written by --profiler.enable")
    p.add_argument("--top", type=int, default=12, help="also list this many kernels by total time")
    args = p.parse_args()
    with open(args.trace) as f:
        trace = json.load(f)
    rec = breakdown(trace)
    wall = rec["wall_ms"]
    print(
        f"{rec['steps']} steps: per step wall {wall:.1f} ms, GPU busy {rec['gpu_busy_ms']:.1f} ms "
        f"({100 * rec['gpu_busy_ms'] / wall:.0f}%); longest GPU idle gap "
        f"{rec['longest_idle_ms']:.2f} ms"
    )
    total = sum(rec["kernels_ms"].values())
    for kind, ms in rec["kernels_ms"].items():
        print(f"  {kind:<30} {ms:9.1f} ms a step  {100 * ms / total:5.1f}% of kernel time")
    per_name: dict[str, float] = defaultdict(float)
    for e in _events(trace):
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            per_name[e["name"]] += e["dur"] / 1e3
    print(f"top {args.top} kernels over the whole trace (ms, kind):")
    for name, ms in sorted(per_name.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {ms:9.1f}  {kind_of(name):<28} {name[:110]}")


if __name__ == "__main__":
    main()
