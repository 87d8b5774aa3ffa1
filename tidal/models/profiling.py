"""Named profiler ranges that cost nothing when no profiler records.

`span(name)` opens a `torch.profiler.record_function` range while a torch profiler records in
eager mode, and is a no-op otherwise. Used by the model's parts (`MoE.forward`: `MOE_SPANS` in
tidal/models/moe.py) and by the RL roles' phases (`Timer` and `SPANS` in tidal/rl/report.py,
shown in the traces of `--profiler.enable`: tidal/rl/distributed/profile.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A `record_function` range `name` while a torch profiler records in eager mode, else a
    no-op: no range is opened, and torch.compile never sees one (a range in a compiled graph
    would split its fusions)."""
    if torch.compiler.is_compiling() or not torch.autograd._profiler_enabled():
        return contextlib.nullcontext()
    return torch.profiler.record_function(name)
