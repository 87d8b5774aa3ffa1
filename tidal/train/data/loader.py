"""Batches of fixed-length windows cut from a packed token stream.

Shapes: B batch size, T sequence length (`seq_len`).

The stream of N tokens is cut into `num_windows = (N - 1) // T` non-overlapping windows; window
w covers `tokens[w*T : w*T + T + 1]` (inputs are its first T tokens, labels its last T). Epoch
e visits the windows in a permutation seeded by `(seed, e)` (identity when `shuffle=False`),
truncated to a multiple of `dp_world`; data-parallel rank r takes every `dp_world`-th window of
it, so ranks see disjoint windows, and groups them into batches of B, dropping the remainder.
Iteration never ends: after the last batch of an epoch comes the first of the next.

With a `loss_mask` (chat samples laid out in rows by `packing.pack_rows`), a label is kept only
where the mask of the token it predicts is 1 and is `IGNORE_INDEX` elsewhere.

`InterleavedLoader` mixes several sources' windows row by row, each row drawn from a source
with probability proportional to its weight (see its docstring for epochs and resuming).

Lifecycle: every rank builds its own loader with the same arguments except `dp_rank` and pulls
batches with `next(loader)`. The position (`state_dict()`) is identical on every rank, so a
checkpoint may store rank 0's copy and every rank may load it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tidal.train.loss import IGNORE_INDEX


@dataclass(kw_only=True, slots=True)
class Batch:
    """One batch for next-token prediction.

    Example (a batch built by hand, with a per-row and a per-token extra for an injected
    loss, see tidal/train/loss.py)::

        ids = torch.randint(0, 512, (2, 9))
        batch = Batch(input_ids=ids[:, :-1], labels=ids[:, 1:],
                      document_ids=torch.zeros(2, 8, dtype=torch.int32),
                      extras={"advantages": torch.tensor([1.0, -1.0]),
                              "old_logprobs": torch.zeros(2, 8)})
    """

    input_ids: torch.Tensor
    """[B, T] int64 token ids."""

    labels: torch.Tensor
    """[B, T] int64, `labels[:, t]` is the token after `input_ids[:, t]`; `IGNORE_INDEX`
    (-100, tidal.train.loss) where excluded (nowhere for pre-training batches; prompts and
    padding for chat batches)."""

    document_ids: torch.Tensor
    """[B, T] int32, index of the document each input token belongs to, counted from 0 in each
    row; it increases by one at every BOS after the first position. Tokens attend only within
    their document under document-causal masking."""

    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-row [B, ...] or per-token [B, T, ...] tensors for an injected loss (advantages, old
    log-probs, masks), by name; empty for language-model batches. They move with `to` and
    `pin_memory` and are sliced with the rows (`row_slice`: pipeline micro-batches)."""

    def __post_init__(self) -> None:
        B = self.input_ids.shape[0]
        for name, t in self.extras.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != B:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"Batch.extras[{name!r}] must be a tensor with the batch's {B} rows in its "
                    f"first dimension, got {got}"
                )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy on `device`."""
        return Batch(
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            document_ids=self.document_ids.to(device, non_blocking=non_blocking),
            extras={k: v.to(device, non_blocking=non_blocking) for k, v in self.extras.items()},
        )

    def pin_memory(self) -> Batch:
        """A copy in pinned host memory, for `to(device, non_blocking=True)`."""
        return Batch(
            input_ids=self.input_ids.pin_memory(),
            labels=self.labels.pin_memory(),
            document_ids=self.document_ids.pin_memory(),
            extras={k: v.pin_memory() for k, v in self.extras.items()},
        )

    def target_count(self) -> int:
        """Labels that are not IGNORE_INDEX: the `n_tokens` of `Trainer.train_step` (count
        it before moving the batch to a GPU, so the step needs no device sync)."""
        return int((self.labels != IGNORE_INDEX).sum())

    def row_slice(self, start: int, stop: int) -> Batch:
        """Rows start..stop-1 of every tensor, extras included (views, no copy)."""
        return Batch(
            input_ids=self.input_ids[start:stop],
            labels=self.labels[start:stop],
            document_ids=self.document_ids[start:stop],
            extras={k: v[start:stop] for k, v in self.extras.items()},
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
        loss_mask: [N] 0/1 per token (1: a training target), or None for all tokens.

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
        loss_mask: np.ndarray | None = None,
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
        if loss_mask is not None:
            loss_mask = np.asarray(loss_mask)
            if loss_mask.shape != tokens.shape:
                raise ValueError(
                    f"{name}: loss_mask has shape {loss_mask.shape}, tokens {tokens.shape}"
                )
        self.loss_mask = loss_mask
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

    def window_order(self, key: Sequence[int] | None) -> np.ndarray:
        """The window indices this rank visits in one pass: a permutation seeded by `key`
        (identity for None), cut to a multiple of `dp_world`, every `dp_world`-th from
        `dp_rank`. Every rank's pass has the same length."""
        if key is None:
            order = np.arange(self.num_windows)
        else:
            order = np.random.default_rng(list(key)).permutation(self.num_windows)
        usable = self.num_windows // self.dp_world * self.dp_world
        return order[:usable][self.dp_rank :: self.dp_world]

    def rows(self, windows_B: np.ndarray) -> Batch:
        """The batch made of windows `windows_B` (indices into the stream's windows)."""
        T = self.seq_len
        starts_B = np.asarray(windows_B, dtype=np.int64) * T
        pos_BT1 = starts_B[:, None] + np.arange(T + 1)  # token positions of each window
        window_BT1 = torch.from_numpy(self.tokens[pos_BT1].astype(np.int64))
        labels_BT = window_BT1[:, 1:].clone()  # its own memory: masked in place below
        if self.loss_mask is not None:
            keep_BT = torch.from_numpy(self.loss_mask[pos_BT1[:, 1:]].astype(np.bool_))
            labels_BT.masked_fill_(~keep_BT, IGNORE_INDEX)
        # Document index of every input position; subtract the first to count from 0 per row.
        doc_BT = np.searchsorted(self.doc_starts, pos_BT1[:, :T], side="right") - 1
        doc_BT -= doc_BT[:, :1]
        return Batch(
            input_ids=window_BT1[:, :T].contiguous(),
            labels=labels_BT,
            document_ids=torch.from_numpy(doc_BT.astype(np.int32)),
        )

    def _rank_windows(self, epoch: int) -> np.ndarray:
        """Window indices of `epoch` this rank visits, in order."""
        if epoch != self._order_epoch:
            self._order = self.window_order([self.seed, epoch] if self.shuffle else None)
            self._order_epoch = epoch
        return self._order

    def _make_batch(self, windows: np.ndarray, b: int) -> Batch:
        return self.rows(windows[b * self.batch_size : (b + 1) * self.batch_size])


