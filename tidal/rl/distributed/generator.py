"""The generator role (`tidal rl generator --index I`, one process, or each rank of a
tensor-parallel generator: tidal/rl/distributed/generator_ranks.py).

Lifecycle (`run_generator`): builds the model from the policy's architecture in the
generator's layout (tidal.rl.build.build_generator; its weights come from the store only,
each rank reading its own shards), warms up its Generator (compiles and CUDA graphs; its
heartbeats say it is ready only then, so the trainer's steps never wait for them), waits for
`control/start` and runs `generate_loop` (sync) or `generate_loop_async`
(tidal/rl/distributed/async_generator.py); rank 0 alone beats and puts rollouts.

The sync loop, with the trainer's side (tidal/rl/distributed/trainer.py):

    trainer                                           generator g
      put policy@v0                           ---->     wait policy@v0, load it in place
                                                        [g = 0: eval_pass1 of v0 -> eval@0]
      wait rollouts/<g>@1 from every g        <----     sample, grade -> rollouts/<g>@1
      step 1 (GRPO loss) -> put policy@v1     ---->     wait policy@v1, load ...
      ...                                               ...
      wait eval@steps, put control/done                 [g = 0: eval of the last version]

Sampling and grading are tidal/rl/experience.py's, as in tidal/rl/grpo.py. Every wait goes
through `Link.wait` (tidal/rl/distributed/coupling.py): bounded, and stopped early when
another role stops or dies.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import torch

from tidal.models.profiling import span
from tidal.rl.build import (
    build_generator,
    describe_model,
    generator_device,
    generator_dtype,
    make_policy,
    make_task,
    warm_up_generator,
)
from tidal.rl.config import RLConfig
from tidal.rl.distributed.coupling import (
    DONE,
    EVAL,
    MEMBERS,
    POLICY,
    START,
    Leaving,
    Link,
    NotYet,
    RoleStopped,
    generator_name,
    rollouts_key,
    stop_reason,
)
from tidal.rl.distributed.generator_ranks import (
    check_generator_layouts,
    join_generator_group,
    leave_generator_group,
)
from tidal.rl.distributed.membership import share_of
from tidal.rl.experience import Grader, Policy, eval_versions, evaluate, sample_batch
from tidal.rl.report import Timer
from tidal.rl.tasks.base import Task
from tidal.rl.warmstart import PolicySource, resolve_policy
from tidal.store.errors import KeyNotFoundError, StoreError, VersionNotFoundError
from tidal.train.profiling import RunProfiler

Log = Callable[[str], None]


MAX_GENERATORS = 10_000
"""Generator indices are 0..MAX_GENERATORS - 1."""


def run_generator(
    cfg: RLConfig, store: Any, *, index: int, dist_info=None, log: Log = print
) -> None:
    """Generator `index`'s role (in each of its ranks; `dist_info`: torchrun's, for a
    tensor-parallel generator): until the trainer is done."""
    from tidal.parallel.launch import DistInfo

    if not 0 <= index < MAX_GENERATORS:
        raise ValueError(f"--index must be in 0..{MAX_GENERATORS - 1}, got {index}")
    info = dist_info or DistInfo()
    log = log if info.is_main else _quiet
    task = make_task(cfg)
    src = resolve_policy(cfg, log=log)
    device = generator_device(cfg, info.local_rank)
    gpus = torch.cuda.device_count() if device.type == "cuda" else None
    check_generator_layouts(cfg, src.args, cuda_devices=gpus, where=describe_model(src))
    mesh = join_generator_group(cfg, index, info, device)
    try:
        _generate_role(cfg, store, src, task, index=index, info=info, mesh=mesh, log=log)
    finally:
        if mesh is not None:  # the model is gone with _generate_role's frame
            del mesh
            leave_generator_group()


def _generate_role(
    cfg: RLConfig,
    store: Any,
    src: PolicySource,
    task: Any,
    *,
    index: int,
    info: Any,
    mesh: Any,
    log: Log,
) -> None:
    from tidal.rl.distributed.async_generator import generate_loop_async
    from tidal.rl.distributed.generator_ranks import agree_start
    from tidal.rl.distributed.membership import leave
    from tidal.rl.distributed.profile import generator_profiler

    name, main = generator_name(index), info.is_main
    if main:  # the beating rank speaks for the generator
        _check_index_free(store, name, cfg)
    # Beating from the start (alive), ready once warmed up (then the trainer counts it).
    link = Link(store, name, watch=["trainer"], loop=cfg.rl, beat=main, log=log, ready=False)
    link.start()

    def on_sigterm(signum, frame) -> None:  # leave at the next wait (after a batch in progress)
        link.leaving = "it was asked to leave (SIGTERM)"

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    device = generator_device(cfg, info.local_rank)
    profiler = generator_profiler(cfg, index, rank=info.rank, device=device, log=log)
    try:
        gen = build_generator(cfg, src, mesh=mesh, local_rank=info.local_rank)
        warm_up_generator(gen, cfg, index, log=log)
        link.set_ready()
        policy = make_policy(cfg, src, gen)
        start = link.wait("the trainer's start", lambda seconds: _start_of(link, seconds))
        link.follow_run()
        # A generator joining a running job starts from the newest committed version.
        first = max(
            [start["step"], *store.versions(POLICY)] if store.exists(POLICY) else [start["step"]]
        )
        first, link.ident = agree_start(first, link.ident, gen.model)
        where = str(gen.device) if mesh is None else f"{info.world_size} ranks (tp) on {gen.device}"
        share = (
            f"{cfg.prompts_of(index)} prompts a batch"
            if cfg.rl.mode == "async"
            else ("its share of the prompts")
        )
        log(
            f"{name}: on {where} ({generator_dtype(cfg)}), from policy version {first} to "
            f"{cfg.rl.steps}, {share}"
        )
        loop = generate_loop_async if cfg.rl.mode == "async" else generate_loop
        loop(
            policy,
            task,
            link,
            cfg,
            index=index,
            first_step=first,
            log=log,
            main=main,
            profiler=profiler,
        )
        link.wait_version(DONE, 0, "the trainer to finish")
    except Leaving as e:
        log(f"{name}: leaving the job: {e}; the trainer goes on with the others")
        if main:
            leave(link, index, str(e))
    except RoleStopped:
        raise  # another role stopped the run, or the trainer died: nothing to tell
    except BaseException as e:
        # This generator's own failure: it leaves, saying why; the run goes on with the others
        # (and stops, naming this, when too few are left). A rank past the first just ends:
        # torchrun then ends its peers, and the trainer sees the generator lost.
        if main:
            leave(link, index, stop_reason(e, name))
        raise
    finally:
        profiler.close()  # writes a trace the run left inside its window
        signal.signal(signal.SIGTERM, previous)
        link.close()


def _quiet(line: str) -> None:
    """The log of a generator's ranks past the first (rank 0 prints for the generator)."""
    return None


