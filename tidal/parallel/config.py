"""Configuration of multi-rank layouts and activation checkpointing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PP_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
)


def require(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless ok: the check every config field makes."""
    if not ok:
        raise ValueError(message)


@dataclass(kw_only=True, slots=True)
class ParallelismConfig:
    """How ranks split the work. The degrees must multiply to the world size."""

    dp_replicate: int = 1
    """Data-parallel replicas (HSDP's outer dimension: parameters replicated, gradients
    all-reduced)."""
    dp_shard: int = -1
    """FSDP degree (parameters, gradients and optimizer state sharded); -1 takes the ranks the
    other degrees leave."""
    tp: int = 1
    """Tensor-parallel degree (heads and MLP columns split; sequence parallel in between)."""
    pp: int = 1
    """Pipeline-parallel degree (layers split into stages)."""
    cp: int = 1
    """Context-parallel degree (sequences split across ranks inside attention)."""
    loss_parallel: bool = True
    """With tp > 1, keep the logits sharded over the vocabulary and compute the loss on shards."""
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    """FSDP: free gathered parameters after forward (always), keep them until backward
    (never), or do so for every block but the last (default)."""
    pp_schedule: Literal[
        "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"
    ] = "1F1B"
    """Pipeline schedule; the interleaved, looped and zero-bubble ones put several stages on
    each rank."""
    pp_microbatches: int = 0
    """Micro-batches each local batch is cut into for the pipeline; 0 means one per stage."""
    pp_stages_per_rank: int = 0
    """Model chunks per pipeline rank; 0 derives it from the schedule (1 for GPipe and 1F1B,
    2 for the multi-stage schedules)."""
    pp_split: str = ""
    """Explicit stages: first-layer indices of stages 2..n ("4,8,12" for four stages of 16
    layers), or module lists per stage separated by ';'
    ("tok_embeddings,layers.0,layers.1;layers.2,layers.3,norm,output"). Empty splits the
    layers evenly."""
    cp_load_balance: bool = True
    """Context parallel: give each rank two mirrored chunks so causal work is even."""
    ep: int = 1
    """Expert-parallel degree of a mixture-of-experts model: each routed expert lives on one of
    `ep` ranks, which exchange token copies by all-to-all around the experts. Borrowed from
    `dp_shard` (must divide it): the experts are FSDP-sharded over the remaining
    dp_shard / ep ranks, every other parameter over all dp_shard as usual (tidal/parallel/
    expert.py)."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "cp", "ep"):
            require(
                getattr(self, name) >= 1,
                f"parallelism.{name} must be >= 1, got {getattr(self, name)}",
            )
        require(
            self.dp_shard == -1 or self.dp_shard >= 1,
            f"parallelism.dp_shard must be -1 or >= 1, got {self.dp_shard}",
        )
        require(
            self.reshard_after_forward in ("default", "always", "never"),
            "parallelism.reshard_after_forward must be one of default, always, never; "
            f"got {self.reshard_after_forward!r}",
        )
        require(
            self.pp_schedule in PP_SCHEDULES,
            f"parallelism.pp_schedule must be one of {', '.join(PP_SCHEDULES)}; "
            f"got {self.pp_schedule!r}",
        )
        require(
            self.pp_microbatches >= 0,
            f"parallelism.pp_microbatches must be >= 0, got {self.pp_microbatches}",
        )
        require(
            self.pp_stages_per_rank >= 0,
            f"parallelism.pp_stages_per_rank must be >= 0, got {self.pp_stages_per_rank}",
        )
        if self.pp_split and not any(c.isalpha() for c in self.pp_split):
            try:
                cuts = [int(x) for x in self.pp_split.split(",")]
            except ValueError:
                raise ValueError(
                    f"parallelism.pp_split must be layer indices or module lists, "
                    f"got {self.pp_split!r}"
                ) from None
            require(
                cuts == sorted(set(cuts)) and cuts[0] > 0,
                f"parallelism.pp_split must be strictly increasing positive layer indices, "
                f"got {self.pp_split!r}",
            )

    @property
    def microbatches(self) -> int:
        """Pipeline micro-batches per local batch: as set, or one per stage."""
        return self.pp_microbatches or self.pp * self.stages_per_rank

    @property
    def stages_per_rank(self) -> int:
        if self.pp_stages_per_rank:
            return self.pp_stages_per_rank
        return 1 if self.pp_schedule in ("GPipe", "1F1B") else 2


@dataclass(kw_only=True, slots=True)
class ActivationCheckpointConfig:
    """Recompute activations in backward instead of keeping them."""

    mode: Literal["none", "full", "selective"] = "none"
    """none: keep everything. full: recompute every block. selective: see `selective`."""
    selective: str = "op"
    """With mode=selective: "op" keeps matmul and attention outputs and recomputes the cheap
    element-wise ops; an integer N checkpoints every N-th block fully."""

    def __post_init__(self) -> None:
        require(
            self.mode in ("none", "full", "selective"),
            f"activation_checkpoint.mode must be one of none, full, selective; got {self.mode!r}",
        )
        require(
            self.selective == "op" or (self.selective.isdigit() and int(self.selective) > 0),
            f"activation_checkpoint.selective must be 'op' or a positive integer, "
            f"got {self.selective!r}",
        )
