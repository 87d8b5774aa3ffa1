"""Which policy version each role may use, in sync and in async mode.

Versions: the trainer's step is the policy version. Version 0 is the starting weights; after
optimizer step s the trainer publishes version s. The trainer holds version s - 1 while it
computes step s.

Synchronous (`SyncSchedule`, strictly on-policy): rollout batch s is generated with exactly
version s - 1, so the generator waits for it, and the trainer waits for batch s from every
generator before step s:

    generator:  get v0 -> batch 1 -> get v1 -> batch 2 -> ...
    trainer:        wait batch 1 -> step 1 -> put v1 -> wait batch 2 -> step 2 -> put v2

Asynchronous (`AsyncSchedule`, bounded staleness): generators never wait for weights; each
produces batches 1, 2, ... with whatever version it holds, switching to newer ones between
decode steps (a sequence may span versions). The trainer's step s takes the next
`generator.count` batches to arrive, from any generators, and keeps the samples whose every
token is at least version s - 1 - max_staleness; the others are dropped and counted:

    generator g:  v0 -> batch 1 (v0) -> batch 2 (v0, v1 mid-way) -> batch 3 (v1) ...
    trainer:          take 1 batch -> step 1 -> put v1 -> take 1 batch -> step 2 -> ...

Both answer the same questions (which version a batch may start from, which tokens are too
old for step s); the trainer's intakes (tidal/rl/distributed/intake.py) ask them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SyncSchedule:
    """Strictly on-policy: batch s from version s - 1 (see the module docstring)."""

    steps: int
    """Optimizer steps of the run (the last version published)."""

    waits_for_weights = True
    """Generators wait for the version a batch needs (sync) or never wait (async)."""

    def version_for_batch(self, batch: int) -> int:
        """The policy version generators must hold to produce rollout batch `batch`; they
        wait for it to be published."""
        assert 1 <= batch <= self.steps, f"batch {batch} outside 1..{self.steps}"
        return batch - 1

    def oldest_version(self, step: int) -> int:
        """The oldest policy version a token trained at `step` may come from."""
        return step - 1

    def stale_tokens(self, versions: torch.Tensor, mask: torch.Tensor, batch: int) -> int:
        """Completion tokens of batch `batch` (`versions` [N, C] where `mask`) generated
        by a version other than the one this schedule allows; the trainer refuses a batch
        with any (nothing off-policy is used silently)."""
        allowed = self.version_for_batch(batch)
        return int(((versions != allowed) & mask).sum())


@dataclass(frozen=True, slots=True)
class AsyncSchedule:
    """Bounded staleness: tokens of step s must come from version s - 1 - max_staleness or
    newer (see the module docstring)."""

    steps: int
    """Optimizer steps of the run (the last version published)."""
    max_staleness: int
    """Versions a token may lag the trainer's current one (>= 0)."""

    waits_for_weights = False

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"rl.max_staleness must be >= 0, got {self.max_staleness}")

    def oldest_version(self, step: int) -> int:
        """The oldest policy version a token trained at `step` may come from."""
        return step - 1 - self.max_staleness

    def staleness(self, versions: torch.Tensor, step: int) -> torch.Tensor:
        """Per token: how many versions it lags the trainer at `step` (version s - 1)."""
        return (step - 1) - versions

    def stale_samples(self, versions: torch.Tensor, mask: torch.Tensor, step: int) -> torch.Tensor:
        """[N] bool: samples with a completion token older than `oldest_version(step)` (or
        unversioned, -1): the trainer drops them. `versions` and `mask` are [N, C]."""
        too_old = (versions < self.oldest_version(step)) & mask
        return too_old.any(dim=1)

    def histogram(self, versions: torch.Tensor, mask: torch.Tensor, step: int) -> list[int]:
        """Completion tokens per staleness 0..max_staleness (of tokens allowed at `step`)."""
        lag = self.staleness(versions, step)[mask]
        lag = lag[(lag >= 0) & (lag <= self.max_staleness)]
        return torch.bincount(lag, minlength=self.max_staleness + 1).tolist()
