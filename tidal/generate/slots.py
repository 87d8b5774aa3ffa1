"""The Generator's bookkeeping of its KV-cache rows ("slots"): a request (and the checks that
make one), the host view of an occupied row, the device state of every row that decode steps
update in place, and the decode batch sizes (tidal/generate/generator.py uses them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tidal.generate.sampler import SamplingParams
from tidal.generate.types import MAX_STOP_IDS


@dataclass(slots=True)
class Request:
    index: int
    """The prompt's index in its batch."""
    prompt: list[int]
    params: SamplingParams
    stop_ids: tuple[int, ...]
    batch: int = 0
    """Which batch of a stream it belongs to (Generator.stream numbers them 0, 1, ...)."""


def make_requests(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None,
    *,
    vocab_size: int,
    capacity: int,
    model_max_seq_len: int,
    max_batch: int,
    tokenizer: Any,
) -> list[Request]:
    """Check one batch of prompts and their sampling parameters against the generator's
    sizes (`Generator.generate` documents each error) and make its requests."""
    if isinstance(prompts, (str, bytes)) or (len(prompts) and isinstance(prompts[0], int)):
        raise TypeError("prompts must be a sequence of token-id sequences, one per prompt")
    if params is None:
        params = SamplingParams()
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(plist) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
    out = []
    for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError(f"prompt {i} is empty; give at least one token (e.g. BOS)")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
            )
        if len(prompt) >= capacity:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens; a row holds at most {capacity} "
                f"(GeneratorConfig.max_seq_len, model max_seq_len {model_max_seq_len}) "
                "including at least one new token"
            )
        if len(prompt) + p.max_new_tokens > capacity:
            raise ValueError(
                f"prompt {i}: {len(prompt)} tokens + max_new_tokens={p.max_new_tokens} exceeds "
                f"the {capacity} positions of a row; at most {capacity - len(prompt)} new "
                "tokens fit"
            )
        if p.n > max_batch:
            raise ValueError(
                f"prompt {i}: n={p.n} samples exceed GeneratorConfig.max_batch={max_batch} "
                "(a group is decoded at once)"
            )
        stop_ids = p.stop_token_ids
        if stop_ids is None:
            eos = getattr(tokenizer, "eos_id", None)
            stop_ids = (eos,) if eos is not None else ()
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"prompt {i}: {len(stop_ids)} stop_token_ids, at most {MAX_STOP_IDS}")
        bad = [t for t in stop_ids if t >= vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i}: stop_token_ids {bad} outside the vocabulary [0, {vocab_size})"
            )
        _check_stop_strings(i, p.stop, tokenizer)
        out.append(Request(i, prompt, p, tuple(stop_ids)))
    return out


def _check_stop_strings(i: int, stop: tuple[str, ...], tokenizer: Any) -> None:
    if not stop:
        return
    if tokenizer is None:
        raise ValueError(f"prompt {i}: stop strings {stop!r} need a tokenizer")
    for s in stop:
        # "Unknown": text the tokenizer cannot produce, i.e. whose encoding does not decode
        # back to it (characters outside a non-byte-level vocabulary, specials).
        back = tokenizer.decode(tokenizer.encode(s))
        if back != s:
            raise ValueError(
                f"prompt {i}: stop string {s!r} cannot be produced by the tokenizer (it decodes "
                f"its encoding as {back!r})"
            )


@dataclass(slots=True)
class Slot:
    """Host view of an occupied cache row."""

    request: Request
    sample_index: int
    count: int  # tokens generated if the row is still running (exact until it finishes)
    checked: int = 0  # tokens already searched for stop strings
    marks: list[tuple[int, int | None]] = field(default_factory=list)
    """(first token index, policy version) each time the weights changed under this row:
    tokens from that index on were produced by that version."""

    def versions(self, n: int) -> list[int] | None:
        """The policy version of each of the first `n` tokens (None: unversioned weights)."""
        if not self.marks or all(v is None for _, v in self.marks):
            return None
        out: list[int] = []
        for k, (_, v) in enumerate(self.marks):
            end = self.marks[k + 1][0] if k + 1 < len(self.marks) else n
            out += [-1 if v is None else v] * max(0, min(end, n) - len(out))
        return out[:n]


class Rows:
    """The device state of every slot (all [R] or [R, W]); decode steps update it in place."""

    FIELDS = (
        "last",
        "pos",
        "count",
        "done",
        "max_new",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "key",
        "stop_ids",
        "out_tok",
        "out_lp",
        "out_slp",
    )

    def __init__(self, rows: int, width: int, device: torch.device):
        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        f32 = torch.float32
        self.last, self.pos, self.count = zeros(rows), zeros(rows), zeros(rows)
        self.done = torch.ones(rows, dtype=torch.bool, device=device)
        self.max_new = zeros(rows) + 1
        self.temperature, self.top_k = zeros(rows, dtype=f32), zeros(rows)
        self.top_p, self.min_p = zeros(rows, dtype=f32) + 1, zeros(rows, dtype=f32)
        self.key = zeros(rows)
        self.stop_ids = zeros(rows, MAX_STOP_IDS) - 1
        self.out_tok = zeros(rows, width)
        self.out_lp, self.out_slp = zeros(rows, width, dtype=f32), zeros(rows, width, dtype=f32)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f) for f in self.FIELDS]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in self.tensors():
            t[dst] = t[src]


def buckets(max_batch: int) -> list[int]:
    """Decode batch sizes: powers of two below max_batch and max_batch itself, the largest 8
    (one compiled graph each, within dynamo's default recompile limit)."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if (1 << i) < max_batch]
    return [*sizes, max_batch][-8:]


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m
