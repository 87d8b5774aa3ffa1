"""The profiler trace of chosen steps and CUDA memory snapshots of a training run, and the
Flight Recorder's set-up for NCCL jobs (docs/debugging.md).

Lifecycle (every rank, in its own process): `Trainer._build` makes a `RunProfiler` from
`cfg.profiler` right after the device is set and before the model is materialized, so the
CUDA allocator's history (`profiler.memory_snapshot`) covers the parameters and optimizer
states too. `Trainer.train` calls `start(first_step)` before its loop, `step_begin(step)` and
`step_done(step)` around each optimizer step (its logging, validation and save included), runs
it inside `oom_guard()`, and calls `stop()` in its `finally`; `Trainer.close` calls `close()`,
which ends the allocator's recording.

Files, under `profiler.folder` (relative to `job.output_dir`):

- `rank<R>_step<N>-<M>.json`: a Chrome trace of steps N..M (open in https://ui.perfetto.dev
  or chrome://tracing), each step a `train_step <step>` span, and `rank<R>_step<N>-<M>.txt`,
  its operators by self time;
- `memory/rank<R>_step<N>.pickle` after each step of `profiler.memory_snapshot_steps`, and
  `memory/rank<R>_oom.pickle` at a CUDA out-of-memory error (open in
  https://pytorch.org/memory_viz).

The trace uses torch.profiler with a schedule of tidal's own: nothing before the step ahead of
`start_step`, that step as the warm-up (profiled, discarded: the first recorded step then
carries no start-up cost), `start_step..end_step` recorded, and the files written after
`end_step`. A run stopped inside the window (Ctrl-C, an error) still writes what it recorded.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from tidal.parallel.launch import enable_flight_recorder
from tidal.train.config import DebugConfig, ProfilerConfig

TOP_OPS = 40  # rows of the operator table next to each trace


def run_path(path: str, output_dir: str | Path) -> Path:
    """A configured folder (`profiler.folder`, `debug.flight_recorder_folder`), relative to
    the run's folder unless absolute."""
    folder = Path(path).expanduser()
    return folder if folder.is_absolute() else Path(output_dir).expanduser() / folder


def setup_flight_recorder(
    cfg: DebugConfig,
    output_dir: str | Path,
    *,
    device: torch.device,
    world_size: int,
    environ: MutableMapping[str, str] | None = None,
) -> Path | None:
    """Turn on the NCCL Flight Recorder for this job if it is an NCCL one (CUDA, several
    ranks) and `debug.flight_recorder` is on; returns the dump folder, or None. Called by
    `Trainer._build` before `init_process_group` (see `enable_flight_recorder`)."""
    if not cfg.flight_recorder or device.type != "cuda" or world_size < 2:
        return None
    folder = run_path(cfg.flight_recorder_folder, output_dir)
    enable_flight_recorder(folder, cfg.flight_recorder_entries, environ)
    return folder


def step_action(step: int, start: int, end: int) -> ProfilerAction:
    """What the profiler does during training step `step` for the window start..end."""
    if step == start - 1:
        return ProfilerAction.WARMUP
    if start <= step < end:
        return ProfilerAction.RECORD
    if step == end:
        return ProfilerAction.RECORD_AND_SAVE
    return ProfilerAction.NONE