def _start_of(link: Link, seconds: float) -> dict:
    """The run's control/start, once the trainer beats: a control/start left by an earlier
    run on the same store is not this run's (the trainer clears it before it beats)."""
    if not link.beating("trainer"):
        time.sleep(seconds / 4)
        raise NotYet
    return link.store.get_state_dict(START, version=0, wait=seconds)


def _check_index_free(store: Any, name: str, cfg: RLConfig) -> None:
    """Refuse an index whose generator is running: its heartbeat still advances.

    Raises:
        ValueError: naming the index."""
    from tidal.store.errors import KeyNotFoundError, VersionNotFoundError

    key = Link.key(name)
    if not store.exists(key):
        return
    try:
        first = store.versions(key)[-1]
        deadline = time.monotonic() + 2.5 * cfg.rl.heartbeat_s
        while time.monotonic() < deadline:  # two heartbeats: does it still beat?
            if store.versions(key)[-1] != first:
                raise ValueError(
                    f"{name} is already running in this job (its heartbeat "
                    f"{key} advances); give this one another --index"
                )
            time.sleep(cfg.rl.heartbeat_s / 4)
    except (KeyNotFoundError, VersionNotFoundError, IndexError):
        return  # it left meanwhile


# -- the synchronous loop ------------------------------------------------------------------


