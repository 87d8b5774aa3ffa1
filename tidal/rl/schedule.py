"""Which policy version each role may use: the one place the sync/async choice lives.

Versions: the trainer's step is the policy version. Version 0 is the starting weights; after
optimizer step s the trainer publishes version s. Rollout batches are numbered by the step
that trains on them: batch s (s = 1..steps) feeds optimizer step s.

Synchronous (`SyncSchedule`, strictly on-policy): batch s is generated with exactly version
s - 1, so the generator waits for it, and the trainer waits for batch s before step s:

    generator:  get v0 -> batch 1 -> get v1 -> batch 2 -> ...
    trainer:        wait batch 1 -> step 1 -> put v1 -> wait batch 2 -> step 2 -> put v2

The asynchronous loop (the next piece of work) is another schedule with the same two
questions answered differently: a generator may use any version newer than
`s - 1 - max_staleness` (the newest it has, without waiting), and the trainer accepts tokens
whose version is at least `s - 1 - max_staleness`. The loops in tidal/rl/loop.py ask only
these questions, so they need no change for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SyncSchedule:
    """Strictly on-policy: batch s from version s - 1 (see the module docstring)."""

    steps: int
    """Optimizer steps of the run (the last version published)."""

    def version_for_batch(self, batch: int) -> int:
        """The policy version generators must hold to produce rollout batch `batch`; they
        wait for it to be published."""
        assert 1 <= batch <= self.steps, f"batch {batch} outside 1..{self.steps}"
        return batch - 1

    def stale_tokens(self, versions: torch.Tensor, mask: torch.Tensor, batch: int) -> int:
        """Completion tokens of batch `batch` (`versions` [N, C] where `mask`) generated
        by a version other than the one this schedule allows; the trainer refuses a batch
        with any (nothing off-policy is used silently)."""
        allowed = self.version_for_batch(batch)
        return int(((versions != allowed) & mask).sum())