class RunProfiler:
    """The profiler trace and the memory snapshots of one rank (see the module docstring).

    Args:
        cfg: the `profiler` section.
        output_dir: the run's folder.
        rank: this process's global rank (names the files).
        device: the training device; memory snapshots need CUDA.
        total_steps: `training.steps`, to warn about a window the run never reaches.
        log: receives a line per file written.
        memory: the module with `_record_memory_history` and `_dump_snapshot`
            (torch.cuda.memory; tests pass a stand-in).
        span: the name of each step's range in the trace, before its number ("train_step";
            an RL generator's steps are its rollout batches: "batch").
        defer: keep a finished trace and write it at `stop()` or `close()` instead of right
            after `end_step` (`defer` is an attribute too). Writing a large trace holds the
            GIL for seconds: an RL role would miss its heartbeats (tidal rl sets it).
    """

    def __init__(
        self,
        cfg: ProfilerConfig,
        output_dir: str | Path,
        *,
        rank: int,
        device: torch.device,
        total_steps: int,
        log: Callable[[str], Any] = print,
        memory: Any = None,
        span: str = "train_step",
        defer: bool = False,
    ):
        self.cfg, self.rank, self.device, self.log = cfg, rank, device, log
        self.span, self.defer = span, defer
        self._done: list[torch.profiler.profile] = []  # deferred traces, not yet written
        self.folder = run_path(cfg.folder, output_dir)
        self.memory = memory if memory is not None else torch.cuda.memory
        self._prof: torch.profiler.profile | None = None
        self._span: Any = None  # the open `train_step N` record_function
        self._first_step = 1
        self._oom_dumped = False
        self.recording_memory = False
        if cfg.enable and cfg.start_step > total_steps:
            warnings.warn(
                f"profiler.start_step={cfg.start_step} is after the run's last step "
                f"(training.steps={total_steps}): no trace will be written",
                stacklevel=2,
            )
        if cfg.memory_snapshot:
            if device.type != "cuda":
                warnings.warn(
                    f"profiler.memory_snapshot records the CUDA caching allocator; this run is "
                    f"on {device.type}: no memory snapshots are written (peak_memory_gib in "
                    "metrics.jsonl has the process's peak RSS)",
                    stacklevel=2,
                )
            else:
                (self.folder / "memory").mkdir(parents=True, exist_ok=True)
                self.memory._record_memory_history(
                    max_entries=cfg.memory_snapshot_entries, device=device
                )
                self.recording_memory = True

    # -- the trace ------------------------------------------------------------------------

    def start(self, first_step: int) -> None:
        """Begin profiling before training step `first_step` (a resumed run's first)."""
        cfg = self.cfg
        if not cfg.enable or first_step > cfg.end_step:
            return
        self._first_step = first_step
        self.folder.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities,
            # The profiler counts its own steps from 0; map them to training steps.
            schedule=lambda n: step_action(first_step + n, cfg.start_step, cfg.end_step),
            on_trace_ready=self._trace_ready,
            record_shapes=cfg.record_shapes,
            with_stack=cfg.with_stack,
        )
        self._prof.start()

    def step_begin(self, step: int) -> None:
        """Before training step `step`: inside the window, open a `train_step <step>` span
        (named by the training step, unlike the profiler's own ProfilerStep#k; `span`
        names it)."""
        cfg = self.cfg
        if self._prof is not None and cfg.start_step <= step <= cfg.end_step:
            self._span = torch.profiler.record_function(f"{self.span} {step}")
            self._span.__enter__()

    def _close_span(self) -> None:
        if self._span is not None:
            span, self._span = self._span, None
            span.__exit__(None, None, None)

    def step_done(self, step: int) -> None:
        """After optimizer step `step`: advance the trace, write a memory snapshot if asked."""
        self._close_span()
        if self._prof is not None:
            self._prof.step()
            if step >= self.cfg.end_step:  # written by on_trace_ready inside step()
                self._prof.stop()
                self._prof = None
        if self.recording_memory and step in self.cfg.snapshot_steps:
            self._dump_memory(f"step{step}")

    def stop(self) -> None:
        """End a trace still open (the run ended inside the window); writes what it has,
        and a deferred trace."""
        self._close_span()
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()
        done, self._done = self._done, []
        for prof in done:
            self._write_trace(prof)

    def _trace_ready(self, prof: torch.profiler.profile) -> None:
        if self.defer:
            self._done.append(prof)
        else:
            self._write_trace(prof)

    def _write_trace(self, prof: torch.profiler.profile) -> None:
        # A run stopped early wrote fewer steps: name the file by the steps it holds.
        last = min(self.cfg.end_step, self._first_step + prof.step_num - 1)
        first = max(self.cfg.start_step, self._first_step)
        stem = self.folder / f"rank{self.rank}_step{first}-{last}"
        prof.export_chrome_trace(str(stem) + ".json")
        if self.cfg.table:
            sort = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=sort, row_limit=TOP_OPS)
            Path(str(stem) + ".txt").write_text(table + "\n")
        self.log(f"profiler: steps {first}-{last} traced to {stem}.json")

    # -- memory snapshots ----------------------------------------------------------------

    def _dump_memory(self, tag: str) -> Path:
        path = self.folder / "memory" / f"rank{self.rank}_{tag}.pickle"
        self.memory._dump_snapshot(str(path))
        self.log(f"profiler: CUDA memory snapshot {path}")
        return path

    @contextlib.contextmanager
    def oom_guard(self) -> Iterator[None]:
        """Write `rank<R>_oom.pickle` (once per process) when a CUDA out-of-memory error
        leaves the block, then let the error go on."""
        try:
            yield
        except torch.OutOfMemoryError:
            self.on_oom()
            raise

    def on_oom(self) -> None:
        """Write `rank<R>_oom.pickle`, the first time only (an error passing two guards)."""
        if self.recording_memory and not self._oom_dumped:
            self._oom_dumped = True
            path = self._dump_memory("oom")
            # Printed on every rank: the rank that ran out is the one to look at.
            print(f"rank {self.rank}: CUDA out of memory; allocator snapshot in {path}")

    def close(self) -> None:
        """Stop a trace and the allocator's recording."""
        self.stop()
        if self.recording_memory:
            self.memory._record_memory_history(enabled=None, device=self.device)
            self.recording_memory = False