def generate_loop(
    policy: Policy,
    task: Task,
    link: Link,
    cfg: RLConfig,
    *,
    index: int,
    first_step: int,
    log: Log,
    main: bool = True,
    profiler: RunProfiler | None = None,
) -> None:
    """Generator `index`'s side of the sync loop: for each policy version v from
    `first_step` (the newest committed one for a generator joining late), load it, then
    sample batch v + 1 when the trainer announced this process with v (its share of the
    prompts; tidal/rl/distributed/membership.py), until the last version (which generator 0
    evaluates). A tensor-parallel generator runs it on every rank in lockstep; only its `main`
    rank puts the rollouts and evaluations. `profiler` traces its batches (step v + 1: the
    wait for v, its load and the batch) in a window (tidal/rl/distributed/profile.py)."""
    store, gen, r, steps = link.store, policy.generator, cfg.rollout, cfg.rl.steps
    grader = Grader(task)
    eval_set = task.eval_set(cfg.task.eval_problems, seed=cfg.task.eval_seed) if index == 0 else []
    evals = set(eval_versions(steps, cfg.rl.eval_every))
    timer = Timer()

    def load(version: int) -> tuple[int, dict[str, float]]:
        """Wait for `version` (or a newer one, if it was dropped meanwhile: a generator that
        is not a member falls behind) to be committed (idle), then copy it into the
        parameters. Returns the version loaded and the idle and copy times."""
        with timer("idle_s"):
            version = _wait_policy(link, version)
        with timer("sync_s"):
            store.get_state_dict(POLICY, into=gen.model.state_dict(), version=version)
        gen.version = version
        return version, timer.take("idle_s", "sync_s")

    def maybe_eval(version: int) -> None:
        if index != 0 or version not in evals:
            return
        with span("rl/eval"):
            result = evaluate(
                policy,
                grader,
                eval_set,
                max_new_tokens=r.max_new_tokens,
                log=log,
                label=f"eval of policy version {version}",
            )
        if main:
            store.put_state_dict(result, EVAL, version=version)

    version, member = first_step, None

    def may_leave() -> bool:
        """Asked to leave (SIGTERM), it first makes a batch it was given prompts for with
        the version it is at, or that step would lack its share."""
        try:
            members = store.get_state_dict(MEMBERS, version=version)
        except (KeyNotFoundError, VersionNotFoundError, StoreError):
            return True
        return not any(
            g == index and i == link.ident and n > 0 for g, i, n in members["generators"]
        )

    link.may_leave = may_leave
    if profiler is not None:
        profiler.start(first_step + 1)
    while version < steps or (index == 0 and version == steps):
        if profiler is not None:
            profiler.step_begin(version + 1)
        version, seconds = load(version)
        maybe_eval(version)
        if version >= steps:
            break
        prompts = share_of(link, version, index)
        if (prompts > 0) != member:
            member = prompts > 0
            log(
                f"{generator_name(index)}: "
                + (
                    f"sampling {prompts} prompts a step from policy version {version}"
                    if member
                    else f"joined at policy version {version}; waiting to be given prompts"
                )
            )
        if prompts:
            step = version + 1
            with span("rl/generate"):
                batch = sample_batch(
                    policy,
                    task,
                    grader,
                    cfg,
                    seeds=(r.seed, step, index),
                    n_prompts=prompts,
                    meta={"generator": index, "version": version, **seconds},
                )
            if main:
                store.put_state_dict(batch.to_state_dict(), rollouts_key(index), version=step)
        if profiler is not None:
            profiler.step_done(version + 1)
        version += 1


def _wait_policy(link: Link, version: int) -> int:
    """Wait for policy `version` to be committed; a newer one if `version` is no longer kept."""
    store = link.store

    def attempt(seconds: float) -> int:
        try:
            store.get_state_dict(POLICY, into={}, version=version, wait=seconds)
            return version
        except VersionNotFoundError:
            newest = max(store.versions(POLICY), default=-1)
            if newest > version:
                return newest
            raise

    return link.wait(f"policy version {version}", attempt)