_CHOICE_BLOCK = 4096  # source draws generated per RNG block (any draw is found in O(1))


class InterleavedLoader:
    """Infinite, resumable mixture of several sources' windows, row by row.

    Args:
        sources: one `PackedLoader` per source, built for this rank (their `batch_size`,
            `seed` and `shuffle` are not used; only their windows and `rows`).
        weights: sampling weights, normalised: each row comes from source s with probability
            weights[s] / sum(weights), so they set the token mixture whatever the sizes.
        batch_size: B, rows per batch on this rank.
        seed: seeds the source draws and every source's window order.
        stopping_strategy: `first_exhausted` ends an epoch as soon as one source has used every
            window of its pass (no window repeats within an epoch); `all_exhausted` ends it
            once every source has, a source that runs out meanwhile starting another pass.
        shuffle: permute each source's windows per pass; False keeps stream order (validation).
        name: split name used in error messages.

    Epoch e draws the source of its i-th row from a generator seeded by (seed, e, i // 4096),
    identical on every rank, so all ranks exhaust a source at the same step; source s visits
    its windows in a permutation seeded by (seed, s, e, pass). At an epoch boundary every
    source starts a fresh pass. `state_dict()` holds only counters, and `load_state_dict`
    continues with exactly the rows the saver would have produced.

    Example::

        mix = InterleavedLoader([chat, arithmetic], [3.0, 1.0], batch_size=8, seed=0)
        batch = next(mix)  # 8 rows, each from chat with probability 3/4
    """

    def __init__(
        self,
        sources: Sequence[PackedLoader],
        weights: Sequence[float],
        *,
        batch_size: int,
        seed: int,
        stopping_strategy: str = "first_exhausted",
        shuffle: bool = True,
        name: str = "train",
    ) -> None:
        if not sources or len(sources) != len(weights):
            raise ValueError(
                f"{name}: need one weight per source, got {len(sources)} sources and "
                f"{len(weights)} weights"
            )
        if any(not w > 0 for w in weights):
            raise ValueError(f"{name}: source weights must be positive, got {list(weights)}")
        if stopping_strategy not in ("first_exhausted", "all_exhausted"):
            raise ValueError(
                f"stopping_strategy must be first_exhausted or all_exhausted, got "
                f"{stopping_strategy!r}"
            )
        if batch_size < 1 or seed < 0:
            raise ValueError(f"need batch_size >= 1 and seed >= 0, got {batch_size}, {seed}")
        shapes = {(s.seq_len, s.dp_rank, s.dp_world) for s in sources}
        if len(shapes) != 1:
            raise ValueError(f"{name}: sources differ in (seq_len, dp_rank, dp_world): {shapes}")
        self.sources = list(sources)
        self.weights = [float(w) for w in weights]
        self.probs = np.asarray(self.weights) / sum(self.weights)
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.stopping_strategy, self.name = stopping_strategy, name
        self.seq_len = sources[0].seq_len
        self._block: tuple[tuple[int, int], np.ndarray] | None = None
        self._orders: dict[int, tuple[tuple[int, int], np.ndarray]] = {}
        self.reset()

    def reset(self) -> None:
        """Rewind to the first row of epoch 0."""
        self._start_epoch(0)

    def _start_epoch(self, epoch: int) -> None:
        n = len(self.sources)
        self._epoch, self._draws = epoch, 0
        self._pass, self._pos, self._done = [0] * n, [0] * n, [False] * n

    @property
    def epoch(self) -> int:
        """Epoch of the next row."""
        return self._epoch

    def __iter__(self) -> InterleavedLoader:
        return self

    def __next__(self) -> Batch:
        picks = [self._next_row() for _ in range(self.batch_size)]
        rows = [self.sources[s].rows(np.asarray([w])) for s, w in picks]
        return Batch(
            input_ids=torch.cat([r.input_ids for r in rows]),
            labels=torch.cat([r.labels for r in rows]),
            document_ids=torch.cat([r.document_ids for r in rows]),
        )

    def iter_epoch(self, epoch: int = 0, max_batches: int | None = None) -> Iterator[Batch]:
        """Yield batches from the start of `epoch` (up to the epoch's end, at most
        `max_batches`) without moving the loader."""
        saved = self.state_dict()
        try:
            self._start_epoch(epoch)
            b = 0
            while (max_batches is None or b < max_batches) and self._epoch == epoch:
                batch = next(self)
                b += 1
                yield batch
        finally:
            self.load_state_dict(saved)

    def _choice(self, epoch: int, draw: int) -> int:
        block = (epoch, draw // _CHOICE_BLOCK)
        if self._block is None or self._block[0] != block:
            rng = np.random.default_rng([self.seed, epoch, block[1]])
            picks = rng.choice(len(self.sources), size=_CHOICE_BLOCK, p=self.probs)
            self._block = (block, picks)
        return int(self._block[1][draw % _CHOICE_BLOCK])

    def _order(self, s: int) -> np.ndarray:
        key = (self._epoch, self._pass[s])
        cached = self._orders.get(s)
        if cached is None or cached[0] != key:
            seed_key = [self.seed, s, *key] if self.shuffle else None
            cached = (key, self.sources[s].window_order(seed_key))
            self._orders[s] = cached
        return cached[1]

    def _next_row(self) -> tuple[int, int]:
        """(source, window) of the next row; moves the position."""
        s = self._choice(self._epoch, self._draws)
        order = self._order(s)
        if self._pos[s] == len(order):  # finished its pass earlier (all_exhausted): again
            self._pass[s] += 1
            self._pos[s] = 0
            order = self._order(s)
        window = int(order[self._pos[s]])
        self._pos[s] += 1
        self._draws += 1
        if self._pos[s] == len(order):
            self._done[s] = True
            if self.stopping_strategy == "first_exhausted" or all(self._done):
                self._start_epoch(self._epoch + 1)
        return s, window

    def state_dict(self) -> dict[str, Any]:
        """Position and the settings it is meaningful for; plain values, JSON-serializable."""
        return {
            "epoch": self._epoch,
            "draws": self._draws,
            "pass": list(self._pass),
            "pos": list(self._pos),
            "done": [int(d) for d in self._done],
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "batch_size": self.batch_size,
            "weights": list(self.weights),
            "stopping_strategy": self.stopping_strategy,
            "num_windows": [src.num_windows for src in self.sources],
            "dp_world": self.sources[0].dp_world,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the position of `state`.

        Raises:
            KeyError: a key is missing.
            ValueError: `state` was taken with other sources or settings.
        """
        mine = self.state_dict()
        for key in (
            "seed",
            "shuffle",
            "batch_size",
            "weights",
            "stopping_strategy",
            "num_windows",
            "dp_world",
        ):
            if state[key] != mine[key]:
                raise ValueError(
                    f"{self.name} interleaved loader state has {key}={state[key]}, this loader "
                    f"has {mine[key]}; resuming would not reproduce the same batches"
                )
        n = len(self.sources)
        if not all(len(state[k]) == n for k in ("pass", "pos", "done")):
            raise ValueError(f"{self.name} interleaved loader state is not for {n} sources")
        self._epoch, self._draws = int(state["epoch"]), int(state["draws"])
        self._pass = [int(x) for x in state["pass"]]
        self._pos = [int(x) for x in state["pos"]]
        self._done = [bool(x) for x in state["done"]]
