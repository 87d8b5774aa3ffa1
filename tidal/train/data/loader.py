"""Batches of fixed-length windows cut from a packed token stream.

Shapes: B batch size, T sequence length (`seq_len`).

The stream of N tokens is cut into `num_windows = (N - 1) // T` non-overlapping windows; window
w covers `tokens[w*T : w*T + T + 1]` (inputs are its first T tokens, labels its last T). Epoch
e visits the windows in a permutation seeded by `(seed, e)` (identity when `shuffle=False`),
truncated to a multiple of `dp_world`; data-parallel rank r takes every `dp_world`-th window of
it, so ranks see disjoint windows, and groups them into batches of B, dropping the remainder.
Iteration never ends: after the last batch of an epoch comes the first of the next.

Lifecycle: every rank builds its own loader with the same arguments except `dp_rank` and pulls
batches with `next(loader)`. The position (`state_dict()`) is identical on every rank, so a
checkpoint may store rank 0's copy and every rank may load it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(kw_only=True, slots=True)
class Batch:
    """One batch for next-token prediction."""

    input_ids: torch.Tensor
    """[B, T] int64 token ids."""

    labels: torch.Tensor
    """[B, T] int64, `labels[:, t]` is the token after `input_ids[:, t]`; `IGNORE_INDEX`
    (-100, tidal.train.loss) where excluded (nowhere, for pre-training batches)."""

    document_ids: torch.Tensor
    """[B, T] int32, index of the document each input token belongs to, counted from 0 in each
    row; it increases by one at every BOS after the first position. Tokens attend only within
    their document under document-causal masking."""

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy on `device`."""
        return Batch(
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            document_ids=self.document_ids.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        """A copy in pinned host memory, for `to(device, non_blocking=True)`."""
        return Batch(
            input_ids=self.input_ids.pin_memory(),
            labels=self.labels.pin_memory(),
            document_ids=self.document_ids.pin_memory(),
        )


class PackedLoader:
    """Infinite, resumable, data-parallel iterator of `Batch`es over a packed token stream.

    Args:
        tokens: [N] token ids (any integer dtype; a memory map is fine).
        doc_starts: [num_docs] strictly increasing offsets of each document's first token
            (its BOS), starting at 0; see `tidal.train.data.packing`.
        seq_len: T, tokens per row.
        batch_size: B, rows per batch on this rank.
        seed: seeds the per-epoch window order.
        shuffle: permute windows each epoch; False visits them in stream order every epoch
            (use for validation).
        dp_rank: this rank's index among `dp_world` data-parallel ranks.
        dp_world: number of data-parallel ranks.
        name: split name used in error messages.

    Raises:
        ValueError: the split has fewer than `seq_len + 1` tokens, or fewer windows than
            `batch_size * dp_world`; or bad rank arguments.

    Validation use: `iter_epoch(max_batches=n)` yields the same batches on every call and does
    not move the loader; alternatively `reset()` rewinds the infinite iterator to the start.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        doc_starts: np.ndarray,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        dp_rank: int = 0,
        dp_world: int = 1,
        name: str = "train",
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (it seeds numpy's SeedSequence), got {seed}")
        if dp_world < 1 or not 0 <= dp_rank < dp_world:
            raise ValueError(f"need 0 <= dp_rank < dp_world, got dp_rank={dp_rank}, {dp_world=}")
        tokens = np.asarray(tokens)  # no copy for arrays and memory maps
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"{name}: tokens must have an integer dtype, got {tokens.dtype}")
        doc_starts = np.asarray(doc_starts, dtype=np.int64)
        if tokens.ndim != 1 or doc_starts.ndim != 1:
            raise ValueError(
                f"{name}: tokens and doc_starts must be 1-D, got shapes {tokens.shape} and "
                f"{doc_starts.shape}"
            )
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"{name} split has {len(tokens):,} tokens, fewer than seq_len + 1 = "
                f"{seq_len + 1}; use more data or a shorter seq_len"
                + (" (or a larger DataConfig.val_fraction)" if name == "val" else "")
            )
        if len(doc_starts) == 0 or doc_starts[0] != 0 or np.any(np.diff(doc_starts) <= 0):
            raise ValueError(f"{name}: doc_starts must start at 0 and strictly increase")
        self.tokens = tokens
        self.doc_starts = doc_starts
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.name = name
        # Windows of T + 1 tokens in the stream, all ranks together.
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < batch_size * dp_world:
            raise ValueError(
                f"{name} split has {self.num_windows:,} windows of seq_len={seq_len} "
                f"({len(tokens):,} tokens), fewer than batch_size * dp_world = "
                f"{batch_size} * {dp_world}; use more data, a shorter seq_len or a smaller "
                "batch_size" + (" (or a larger DataConfig.val_fraction)" if name == "val" else "")
            )
        # Batches each rank yields per epoch, len(loader).
        self.batches_per_epoch = self.num_windows // dp_world // batch_size
        self._epoch = 0
        self._batch = 0
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        """Tokens in the whole stream."""
        return len(self.tokens)

    @property
    def tokens_per_epoch(self) -> int:
        """Input tokens all ranks together consume in one epoch."""
        return self.batches_per_epoch * self.batch_size * self.dp_world * self.seq_len

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> Batch:
        batch = self._make_batch(self._rank_windows(self._epoch), self._batch)
        self._batch += 1
        if self._batch == self.batches_per_epoch:
            self._epoch, self._batch = self._epoch + 1, 0
        return batch

    def iter_epoch(self, epoch: int = 0, max_batches: int | None = None) -> Iterator[Batch]:
        """Yield the batches of one epoch (at most `max_batches`) without moving the loader."""
        windows = self._rank_windows(epoch)
        n = self.batches_per_epoch if max_batches is None else min(max_batches, len(self))
        for b in range(n):
            yield self._make_batch(windows, b)

    def reset(self) -> None:
        """Rewind to the first batch of epoch 0."""
        self._epoch, self._batch = 0, 0

    @property
    def epoch(self) -> int:
        """Epoch of the next batch."""
        return self._epoch

    def state_dict(self) -> dict[str, Any]:
        """Position and the settings it is meaningful for; plain ints, JSON-serializable."""
        return {
            "epoch": self._epoch,
            "batch": self._batch,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "dp_world": self.dp_world,
            "num_windows": self.num_windows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the position of `state`; the next batch is the one the saver would yield.

        Raises:
            KeyError: a key is missing.
            ValueError: `state` was taken with other data or settings, where the same position
                would give other batches.
        """
        for key in ("seed", "shuffle", "seq_len", "batch_size", "dp_world", "num_windows"):
            mine = int(getattr(self, key))
            if int(state[key]) != mine:
                raise ValueError(
                    f"{self.name} loader state has {key}={state[key]}, this loader has {mine}; "
                    "resuming would not reproduce the same batches"
                )
        epoch, batch = int(state["epoch"]), int(state["batch"])
        if epoch < 0 or not 0 <= batch < self.batches_per_epoch:
            raise ValueError(
                f"{self.name} loader state has epoch={epoch}, batch={batch}; expected epoch >= 0 "
                f"and 0 <= batch < {self.batches_per_epoch}"
            )
        self._epoch, self._batch = epoch, batch

    def _rank_windows(self, epoch: int) -> np.ndarray:
        """Window indices of `epoch` this rank visits, in order."""
        if epoch != self._order_epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            else:
                order = np.arange(self.num_windows)
            usable = self.num_windows // self.dp_world * self.dp_world
            self._order = order[:usable][self.dp_rank :: self.dp_world]
            self._order_epoch = epoch
        return self._order

    def _make_batch(self, windows: np.ndarray, b: int) -> Batch:
        T = self.seq_len
        starts_B = windows[b * self.batch_size : (b + 1) * self.batch_size].astype(np.int64) * T
        pos_BT1 = starts_B[:, None] + np.arange(T + 1)  # token positions of each window
        window_BT1 = torch.from_numpy(self.tokens[pos_BT1].astype(np.int64))
        # Document index of every input position; subtract the first to count from 0 per row.
        doc_BT = np.searchsorted(self.doc_starts, pos_BT1[:, :T], side="right") - 1
        doc_BT -= doc_BT[:, :1]
        return Batch(
            input_ids=window_BT1[:, :T].contiguous(),
            labels=window_BT1[:, 1:].contiguous(),
            document_ids=torch.from_numpy(doc_BT.astype(np.int32)),
        )
