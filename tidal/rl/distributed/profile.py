"""Traces of `tidal rl`'s roles over one window of RL steps: the `profiler` section
(tidal.train.config.ProfilerConfig, as for `tidal train`) in every role process.

With `--profiler.enable true --profiler.start_step A --profiler.end_step B`, each role writes
a torch.profiler Chrome trace (CPU operators, and CUDA kernels and copies on a GPU) of its
part of steps A..B into a folder of its own under `<output_dir>/<profiler.folder>`:

    trainer/rank<R>_step<A>-<B>.json        the trainer's steps A..B ("train_step N" ranges)
    generator<g>/rank<R>_step<A>-<C>.json   generator g's batches A..C ("batch N" ranges)

A generator's batch N is the rollouts of step N; it is decoded while the trainer is still at
an earlier step (`generator_lag`: one step in sync mode, the queue's slots and the batches in
flight in async mode), so a generator records C = B + that lag batches: its trace covers
the trainer's window in wall-clock time. benchmarks/rl_timeline.py merges the traces into
one timeline, a lane per role, and reports each role's busy and idle time over the window
the traces share.

Inside the steps the roles' timed parts are named ranges (`tidal.rl.report.span`, opened
only while a profiler records): `rl/wait_rollouts`, `rl/train_step`, `rl/publish_weights`
(the trainer), `rl/wait` (for a policy version or a queue slot), `rl/load_weights`,
`rl/generate`, `rl/eval` (a generator).

Each role writes its trace at its end (`RunProfiler(defer=True)`), not inside the run:
writing one holds the GIL for seconds, and the role's heartbeats would stop meanwhile.

Lifecycle: the trainer's profiler is the tidal Trainer's own (`Trainer.profiler`, built from
the `profiler` section that tidal.rl.build.trainer_config points at its folder); a generator
builds one with `generator_profiler`. Either loop calls `start(first)`, `step_begin(n)` and
`step_done(n)` around its steps; `close()` at the end writes the trace.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tidal.rl.config import RLConfig
from tidal.train.profiling import RunProfiler


def generator_lag(cfg: RLConfig) -> int:
    """Steps a generator's batches run ahead of the trainer's step: in sync mode batch N + 1
    decodes while the trainer trains step N; in async mode batch N + slots + in-flight - 1
    does."""
    if cfg.rl.mode == "sync":
        return 1
    return max(1, cfg.queue_slots() + cfg.rl.batches_in_flight - 1)


def generator_profiler(
    cfg: RLConfig, index: int, *, rank: int, device: torch.device, log: Any
) -> RunProfiler:
    """Generator `index`'s profiler (rank `rank` of it): batches start_step..end_step + the
    lag (`generator_lag`), into `<profiler.folder>/generator<index>`."""
    lag = generator_lag(cfg)
    p = dataclasses.replace(
        cfg.profiler,
        folder=cfg.profile_folder(f"generator{index}"),
        end_step=cfg.profiler.end_step + lag,
    )
    return RunProfiler(
        p,
        cfg.job.output_dir,
        rank=rank,
        device=device,
        total_steps=cfg.rl.steps + lag,
        log=log,
        span="batch",
        defer=True,
    )
