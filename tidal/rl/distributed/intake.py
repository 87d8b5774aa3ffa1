"""The trainer's end of the rollouts: which batches each step trains on, from whichever
generators are live (tidal/rl/distributed/membership.py).

Trainer rank 0 chooses and announces its choice under control/intake@step, as (generator,
batch version) pairs; the other ranks read it and fetch the same batches, so every rank
trains on the same rollouts. A batch is read only once its version is committed: a
generator killed while putting one aborts that version, which is never read (the wait
reports it), so no partial rollout is ever used.

- Sync (`take_sync`): step s takes rollouts/<g>@s from every generator announced with
  policy version s - 1; one lost or restarted meanwhile is dropped from the step (reported)
  and the step trains on the others' batches.
- Async (`AsyncIntake`): generator g puts rollouts/<g>@k, k = 1, 2, ... (a generator
  restarted under the same index continues past the numbers its predecessor used); `take`
  returns the next `generator.count` batches to arrive, from any generators, lost ones'
  committed batches included. `mark_taken` (rank 0, once the previous version is committed,
  so that a generator's next batch can start from it) puts control/taken/<g>@k, and g may
  fill the slot again. When every live generator's queue is full of batches taken for this
  step (fewer generators than batches a step: one was lost), they are marked at once, so the
  survivors fill the step.
"""

from __future__ import annotations

import time
from typing import Any

from tidal.rl.config import RLConfig
from tidal.rl.distributed.coupling import INTAKE, Link, NotYet, RoleStopped, rollouts_key, taken_key
from tidal.rl.distributed.membership import Members
from tidal.rl.rollout import RolloutBatch
from tidal.store.errors import KeyNotFoundError


def _announced(link: Link, step: int, main: bool, taken: list[tuple[int, int]]) -> list:
    """Rank 0 puts its choice of step `step`; the other ranks read it."""
    if main:
        link.store.put_state_dict({"batches": [list(x) for x in taken]}, INTAKE, version=step)
        return taken
    chosen = link.wait_version(INTAKE, step, f"trainer rank 0's intake of step {step}")
    return [tuple(x) for x in chosen["batches"]]


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
        self.next: dict[int, int] = {}  # generator -> the lowest batch number not yet taken
        self.first = 0  # the generator asked first: the one after the last taken
        self.latest: dict[int, dict[str, Any]] = {}  # generator -> meta of its latest batch
        self.unmarked: list[tuple[int, int]] = []  # (generator, batch) taken, not yet marked

    def take(self, n: int, step: int) -> list[RolloutBatch]:
        taken: list[tuple[int, int]] = []
        if self.members is not None:
            while len(taken) < n:
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
