"""The trainer role (`tidal rl trainer`, every rank under torchrun): the loop's trainer side
over the store.

Lifecycle (`run_trainer`): builds the tidal Trainer (tidal.rl.build.build_trainer: no data
pipeline, the warm start loaded through the checkpoint code), clears an earlier run's keys,
announces the first step (`control/start`), publishes version 0 and runs `train_loop`; rank 0
logs (tidal/rl/report.py).

    trainer                                           generator g (sync)
      put policy@v0                           ---->     wait policy@v0, load it in place
      wait rollouts/<g>@1 from every g        <----     sample, grade -> rollouts/<g>@1
      step 1 (GRPO loss) -> put policy@v1     ---->     wait policy@v1, load ...
      ...                                               ...
      wait eval@steps, put control/done                 [g = 0: eval of the last version]

Which batches a step trains on is the intake's answer (tidal/rl/distributed/intake.py). In
async mode (`rl.mode async`) the generator runs `generate_loop_async`: it never waits for
weights (a `Stager` prefetches them and `Generator.swap_hook` switches them between decode
steps) and waits only for a free slot of the bounded rollout queue; the trainer takes the
next `generator.count` batches to arrive, drops samples older than the schedule allows and
trains on the rest with the loss's per-token correction:

    trainer                                           generator g (async)
      put policy@v0                           ---->     wait policy@v0 (once), prefetch thread
      take the next batches, put control/taken/<g> <--  [queue slot free] rollouts/<g>@k
      drop stale samples, step s, put policy@vs ---->   (swapped in between decode steps)

The step itself (advantages, loss, optimizer step) is tidal/rl/grpo.py's, through the same
functions. Every wait goes through `Link.wait` (tidal/rl/distributed/coupling.py): bounded,
and stopped early when another role stops or dies.

Timing reported per step (metrics.jsonl, docs/rl.md): `sync_trainer_s` is the time the
trainer was blocked publishing (the `put_state_dict_async` call and, before the next
optimizer step, waiting for that put to finish reading the weights); `sync_generator_s` is
the longest time a generator was blocked copying a committed version into its parameters.
Waiting for the other role to produce something is idle time, reported apart
(`trainer_idle_s`, `generator_idle_s`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tidal.rl.build import (
    build_trainer,
    check_task_text,
    make_task,
    publish_dtype,
    reference_weights,
    trainer_seq_len,
    trainer_weights,
)
from tidal.rl.config import RLConfig
from tidal.rl.distributed.coupling import DONE, EVAL, POLICY, START, Link, NotYet, stop_reason
from tidal.rl.distributed.intake import make_intake
from tidal.rl.distributed.membership import Members
from tidal.rl.experience import eval_versions
from tidal.rl.loss import Advantages, group_advantages
from tidal.rl.report import Timer, env_figures, eval_record, step_record
from tidal.rl.rollout import RolloutBatch
from tidal.rl.trainer_inputs import PolicyLoss, set_step_lr, train_on_rollout
from tidal.rl.warmstart import resolve_policy

Log = Callable[[str], None]


def run_trainer(cfg: RLConfig, store: Any, *, dist_info=None, log: Log = print) -> dict:
    """The trainer role (every rank). Returns the summary rank 0 printed ({} on others)."""
    import torch.distributed as dist

    from tidal.parallel.launch import DistInfo
    from tidal.rl.report import Report, check_resume_step

    info = dist_info or DistInfo()
    main = info.is_main
    src = resolve_policy(cfg, log=log)
    check_task_text(cfg, src, make_task(cfg))
    # The generators are members that come and go (tidal/rl/distributed/membership.py), not
    # watched roles.
    link = Link(store, "trainer", watch=[], loop=cfg.rl, beat=main, log=log)
    trainer = build_trainer(cfg, src, dist_info=info, log=log)
    report = None
    members: Members | None = None
    try:
        first = trainer.step
        check_resume_step(cfg, first)  # a role started on its own: `tidal rl` checked this
        barrier = dist.new_group(backend="gloo") if info.world_size > 1 else None
        if main:
            _clear_run(store)
            link.start()
        if barrier is not None:
            dist.barrier(group=barrier)
        dtype, writers = publish_dtype(cfg), info.world_size
        memory = cfg.store.policy_memory
        if memory == "auto":  # `tidal rl` resolves it for the roles it starts
            memory = "cuda" if trainer.device.type == "cuda" and not cfg.store.address else "host"

        def publish(version: int):
            future = store.put_state_dict_async(
                trainer_weights(trainer),
                POLICY,
                version=version,
                writers=writers,
                dtype=dtype,
                memory=memory,
            )

            def stop_on_failure(f) -> None:
                # The loop reads the put's result only after the next rollouts, which the
                # generators cannot make without this version: stop every role now, naming
                # the error, instead of all of them waiting out rl.wait_timeout_s.
                if not f.cancelled() and f.exception() is not None:
                    e = f.exception()
                    link.stop(
                        f"the trainer (rank {info.rank}) failed to publish policy "
                        f"version {version}: {type(e).__name__}: {e}"[:500]
                    )

            future.add_done_callback(stop_on_failure)
            return future

        dp_rank = trainer.mesh["dp"].get_local_rank() if trainer.mesh is not None else 0
        members = Members(store, cfg, log=log) if main else None
        side = TrainerSide(
            trainer=trainer,
            publish=publish,
            dp_rank=dp_rank,
            dp_world=trainer.dims.dp,
            is_main=main,
            seq_len=trainer_seq_len(cfg, src) if trainer.dims.pp > 1 else None,
            reference=reference_weights(trainer, cfg),
            members=members,
        )
        if members is not None:
            members.start()
        if main:
            report = Report(cfg, first_step=first, resumed=first > 0, log=log)
            store.put_state_dict({"step": first, "steps": cfg.rl.steps}, START, version=0)
            link.follow_run()
            log(
                f"trainer: {src.describe}; steps {first + 1}..{cfg.rl.steps}, "
                f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} samples a "
                f"step over {cfg.generator.count} generator(s), {cfg.rl.mode} mode"
                + (
                    f" (max_staleness {cfg.rl.max_staleness}, queue {cfg.queue_slots()} "
                    f"batch(es) per generator, {cfg.rl.batches_in_flight} in flight)"
                    if cfg.rl.mode == "async"
                    else ""
                )
            )
        train_loop(
            side, link, cfg, first_step=first, log_record=report.log if report else lambda r: None
        )
        summary = report.finish() if report else {}
        if main:
            store.put_state_dict({"ok": True}, DONE, version=0)
        return summary
    except BaseException as e:
        if main:
            link.stop(stop_reason(e, "the trainer"))
        raise
    finally:
        if members is not None:
            members.close()
        if report is not None:
            report.close()
        link.close()
        trainer.close()


def _clear_run(store: Any) -> None:
    """Delete an earlier run's keys (one run per store at a time)."""
    for key in store.keys():
        if key == POLICY or key.startswith(("rollouts/", "control/")) or key == "eval":
            store.delete(key)


