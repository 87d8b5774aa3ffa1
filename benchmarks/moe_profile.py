"""Where a mixture-of-experts training step's time goes: router, dispatch/combine, expert
GEMMs, attention and the rest, from a torch profiler run of tidal's own steps.

`train_throughput.py --profile-moe` runs a few eager steps of the benchmarked model under
torch.profiler (`profile_steps`) and prints `table(breakdown(...))`. The MoE layer opens a
named range around each part of its forward while a profiler runs (`span` in
tidal/models/profiling.py; `MOE_SPANS` in tidal/models/moe.py: `moe.router`, `moe.dispatch`,
`moe.experts`, `moe.combine`, `moe.shared_experts`). Each operator's own time (its kernels'
time on a GPU, its own CPU time on CPU) goes to a category:

- an operator inside a range takes the range's category;
- a backward operator takes the category of the forward operator that made its autograd
  node (the profiler links them by sequence number and forward thread), so the backward of
  the gate matmul counts as router time, that of the gather as dispatch, and so on;
- inside `moe.experts`, by operator (or the backward node it runs under): the matrix
  products (`aten::_grouped_mm` on sm90+, the per-expert `aten::mm` loop elsewhere) are the
  expert GEMMs, the SwiGLU's silu and product "expert SwiGLU", the casts of the weights and
  rows to bf16 (autocast does not cover `_grouped_mm`) "expert casts", and the rest (the
  grouped kernel's padding scatter and gather, expert parallel's all-to-all)
  dispatch/combine;
- outside the MoE: scaled-dot-product attention kernels are attention, the optimizer step
  and the foreach kernels (gradient clipping's norm) "optimizer", everything else (the dense
  projections, norms, embedding, output layer and loss) "other".

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
    "expert SwiGLU",
    "expert casts",
    "shared experts",
    "attention",
    "optimizer",
    "other",
)
"""The breakdown's rows, in print order."""
MOE_CATEGORIES = CATEGORIES[:6]
"""The rows that are the MoE layers' time."""

SPAN_CATEGORY = {
    "moe.router": "router",
    "moe.dispatch": "dispatch/combine",
    "moe.combine": "dispatch/combine",
    "moe.experts": "experts",  # split further by operator, see `category`
    "moe.shared_experts": "shared experts",
}

# Inside moe.experts, first match over the operator and its ancestors wins; the rest is
# dispatch/combine (padding copies, all-to-all).
EXPERT_PARTS = [
    (
        "expert GEMMs",
        re.compile(r"^aten::(_grouped_mm|mm|bmm|addmm|matmul)$|(GroupedMm|Mm|Bmm)Backward"),
    ),
    ("expert casts", re.compile(r"^aten::(_to_copy|to)$|ToCopyBackward")),
    ("expert SwiGLU", re.compile(r"silu|^aten::mul$|MulBackward|SiluBackward", re.I)),
]
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
    names = [name, *ancestors]
    if span is not None:
        cat = SPAN_CATEGORY[span]
        if cat != "experts":
            return cat
        for part, pattern in EXPERT_PARTS:
            if any(pattern.search(n) for n in names):
                return part
        return "dispatch/combine"
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
        # up to the MoE range, or the backward node: what the operator runs for
        ancestors = []
        for a in _ancestors(e.cpu_parent):
            if a.name in SPAN_CATEGORY:
                break
            ancestors.append(a.name)
            if a.name.startswith(BACKWARD):
                break
        out[category(e.name, span, ancestors)] += own
    return {c: out.get(c, 0.0) for c in CATEGORIES}


def table(times_us: dict[str, float], steps: int, device: str) -> str:
    """The breakdown as printed lines: ms per step and share of the profiled time, with the
    MoE layers' subtotal after their rows."""
    total = sum(times_us.values()) or 1.0
    what = "GPU kernel time" if device == "cuda" else "CPU operator time"
    lines = [f"where the time goes ({what}, eager, mean of {steps} steps):"]

    def row(label: str, t: float) -> str:
        return f"  {label:28s} {t / steps / 1e3:9.2f} ms/step  {100 * t / total:5.1f}%"

    for c in CATEGORIES:
        lines.append(row(c, times_us.get(c, 0.0)))
        if c == MOE_CATEGORIES[-1]:
            lines.append(row("= MoE layers", sum(times_us.get(m, 0.0) for m in MOE_CATEGORIES)))
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
