"""Where a mixture-of-experts training step's time goes: router, dispatch/combine, expert
GEMMs, attention and the rest, from a torch profiler run of tidal's own steps.

`train_throughput.py --profile-moe` runs a few eager steps of the benchmarked model under
torch.profiler (`profile_steps`) and prints `table(breakdown(...))`. The MoE layer opens a
named range around each part of its forward while a profiler runs (`moe_span` in
tidal/models/moe.py: `moe.router`, `moe.dispatch`, `moe.experts`, `moe.combine`,
`moe.shared_experts`). Each operator's own time (its kernels' time on a GPU, its own CPU time
on CPU) goes to a category:

- an operator inside a range takes the range's category;
- a backward operator takes the category of the forward operator that made its autograd
  node (the profiler links them by sequence number and forward thread), so the backward of
  the gate matmul counts as router time, that of the gather as dispatch, and so on;
- inside `moe.experts`, the matrix products (`aten::_grouped_mm` on sm90+, the per-expert
  `aten::mm` loop elsewhere) are the expert GEMMs, collectives (expert parallel's
  all-to-all) dispatch/combine, and the rest (SwiGLU, the grouped kernel's padding copies)
  "experts: SwiGLU + padding";
- outside the MoE: scaled-dot-product attention kernels are attention, the optimizer step
  is the optimizer, everything else (the dense projections, norms, embedding, output layer
  and loss, gradient clipping) "other".

Eager only: under torch.compile the ranges are not opened (they would split the compiled
graphs) and the fused kernels mix the router's and dispatch's elementwise work.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

CATEGORIES = (
    "router",
    "dispatch/combine",
    "expert GEMMs",
    "experts: SwiGLU + padding",
    "shared experts",
    "attention",
    "optimizer",
    "other",
)
"""The breakdown's rows, in print order."""

SPAN_CATEGORY = {
    "moe.router": "router",
    "moe.dispatch": "dispatch/combine",
    "moe.combine": "dispatch/combine",
    "moe.experts": "experts",  # split further by operator, see `category`
    "moe.shared_experts": "shared experts",
}

GEMM_OPS = {"aten::_grouped_mm", "aten::mm", "aten::bmm", "aten::addmm", "aten::matmul"}
COLLECTIVE = re.compile(r"nccl|all_to_all|alltoall|c10d::|gloo", re.I)
ATTENTION = re.compile(r"attention|flash|sdpa|fmha", re.I)
OPTIMIZER = re.compile(r"^Optimizer\.|adam|_fused_adam|_foreach_", re.I)
BACKWARD = "autograd::engine::evaluate_function"


def _ancestors(e: Any) -> Iterator[Any]:
    while e is not None:
        yield e
        e = e.cpu_parent


def category(name: str, span: str | None, ancestors: Iterable[str]) -> str:
    """The category of operator `name` whose MoE range (its own, or its forward's for a
    backward operator) is `span`, under the operators and ranges `ancestors`."""
    if span is not None:
        cat = SPAN_CATEGORY[span]
        if cat != "experts":
            return cat
        if name in GEMM_OPS:
            return "expert GEMMs"
        if COLLECTIVE.search(name):
            return "dispatch/combine"
        return "experts: SwiGLU + padding"
    names = [name, *ancestors]
    if any(ATTENTION.search(n) for n in names):
        return "attention"
    if any(OPTIMIZER.search(n) for n in names):
        return "optimizer"
    return "other"


def breakdown(events: Iterable[Any], device: str) -> dict[str, float]:
    """Time in microseconds per category (`CATEGORIES`) over the profiler's `events`
    (`prof.events()`, FunctionEvents): each operator's self device time when `device` is
    "cuda", else its self CPU time."""
    events = list(events)
    span_of: dict[int, str | None] = {}
    forward: dict[tuple[int, int], str] = {}
    for e in events:
        span = next((a.name for a in _ancestors(e) if a.name in SPAN_CATEGORY), None)
        span_of[id(e)] = span
        if span is not None and e.sequence_nr >= 0:
            forward[(e.thread, e.sequence_nr)] = span
    out: dict[str, float] = defaultdict(float)
    for e in events:
        own = e.self_device_time_total if device == "cuda" else e.self_cpu_time_total
        if own <= 0:
            continue
        span = span_of[id(e)]
        if span is None:  # a backward operator: its forward's range
            for a in _ancestors(e):
                if a.name.startswith(BACKWARD):
                    span = forward.get((a.fwd_thread, a.sequence_nr))
                    break
        ancestors = [a.name for a in _ancestors(e.cpu_parent)]
        out[category(e.name, span, ancestors)] += own
    return {c: out.get(c, 0.0) for c in CATEGORIES}


def table(times_us: dict[str, float], steps: int, device: str) -> str:
    """The breakdown as printed lines: ms per step and share of the profiled time."""
    total = sum(times_us.values()) or 1.0
    what = "GPU kernel time" if device == "cuda" else "CPU operator time"
    lines = [f"where the time goes ({what}, eager, mean of {steps} steps):"]
    for c in CATEGORIES:
        t = times_us.get(c, 0.0)
        lines.append(f"  {c:28s} {t / steps / 1e3:9.2f} ms/step  {100 * t / total:5.1f}%")
    lines.append(f"  {'total':28s} {total / steps / 1e3:9.2f} ms/step")
    return "\n".join(lines)


def profile_steps(trainer: Any, warmup: int, steps: int) -> dict[str, float]:
    """Run `warmup` then `steps` training steps of `trainer` (a tidal Trainer, not yet
    trained), the latter under torch.profiler; returns `breakdown` of them."""
    import torch

    device = trainer.device.type
    trainer.model.train()
    for _ in range(warmup):
        trainer.train_step(*trainer.next_batches()[:2])
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            trainer.train_step(*trainer.next_batches()[:2])
        if device == "cuda":
            torch.cuda.synchronize()
    return breakdown(prof.events(), device)