@dataclass(kw_only=True)
class TrainerSide:
    """The trainer role's pieces the loop uses (built by tidal/rl/distributed/launch.py)."""

    trainer: Any
    """tidal.train.trainer.Trainer, built without a data pipeline."""
    publish: Callable[[int], Any]
    """Starts publishing the current weights as a version; returns a Future."""
    dp_rank: int
    dp_world: int
    seq_len: int | None
    """Fixed T of every trainer batch (pipeline parallel), or None."""
    is_main: bool = True
    """Global rank 0: it chooses the rollouts of each step for every rank."""
    members: Members | None = None
    """The generators in the job (rank 0 only; tidal/rl/distributed/membership.py)."""
    reference: list[torch.Tensor] | None = None
    """The frozen reference weights (a copy of the trainer's parameters at the start) when
    `loss.kl_coef` > 0, else None."""


def train_loop(
    side: TrainerSide,
    link: Link,
    cfg: RLConfig,
    *,
    first_step: int,
    log_record: Callable[[dict[str, Any]], None],
) -> None:
    """The trainer's side of the loop: steps first_step + 1 .. rl.steps, publishing each
    version, then waiting for the last evaluation. `log_record` gets one record per step and
    one per evaluation (rank 0 writes them). Which rollouts a step takes is the intake's
    choice (sync or async: tidal/rl/distributed/intake.py); the step is grpo.py's."""
    trainer, timer = side.trainer, Timer()
    intake = make_intake(link, cfg, side.members)
    # With a correction the PPO ratio is taken against the trainer's own policy at the
    # step's start: one optimizer step per batch, so that is this step's forward (detached).
    loss = PolicyLoss(cfg.loss, old_is_current=cfg.loss.corrects)
    evals = [v for v in eval_versions(cfg.rl.steps, cfg.rl.eval_every) if v >= first_step]
    intake.begin(first_step)
    # --profiler.enable: this role's trace of its steps (tidal/rl/distributed/profile.py);
    # Trainer.close ends one the run left inside the window.
    profiler = trainer.profiler
    profiler.defer = True  # written at the end: writing holds the GIL, heartbeats included
    profiler.start(first_step + 1)
    start = time.perf_counter()
    with timer("sync_trainer_s"):
        future = side.publish(first_step)
    step_end = time.perf_counter()
    for step in range(first_step + 1, cfg.rl.steps + 1):
        profiler.step_begin(step)
        with timer("trainer_idle_s"):
            parts = intake.take(step)
        rollout = RolloutBatch.concat(parts)
        trained, figures = intake.select(rollout, parts, step)
        adv = (
            None
            if trained is None
            else group_advantages(trained.rewards, trained.group_ids, cfg.loss)
        )
        with timer("sync_trainer_s"):
            future.result()  # the last put read the weights: the optimizer may change them now
        intake.committed(step - 1)
        lr = set_step_lr(trainer, cfg, step)
        with profiler.oom_guard(), timer("train_s"):
            metrics, tokens, positions = _train(side, trained, adv, loss, cfg)
        trainer.step = step
        intake.publishing(step)
        with timer("sync_trainer_s"):
            future = side.publish(step)
        trainer.checkpoint.maybe_save(step, cfg.rl.steps)
        now = time.perf_counter()
        seconds = timer.take("sync_trainer_s", "trainer_idle_s", "train_s")
        record = step_record(cfg, step, rollout, adv, metrics) | _process_figures(
            parts, side.members, seconds, tokens, positions, now - step_end
        )
        step_end = now
        log_record(record | {"lr": lr, "elapsed_s": now - start} | figures)
        evals = _log_evals(link.store, evals, step, log_record)
        profiler.step_done(step)
    future.result()
    trainer.checkpoint.finish()
    if side.members is not None:  # the other ranks log nothing
        _log_last_eval(link, side.members, evals, cfg.rl.steps, log_record)


