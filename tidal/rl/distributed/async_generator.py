"""A generator's side of the async loop (`rl.mode async`): batches 1, 2, ... decoded as one
stream, with weights switched in flight, until the trainer has published its last version.

    trainer                                    generator g
      put policy@v0                     ---->    wait policy@v0 (once); the Stager prefetches
      take batch k, put control/taken/g@k <---   the next versions in the background
      step s, put policy@vs             ---->    (swapped in between decode steps)
                                                 queue slot free -> feed batch k + 1 while
                                                 batch k's last samples still decode
                                                 batch k complete -> grade, put rollouts/g@k

The generator never waits for weights; it waits only for a free slot of its rollout queue
(cfg.queue_slots()) and, at the very start, for version 0. With `batches_in_flight` b
(rl.batches_in_flight), batch k + 1 is fed once batch k + 2 - slots - b has been taken:
b = 2 lets the next batch's groups take the KV-cache rows the current batch's finished
samples free (`Generator.stream`), so the decode batch stays full instead of shrinking to one
batch's longest samples.

Generator 0 evaluates the eval versions it holds at a feed point: it stops feeding, lets the
batches in flight finish on that version (swaps paused), evaluates, and goes on. A
tensor-parallel generator runs this on every rank in lockstep: the `main` rank reads the store
and its decision goes to the others (`follow_main`); the Stager agrees on the swaps; only the
main rank puts rollouts and evaluations.

An environment (tidal/rl/envs) is played a batch at a time: once its queue slot is free, the
batch's trajectories run to their end (`sample_env_batch`) and it is put under the same key.
Between rounds of turns the generator swaps in the newest version staged, without waiting
(`Feed.between_rounds`; no swaps within a turn), so a trajectory may span versions, each
sampled token stamped with the version that sampled it (observations: -1, masked out of the
loss); a trajectory continued from its cache row keeps the keys and values the older version
wrote, as a single-turn sequence does after an in-flight swap. Batches do not overlap:
`batches_in_flight` counts as 1.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tidal.generate import Generator
from tidal.rl.config import RLConfig
from tidal.rl.distributed.coupling import (
    EVAL,
    POLICY,
    Link,
    generator_name,
    rollouts_key,
    taken_key,
)
from tidal.rl.distributed.generator_ranks import follow_main
from tidal.rl.distributed.intake import first_batch
from tidal.rl.distributed.prefetch import Stager
from tidal.rl.envs import Env, sample_env_batch
from tidal.rl.experience import (
    Grader,
    Log,
    Policy,
    batch_requests,
    eval_versions,
    evaluate,
    graded_batch,
)
from tidal.rl.report import Timer
from tidal.rl.tasks.base import Problem, Task
from tidal.store.errors import KeyNotFoundError
from tidal.train.profiling import RunProfiler

# The main rank's decision at a feed point, shared with the other ranks of a TP generator.
_WAIT, _FEED, _OVER = 0, 1, 2

_ASK_EVERY_S = 0.005
"""While batches decode, the store is asked about the queue at most this often (each ask is a
round trip; decoding goes on meanwhile)."""


@dataclass
class _Fed:
    """A batch fed to the stream and not yet complete."""

    number: int
    problems: list[Problem]
    version: int
    overlapped: bool
    """Fed while an earlier batch was still decoding."""


@dataclass
class Feed:
    """The stream's feed (see the module docstring): decides at each feed point whether the
    next batch may start, and keeps the figures each completed batch reports."""

    policy: Policy
    task: Task
    link: Link
    cfg: RLConfig
    stager: Stager
    index: int
    main: bool
    number: int
    """The last batch number fed (the next one is number + 1)."""
    first: int
    """This generator's first batch number (1, or past a predecessor's under this index)."""
    first_step: int
    """The policy version it started from (part of every batch's seed)."""
    log: Log
    evals: set[int]
    evaluated: set[int] = field(default_factory=set)
    over: bool = False
    """The trainer has published its last version: no more batches are needed."""
    eval_due: int | None = None
    """The version to evaluate once the batches in flight are done."""
    fed: deque[_Fed] = field(default_factory=deque)
    timer: Timer = field(default_factory=Timer)
    """Since the last batch completed: "idle_s" waiting for a queue slot (or, for the first
    batch, the first version), "eval_s" evaluating (not part of the next batch's time)."""
    since: float = field(default_factory=time.perf_counter)
    asked: float = 0.0  # when the store was last asked about the queue while decoding
    swaps: int = 0
    swap_s: float = 0.0
    torn: int = 0
    profiler: RunProfiler | None = None
    """Traces the batches of a window (tidal/rl/distributed/profile.py): batch N's step
    ends when it is complete, and batch N + 1's begins."""

    def __call__(self, idle: bool) -> Any:
        seeds = self.start_batch(idle)
        if seeds is None or seeds is Generator.END:
            return seeds
        problems, prompts, params = batch_requests(
            self.policy, self.task, self.cfg, seeds, self.cfg.prompts_of(self.index)
        )
        self.fed[-1].problems = problems
        return prompts, params

    def start_batch(self, idle: bool) -> Any:
        """At a feed point: the next batch's seeds (it is then counted as fed, at the version
        held), None for "not yet", or `Generator.END` (the run is over, or an evaluation is
        due: `eval_due`)."""
        gen, cfg = self.policy.generator, self.cfg
        decision = self._decide(idle) if self.main else _WAIT
        decision = follow_main(decision, gen.model)
        if decision == _OVER:
            self.over = True
            return Generator.END
        if decision == _WAIT:
            return None
        swapped = self.stager.at_batch_start()
        if swapped is not None:
            gen.version = swapped
        self._report_torn()
        version = gen.version
        assert version is not None
        if self.index == 0 and version in self.evals and version not in self.evaluated:
            self.eval_due, gen.swap_hook = version, None  # finish the batches in flight on it
            return Generator.END
        self.number += 1
        self.fed.append(_Fed(self.number, [], version, overlapped=bool(self.fed)))
        return (cfg.rollout.seed, self.first_step, self.number, self.index)

    def between_rounds(self) -> None:
        """An environment's batch, between rounds of turns: switch to the newest version
        staged, without waiting (the next turns' tokens carry it)."""
        swapped = self.stager.swap()
        if swapped is not None:
            self.policy.generator.version = swapped

    def _decide(self, idle: bool) -> int:
        """The main rank's answer at a feed point: feed the next batch when its queue slot is
        free; when nothing is in flight, wait for the slot (idle time, bounded by
        rl.wait_timeout_s); stop once the trainer has published its last version."""
        store, steps = self.link.store, self.cfg.rl.steps
        # an environment's batches are played one at a time (_play_env_batch)
        in_flight = 1 if isinstance(self.task, Env) else self.cfg.rl.batches_in_flight
        must_be_taken = self.number + 2 - self.cfg.queue_slots() - in_flight
        taken = must_be_taken if must_be_taken >= self.first else 0
        if not idle:
            if taken > self.fed[0].number - 1:
                return _WAIT  # the batch to be taken is still decoding here
            now = time.perf_counter()
            if now - self.asked < _ASK_EVERY_S:
                return _WAIT  # decoding goes on; ask the store again in a moment
            self.asked = now
            if store.exists(POLICY, steps):
                return _OVER
            return _FEED if _slot_free(store, self.index, taken) else _WAIT
        with self.timer("idle_s"):
            free = _queue_slot(self.link, self.index, taken, steps)
        return _FEED if free else _OVER

    def _report_torn(self) -> None:
        for aborted, why in self.stager.torn[self.torn :]:
            self.log(
                f"{generator_name(self.index)}: policy version {aborted} was never "
                f"completely written ({why}); keeping version "
                f"{self.policy.generator.version}"
            )
        self.torn = len(self.stager.torn)

    def completed(self) -> tuple[_Fed, dict[str, Any]]:
        """The oldest batch in flight, now complete, and its figures: `wall_s` since the last
        batch completed (evaluations meanwhile left out), of which `idle_s` waiting for a
        queue slot and `gen_s` the rest; the in-flight swaps and the time blocked in them
        (`sync_s`) meanwhile."""
        now, st = time.perf_counter(), self.stager
        idle_s, eval_s = self.timer.take("idle_s", "eval_s").values()
        wall = now - self.since - eval_s
        meta = {
            "generator": self.index,
            "version": self.fed[0].version,
            "idle_s": idle_s,
            "wall_s": wall,
            "gen_s": wall - idle_s,
            "swaps_in_flight": st.swaps - self.swaps,
            "sync_s": st.swap_s - self.swap_s,
            "prefetch_hits": st.hits,
            "prefetch_misses": st.misses,
            "overlapped": self.fed[0].overlapped,
        }
        self.since, self.swaps, self.swap_s = now, st.swaps, st.swap_s
        fed = self.fed.popleft()
        if self.profiler is not None:
            self.profiler.step_done(fed.number)
            self.profiler.step_begin(fed.number + 1)
        return fed, meta


def generate_loop_async(
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
    """Generator `index`'s side of the async loop (see the module docstring); `profiler`
    traces the batches of a window (tidal/rl/distributed/profile.py)."""
    store, gen, steps = link.store, policy.generator, cfg.rl.steps
    grader = Grader(task)
    eval_set = task.eval_set(cfg.task.eval_problems, seed=cfg.task.eval_seed) if index == 0 else []
    key, keep = rollouts_key(index), cfg.queue_slots() + cfg.rl.batches_in_flight + 1

    def load_exactly(version: int) -> None:
        link.wait_version(POLICY, version, f"policy version {version}", into={})
        store.get_state_dict(POLICY, into=gen.model.state_dict(), version=version)
        gen.version = version

    def evaluate_held(feed: Feed, version: int) -> None:
        """Score the version held; swaps are off (the feed paused them, or the stream ended)."""
        assert gen.swap_hook is None and gen.version == version, (gen.version, version)
        with feed.timer("eval_s"):  # not counted as the next batch's time
            result = evaluate(
                policy,
                grader,
                eval_set,
                log=log,
                max_new_tokens=cfg.rollout.max_new_tokens,
                label=f"eval of policy version {version}",
            )
            if main:
                store.put_state_dict(result, EVAL, version=version)
        feed.evaluated.add(version)

    since = time.perf_counter()  # the first batch's wall time includes the first wait
    timer = Timer()
    with timer("idle_s"):
        load_exactly(first_step)
    # GPU slots when the versions live in the trainer's GPU memory (read device to device).
    on_device = gen.device.type == "cuda" and cfg.store.policy_memory == "cuda"
    stager = Stager(
        store,
        POLICY,
        gen.model.state_dict(),
        held=first_step,
        last=steps,
        slice_s=cfg.rl.heartbeat_s,
        on_device=on_device,
    )
    first = first_batch(store, index)
    feed = Feed(
        policy=policy,
        task=task,
        link=link,
        cfg=cfg,
        stager=stager,
        index=index,
        main=main,
        number=first - 1,
        first=first,
        first_step=first_step,
        log=log,
        evals=set(eval_versions(steps, cfg.rl.eval_every)),
        timer=timer,
        since=since,
        profiler=profiler,
    )
    if profiler is not None:
        profiler.start(first)
        profiler.step_begin(first)
    stager.start()
    try:
        while not feed.over:
            if isinstance(task, Env):
                _play_env_batch(feed, task, key, keep)
            else:
                gen.swap_hook = stager.swap
                for groups in gen.stream(feed):
                    fed, meta = feed.completed()
                    batch = graded_batch(policy, task, grader, fed.problems, groups, meta)
                    if main:
                        store.put_state_dict(
                            batch.to_state_dict(), key, version=fed.number, keep=keep
                        )
            if feed.eval_due is not None:
                evaluate_held(feed, feed.eval_due)
                feed.eval_due = None
    finally:
        gen.swap_hook = None
        stager.close()
    if index == 0 and steps in feed.evals and steps not in feed.evaluated:
        load_exactly(steps)
        evaluate_held(feed, steps)


def _play_env_batch(feed: Feed, env: Env, key: str, keep: int) -> None:
    """An environment's next batch, played whole (`sample_env_batch`) once its queue slot is
    free, and put as a single-turn batch is. Its weights switch between rounds of turns
    (`Feed.between_rounds`), never within a turn: a trajectory may span versions, each
    token stamped with the version that sampled it. Returns at once when the run is over or
    an evaluation is due (`feed.over`, `feed.eval_due`)."""
    seeds = feed.start_batch(idle=True)  # waits (bounded) for the slot: never None
    if seeds is Generator.END:
        return
    assert seeds is not None
    batch = sample_env_batch(
        feed.policy,
        env,
        feed.cfg,
        seeds=seeds,
        n_prompts=feed.cfg.prompts_of(feed.index),
        between_rounds=feed.between_rounds,
    )
    fed, meta = feed.completed()
    batch.meta.update(meta)  # the loop's timings and swaps replace the driver's gen_s
    if feed.main:
        feed.link.store.put_state_dict(batch.to_state_dict(), key, version=fed.number, keep=keep)


def _slot_free(store: Any, index: int, taken: int) -> bool:
    """Whether the trainer has taken batch `taken` of generator `index`, without waiting."""
    if taken <= 0 or store.exists(taken_key(index), taken):
        return True
    with contextlib.suppress(KeyNotFoundError, IndexError):
        return store.versions(taken_key(index))[-1] >= taken
    return False


def _queue_slot(link: Link, index: int, taken: int, steps: int) -> bool:
    """Wait until the trainer has taken batch `taken` of generator `index` (its queue has a
    free slot); False when the trainer has published its last version instead."""
    store = link.store

    def attempt(seconds: float) -> bool:
        if store.exists(POLICY, steps):
            return False
        if _slot_free(store, index, taken):
            return True
        store.get_state_dict(taken_key(index), into={}, version=taken, wait=seconds)
        return True

    return link.wait(f"a free slot of generator {index}'s rollout queue", attempt)
