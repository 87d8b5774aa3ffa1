"""`span`: a named range in a profiler's trace only while one records, and never under
torch.compile tracing."""

from __future__ import annotations

import contextlib

import torch

from tidal.models.profiling import span


def test_span_records_a_range_only_while_a_profiler_runs():
    assert isinstance(span("rl/generate"), contextlib.nullcontext)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with span("moe.router"):
            torch.ones(4).sum()
    assert "moe.router" in {event.name for event in prof.events()}


def test_span_is_a_no_op_under_compile_tracing(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert isinstance(span("moe.router"), contextlib.nullcontext)
