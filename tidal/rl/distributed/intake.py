"""The trainer's end of the rollouts: which batches each step trains on, from whichever
generators are live (tidal/rl/distributed/membership.py). The one object that owns the choice
of schedule: the trainer's loop (tidal/rl/distributed/trainer.py) asks its intake, built by
`make_intake` from `rl.mode`, and has no sync or async branch of its own.

An intake's lifecycle, in the trainer (every rank; `members` only on rank 0):

    intake = make_intake(link, cfg, members)
    intake.begin(first_step)      # rank 0: wait for the generators (sync: and announce)
    for step in first_step + 1 .. rl.steps:
        parts = intake.take(step)                           # the step's committed batches
        trained, figures = intake.select(concat(parts), parts, step)   # what it trains on
        (wait for the last publish)   intake.committed(step - 1)  # async: free queue slots
        (optimizer step)              intake.publishing(step)     # sync: announce next batch
        (publish version step)

Trainer rank 0 chooses and announces its choice under control/intake@step, as (generator,
batch version) pairs; the other ranks read it and fetch the same batches, so every rank
trains on the same rollouts. A batch is read only once its version is committed: a
generator killed while putting one aborts that version, which is never read (the wait
reports it), so no partial rollout is ever used.

- Sync (`SyncIntake`): step s takes rollouts/<g>@s from every generator announced with
  policy version s - 1; one lost or restarted meanwhile is dropped from the step (reported)
  and the step trains on the others' batches. A token of another policy version than s - 1
  is an error (`SyncSchedule`): nothing off-policy is used silently.
- Async (`AsyncIntake`): generator g puts rollouts/<g>@k, k = 1, 2, ... (a generator
  restarted under the same index continues past the numbers its predecessor used); `take`
  returns the next `generator.count` batches to arrive, from any generators, lost ones'
  committed batches included. `mark_taken` (rank 0, once the previous version is committed,
  so that a generator's next batch can start from it) puts control/taken/<g>@k, and g may
  fill the slot again. When every live generator's queue is full of batches taken for this
  step (fewer generators than batches a step: one was lost), they are marked at once, so the
  survivors fill the step. `select` drops the samples too stale for the step
  (`AsyncSchedule`; a group with one goes whole) and reports the staleness and the
  generators' figures.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tidal.rl.config import RLConfig
from tidal.rl.distributed.coupling import INTAKE, Link, NotYet, RoleStopped, rollouts_key, taken_key
from tidal.rl.distributed.membership import Members
from tidal.rl.distributed.schedule import AsyncSchedule, SyncSchedule
from tidal.rl.rollout import RolloutBatch
from tidal.store.errors import KeyNotFoundError


def _announced(link: Link, step: int, main: bool, taken: list[tuple[int, int]]) -> list:
    """Rank 0 puts its choice of step `step`; the other ranks read it."""
    if main:
        link.store.put_state_dict({"batches": [list(x) for x in taken]}, INTAKE, version=step)
        return taken
    chosen = link.wait_version(INTAKE, step, f"trainer rank 0's intake of step {step}")
    return [tuple(x) for x in chosen["batches"]]


class SyncIntake:
    """sync: the batches of step s from the generators announced with policy version s - 1,
    all of version s - 1 (see the module docstring)."""

    def __init__(self, link: Link, cfg: RLConfig, members: Members | None) -> None:
        self.link, self.cfg, self.members = link, cfg, members
        self.schedule = SyncSchedule(cfg.rl.steps)
        self.announced: list[list[Any]] = []

    def begin(self, first_step: int) -> None:
        """Rank 0: wait for `generator.count` generators, then announce those making batch
        first_step + 1."""
        if self.members is not None:
            self.members.wait_for(self.link, self.cfg.generator.count)
            self.announced = self.members.announce(first_step)

    def take(self, step: int) -> list[RolloutBatch]:
        return take_sync(self.link, self.members, self.announced, step)

    def select(
        self, rollout: RolloutBatch, parts: list[RolloutBatch], step: int
    ) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """The whole rollout, checked to be on-policy; no extra figures.

        Raises:
            RuntimeError: a token of another policy version than step - 1."""
        stale = self.schedule.stale_tokens(rollout.versions, rollout.train_mask, step)
        if stale:
            raise RuntimeError(
                f"step {step}: {stale} rollout tokens come from another policy version than "
                f"{self.schedule.version_for_batch(step)}; sync mode trains only on-policy tokens"
            )
        return rollout, {}

    def committed(self, version: int) -> None:
        """Policy `version` is committed (nothing to do in sync mode)."""

    def publishing(self, version: int) -> None:
        """Rank 0, before publishing `version`: announce the generators that make batch
        version + 1 from it (none after the last)."""
        if self.members is not None and version < self.cfg.rl.steps:
            self.announced = self.members.announce(version)


def take_sync(
    link: Link, members: Members | None, announced: list[list[Any]], step: int
) -> list[RolloutBatch]:
    """Sync: the batches of step `step` from the generators `announced` with version step - 1
    (`members` is None on ranks other than 0, which read rank 0's choice)."""
    store = link.store
    taken: list[tuple[int, int]] = []
    if members is not None:
        pending = {int(g): ident for g, ident, prompts in announced if prompts > 0}

        def attempt(seconds: float) -> None:
            members.poll()
            for g in sorted(pending):
                if store.exists(rollouts_key(g), step):
                    taken.append((g, step))
                    del pending[g]
                elif not members.is_live(g, pending[g]) and _drop(members, g, pending, taken):
                    members.log(
                        f"trainer: step {step} goes on without generator {g}'s "
                        f"batch ({members.why(g)})"
                    )
                    del pending[g]
            if not pending:
                if not taken:
                    members.require(f"waiting for the rollouts of step {step}")
                    why = "; ".join(f"generator {a[0]} {members.why(int(a[0]))}" for a in announced)
                    raise RoleStopped(
                        f"trainer: every generator making step {step}'s batch is gone ({why})"
                    )
                return None
            g = min(pending)
            wait = seconds if len(pending) == 1 else min(seconds, 0.05)
            store.get_state_dict(rollouts_key(g), into={}, version=step, wait=wait)
            raise NotYet  # it is there: taken by the next attempt

        link.wait(f"the rollouts of step {step}", attempt)
    chosen = _announced(link, step, members is not None, sorted(taken))
    return [
        RolloutBatch.from_state_dict(store.get_state_dict(rollouts_key(g), version=k))
        for g, k in chosen
    ]


def _drop(members: Members, g: int, pending: dict[int, str], taken: list) -> bool:
    """Whether step's lost member `g` is dropped now: when others make the step, at once; when
    it is the last, once it is gone for good (a pause of less than rl.dead_after_s is not)."""
    others = bool(taken) or any(members.is_live(h, i) for h, i in pending.items() if h != g)
    return others or members.gone(g, pending[g])


def first_batch(store: Any, index: int) -> int:
    """Async, in generator `index` at its start: the number of its first batch. 1 in a fresh
    run; after a predecessor under the same index, past every number it used (its last
    committed batch + 2: it may have died putting the next one, aborted and never reusable)."""
    try:
        versions = store.versions(rollouts_key(index))
    except KeyNotFoundError:
        return 1
    return (versions[-1] if versions else 0) + 2


class AsyncIntake:
    """async: the trainer's end of the bounded rollout queue (see the module docstring)."""

    def __init__(self, link: Link, cfg: RLConfig, members: Members | None) -> None:
        self.link, self.store, self.members = link, link.store, members
        self.count, self.slots = cfg.generator.count, cfg.queue_slots()
        self.cfg_heartbeat = cfg.rl.heartbeat_s
        self.schedule = AsyncSchedule(cfg.rl.steps, cfg.rl.max_staleness)
        self.dropped_total = 0  # stale samples dropped over the run
        self.next: dict[int, int] = {}  # generator -> the lowest batch number not yet taken
        self.first = 0  # the generator asked first: the one after the last taken
        self.latest: dict[int, dict[str, Any]] = {}  # generator -> meta of its latest batch
        self.unmarked: list[tuple[int, int]] = []  # (generator, batch) taken, not yet marked

    def begin(self, first_step: int) -> None:
        """Rank 0: wait for `generator.count` generators."""
        if self.members is not None:
            self.members.wait_for(self.link, self.count)

    def take(self, step: int) -> list[RolloutBatch]:
        """The next `generator.count` batches to arrive, from any generators."""
        taken: list[tuple[int, int]] = []
        if self.members is not None:
            while len(taken) < self.count:
                g, k = self.link.wait(f"rollouts from any generator for step {step}", self._try)
                taken.append((g, k))
                self.unmarked.append((g, k))
                self.next[g] = k + 1
                self.first = g + 1
        chosen = _announced(self.link, step, self.members is not None, taken)
        out = []
        for g, k in chosen:
            batch = RolloutBatch.from_state_dict(
                self.store.get_state_dict(rollouts_key(g), version=k)
            )
            self.latest[g] = batch.meta
            out.append(batch)
        return out

    def select(
        self, rollout: RolloutBatch, parts: list[RolloutBatch], step: int
    ) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """The samples step `step` may train on (None when none is new enough), and the
        staleness and generator figures of the step (report.ASYNC_FIELDS)."""
        trained, figures = drop_stale(rollout, self.schedule, step)
        self.dropped_total += figures["stale_samples_dropped"]
        figures["stale_samples_dropped_total"] = self.dropped_total
        return trained, figures | self.stats(parts)

    def committed(self, version: int) -> None:
        """Policy `version` is committed: free the queue slots of the batches taken, now, so
        that the generators' next batches start from it."""
        self.mark_taken()

    def publishing(self, version: int) -> None:
        """Nothing to announce: async generators take no turns."""

    def mark_taken(self) -> None:
        if self.members is None:
            return
        for g, k in self.unmarked:
            self.store.put_state_dict({"k": k}, taken_key(g), version=k)
        self.unmarked = []

    def _ready(self, g: int) -> int | None:
        """The lowest committed batch of generator g not yet taken, or None."""
        try:
            versions = self.store.versions(rollouts_key(g))
        except KeyNotFoundError:
            return None
        return next((v for v in versions if v >= self.next.get(g, 1)), None)

    def _try(self, seconds: float) -> tuple[int, int]:
        members = self.members
        assert members is not None
        members.poll()
        known = sorted(members.gens)
        order = sorted(known, key=lambda g: (g < self.first, g))  # round robin from `first`
        for g in order:
            if (k := self._ready(g)) is not None:
                return g, k
        members.require("waiting for rollouts")
        live = members.live()
        if not live:  # one may come back (rl.dead_after_s): ask again
            time.sleep(min(seconds, self.cfg_heartbeat / 4))
            raise NotYet
        held = {g: sum(1 for x, _ in self.unmarked if x == g) for g in (m.index for m in live)}
        if self.unmarked and all(h >= self.slots for h in held.values()):
            self.mark_taken()  # every live queue is full of this step's batches: free them
        g = live[0].index  # none is there: wait a little for one, then ask all again
        wait = seconds if len(live) == 1 else min(seconds, 0.05)
        self.store.get_state_dict(rollouts_key(g), into={}, version=self.next.get(g, 1), wait=wait)
        raise NotYet

    def stats(self, parts: list[RolloutBatch]) -> dict[str, Any]:
        """Generator-side figures of a step: idle share, in-flight swaps, prefetch hits."""
        idle = [p.meta["idle_s"] / max(p.meta["wall_s"], 1e-9) for p in parts]
        hits = sum(m["prefetch_hits"] for m in self.latest.values())
        misses = sum(m["prefetch_misses"] for m in self.latest.values())
        return {
            "generator_idle_frac": sum(idle) / len(idle),
            "weight_swaps_in_flight": sum(p.meta["swaps_in_flight"] for p in parts),
            "prefetch_hit_rate": hits / (hits + misses) if hits + misses else None,
            "prefetch_needed": hits + misses,
            "batches_overlapped": sum(int(p.meta.get("overlapped", False)) for p in parts),
        }


def drop_stale(
    rollout: RolloutBatch, schedule: AsyncSchedule, step: int
) -> tuple[RolloutBatch | None, dict[str, Any]]:
    """The samples step `step` may train on (every token new enough; a group with a stale
    sample goes whole, its baseline needs all of them), and the staleness figures."""
    versions, mask = rollout.versions, rollout.train_mask
    stale_N = schedule.stale_samples(versions, mask, step)
    drop_N = torch.isin(rollout.group_ids, rollout.group_ids[stale_N])
    keep_N = ~drop_N
    kept_v = versions[keep_N][mask[keep_N]]
    info = {
        "stale_samples_dropped": int(drop_N.sum()),
        "stale_dropped_frac": float(drop_N.float().mean()),
        "staleness_hist": schedule.histogram(versions[keep_N], mask[keep_N], step),
        "version_min": int(kept_v.min()) if kept_v.numel() else None,
        "version_max": int(kept_v.max()) if kept_v.numel() else None,
        "samples_trained": int(keep_N.sum()),
    }
    if not bool(keep_N.any()):
        return None, info
    return (rollout if not bool(drop_N.any()) else rollout.select(keep_N)), info


Intake = SyncIntake | AsyncIntake


def make_intake(link: Link, cfg: RLConfig, members: Members | None) -> Intake:
    """The intake of `rl.mode` (`members`: rank 0's, None on the other ranks)."""
    if cfg.rl.mode == "async":
        return AsyncIntake(link, cfg, members)
    assert cfg.rl.mode == "sync", f"unknown rl.mode {cfg.rl.mode!r}"
    return SyncIntake(link, cfg, members)