def _train(
    side: TrainerSide,
    trained: RolloutBatch | None,
    adv: Advantages | None,
    loss: PolicyLoss,
    cfg: RLConfig,
) -> tuple[dict[str, float], int, int]:
    """The step's optimizer step on this rank's share of the rollout (`train_on_rollout`);
    nothing when no sample is left to train on."""
    if trained is None or adv is None:
        return {}, 0, 0
    return train_on_rollout(
        side.trainer,
        trained,
        adv,
        loss,
        micro_batch_size=cfg.trainer.micro_batch_size,
        seq_len=side.seq_len,
        dp_rank=side.dp_rank,
        dp_world=side.dp_world,
        reference=side.reference,
    )


def _process_figures(
    parts: list[RolloutBatch],
    members: Members | None,
    seconds: dict[str, float],
    tokens: int,
    positions: int,
    step_s: float,
) -> dict[str, Any]:
    """A step's figures of the processes (docs/rl.md, "What the user sees"): which generators
    made its batches and how fast, the trainer's speed, the time each role was blocked
    synchronizing weights or idle waiting for the other (`seconds`: the trainer's), and the
    grader's errors."""
    meta = [p.meta for p in parts]
    gen_s, train_s, idle_s = (
        max(m["gen_s"] for m in meta),
        seconds["train_s"],
        seconds["trainer_idle_s"],
    )
    errors = [m["grader_error"] for m in meta if m["grader_error"]]
    figures: dict[str, Any] = {
        "samples_per_generator": [p.num_samples for p in parts],
        "generators": [m["generator"] for m in meta],
        **(
            {"generators_live": len(members.live()), "generators_lost": members.lost}
            if members is not None
            else {}
        ),
        "grader_errors": sum(m["grader_errors"] for m in meta),
        "tokens_per_s_gen": sum(m["gen_tokens"] for m in meta) / max(gen_s, 1e-9),
        "tokens_per_s_train": tokens / max(train_s, 1e-9) if tokens else 0.0,
        "train_pad_frac": 1.0 - tokens / positions if positions else 0.0,
        "sync_trainer_s": seconds["sync_trainer_s"],
        "sync_generator_s": max(m["sync_s"] for m in meta),
        "trainer_idle_s": idle_s,
        "trainer_idle_frac": idle_s / max(step_s, 1e-9),
        "generator_idle_s": max(m["idle_s"] for m in meta),
        "gen_s": gen_s,
        "train_s": train_s,
        **env_figures(parts),
    }
    if figures["grader_errors"]:
        figures["grader_error"] = errors[0] if errors else ""
    return figures


def _log_last_eval(
    link: Link, members: Members, pending: list[int], steps: int, log_record: Callable
) -> None:
    """Generator 0 scores the eval versions it held (all of them in sync mode, unless it
    joined late); the trainer waits only for the last version's, while generator 0 lives."""
    pending = _log_evals(link.store, pending, steps, log_record)
    if steps in pending and (result := _wait_eval(link, members, steps)) is not None:
        log_record(eval_record(steps, result))


def _wait_eval(link: Link, members: Members, version: int) -> dict[str, Any] | None:
    """The evaluation of `version` from generator 0, or None (said) once it is gone."""
    store = link.store

    def attempt(seconds: float) -> dict[str, Any] | None:
        members.poll()
        if store.exists(EVAL, version):
            return store.get_state_dict(EVAL, version=version)
        if not any(m.index == 0 for m in members.live()):
            members.log(
                f"trainer: no evaluation of policy version {version}: generator 0, "
                f"which evaluates, is gone"
            )
            return None
        store.get_state_dict(EVAL, into={}, version=version, wait=seconds)
        raise NotYet

    return link.wait(f"the evaluation of policy version {version}", attempt)


def _log_evals(store: Any, pending: list[int], step: int, log_record: Callable) -> list[int]:
    """Log the evaluations that have arrived (of versions < step: the one of `step` is in
    the making); returns those still pending."""
    left = []
    for v in pending:
        if v < step and store.exists(EVAL, v):
            log_record(eval_record(v, store.get_state_dict(EVAL, version=v)))
        else:
            left.append(v)
    return left
