"""The Generator's bookkeeping of its KV-cache rows ("slots"): a request (and the checks that
make one), the host view of an occupied row and the table of every row (running a turn, held
by a kept conversation between turns, or free), the device state of every row that decode
steps update in place, and the decode batch sizes (tidal/generate/generator.py uses them)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tidal.generate.sampler import SamplingParams, sample_key
from tidal.generate.types import MAX_STOP_IDS, Continuation, Conversation, Sample


@dataclass(slots=True)
class Request:
    index: int
    """The prompt's index in its batch."""
    prompt: list[int]
    """Every token before the completion (a continuation's: its conversation's and the new)."""
    params: SamplingParams
    stop_ids: tuple[int, ...]
    max_new: int = 0
    """Most new tokens: `params.max_new_tokens`, or what the row has left for a continuation."""
    start: int = 0
    """Tokens of `prompt` already in the cache row (a continuation's conversation but its
    last token); the prefill feeds the rest."""
    conversation: Conversation | None = None
    """The conversation a continuation extends (its row is the conversation's)."""
    keep: bool = False
    """Keep each sample's row after its turn (`Generator.generate(keep=True)`)."""
    batch: int = 0
    """Which batch of a stream it belongs to (Generator.stream numbers them 0, 1, ...)."""

    @property
    def new_tokens(self) -> int:
        """Tokens the prefill feeds."""
        return len(self.prompt) - self.start

    @property
    def truncated(self) -> bool:
        """A continuation with no room left for a new token: it ends without running."""
        return self.max_new < 1

    def truncated_sample(self, tokenizer: Any, version: int | None) -> Sample:
        """The sample of a continuation that does not fit: no tokens."""
        return Sample(
            prompt_index=self.index,
            sample_index=0,
            prompt_ids=list(self.prompt),
            completion_ids=[],
            text=None if tokenizer is None else "",
            finish_reason="truncated",
            logprobs=[],
            sampling_logprobs=[],
            weight_version=version,
            conversation=self.conversation,
        )

    def key(self, j: int) -> int:
        """The random key of sample j of the group (a continuation: of its conversation's
        sample and turn)."""
        if self.conversation is None:
            return sample_key(self.params.seed, j)
        c = self.conversation
        return sample_key(self.params.seed, c.sample_index, c.turns)


def make_requests(
    prompts: Sequence[Sequence[int] | Continuation],
    params: SamplingParams | Sequence[SamplingParams] | None,
    *,
    vocab_size: int,
    capacity: int,
    model_max_seq_len: int,
    max_batch: int,
    tokenizer: Any,
) -> list[Request]:
    """Check one batch of prompts (token ids, or continuations of conversations) and their
    sampling parameters against the generator's sizes (`Generator.generate` documents each
    error) and make its requests. A continuation may run past the row: it is clipped to the
    positions left (`Request.max_new`), none left and it ends as truncated."""
    if isinstance(prompts, (str, bytes, Continuation)) or (
        len(prompts) and isinstance(prompts[0], int)
    ):
        raise TypeError(
            "prompts must be a sequence of token-id sequences or Continuations, one per prompt"
        )
    if params is None:
        params = SamplingParams()
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(plist) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
    out = []
    for i, (item, p) in enumerate(zip(prompts, plist, strict=True)):
        if isinstance(item, Continuation):
            tokens = [int(t) for t in item.tokens]
            prompt, conv = item.conversation.ids + tokens, item.conversation
            if not conv.open:
                raise ValueError(
                    f"prompt {i}: the conversation is closed (released, ended as truncated or "
                    "finished by a continuation with keep=False)"
                )
            if p.n != 1:
                raise ValueError(f"prompt {i}: a continuation takes n=1 (its own row), got {p.n}")
        else:
            prompt, conv, tokens = [int(t) for t in item], None, []
        if not prompt:
            raise ValueError(f"prompt {i} is empty; give at least one token (e.g. BOS)")
        bad = [t for t in (prompt if conv is None else tokens) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
            )
        # (A continuation that does not fit ends as truncated: `Request.truncated`.)
        if conv is None and len(prompt) >= capacity:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens; a row holds at most {capacity} "
                f"(GeneratorConfig.max_seq_len, model max_seq_len {model_max_seq_len}) "
                "including at least one new token"
            )
        if conv is None and len(prompt) + p.max_new_tokens > capacity:
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
        req = Request(i, prompt, p, tuple(stop_ids), max_new=p.max_new_tokens)
        if conv is not None:
            req.conversation, req.start = conv, len(conv.ids) - 1
            req.max_new = max(0, min(p.max_new_tokens, capacity - len(prompt)))
        out.append(req)
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
    """Host view of an occupied cache row: running a turn, or held by its conversation."""

    request: Request
    sample_index: int
    count: int  # tokens generated if the row is still running (exact until it finishes)
    checked: int = 0  # tokens already searched for stop strings
    reported: int = 0  # tokens already given to the stream's on_tokens (params.stream)
    marks: list[tuple[int, int | None]] = field(default_factory=list)
    """(first token index, policy version) each time the weights changed under this row:
    tokens from that index on were produced by that version."""
    conversation: Conversation | None = None
    """The conversation the row belongs to (a request with keep, or a continuation)."""
    held: bool = False
    """The turn is done and the row is kept for the conversation's next turn."""
    claimed: bool = False
    """Held, with a continuation waiting for admission."""

    def versions(self, n: int) -> list[int] | None:
        """The policy version of each of the first `n` tokens (None: unversioned weights)."""
        if not self.marks or all(v is None for _, v in self.marks):
            return None
        out: list[int] = []
        for k, (_, v) in enumerate(self.marks):
            end = self.marks[k + 1][0] if k + 1 < len(self.marks) else n
            out += [-1 if v is None else v] * max(0, min(end, n) - len(out))
        return out[:n]

    def search_stop(self, ids: list[int], tokenizer: Any) -> int | None:
        """Tokens kept when a stop string ends within ids[self.checked:] (the token that
        completes it included), else None."""
        stops = self.request.params.stop
        window = 4 * max(len(s) for s in stops) + 4  # tokens that can hold any stop string
        for i in range(self.checked, len(ids)):
            tail = tokenizer.decode(ids[max(0, i + 1 - window) : i + 1])
            if any(s in tail for s in stops):
                return i + 1
        self.checked = len(ids)
        return None

    def sample(
        self,
        ids: list[int],
        lps: list[float],
        slps: list[float],
        reason: Any,
        tokenizer: Any,
        version: int | None,
    ) -> Sample:
        """The finished sample of this row: its tokens, log-probs and finish reason."""
        text = None
        if tokenizer is not None:
            text = tokenizer.decode(ids)
            cuts = [text.find(s) for s in self.request.params.stop if s in text]
            if cuts:
                text = text[: min(cuts)]
        return Sample(
            prompt_index=self.request.index,
            sample_index=self.sample_index,
            prompt_ids=list(self.request.prompt),
            completion_ids=ids,
            text=text,
            finish_reason=reason,
            logprobs=lps,
            sampling_logprobs=slps,
            weight_version=self.marks[0][1] if self.marks else version,
            versions=self.versions(len(ids)) if len(self.marks) > 1 else None,
        )


class Table:
    """Which request or conversation occupies each cache row: running a turn (active), held
    by a kept conversation between turns, or free (None)."""

    def __init__(self, rows: int):
        self.slots: list[Slot | None] = [None] * rows

    def active(self) -> list[int]:
        """Rows running a turn, in order."""
        return [i for i, s in enumerate(self.slots) if s is not None and not s.held]

    def free(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s is None]

    def held(self) -> list[int]:
        """Rows held by conversations between turns."""
        return [i for i, s in enumerate(self.slots) if s is not None and s.held]

    def row_of(self, conversation: Conversation) -> int | None:
        for i, s in enumerate(self.slots):
            if s is not None and s.conversation is conversation:
                return i
        return None

    def conversations(self) -> list[Conversation]:
        """The open conversations, held or running a turn, in row order."""
        return [s.conversation for s in self.slots if s is not None and s.conversation]

    def claim(self, requests: Sequence[Request], max_batch: int, keep: bool) -> None:
        """Check that a batch fits beside the held rows and that each continuation's
        conversation is held here, idle, once; then mark those rows claimed (a continuation
        waits for admission). `Generator.generate` documents the errors."""
        held = len(self.held())
        claims: list[Slot] = []
        for r in requests:
            if r.conversation is None:
                if r.params.n > max_batch - held:
                    raise ValueError(
                        f"prompt {r.index}: n={r.params.n} samples need as many free cache rows;"
                        f" {held} of max_batch={max_batch} are held by kept conversations "
                        "(Generator.release frees them)"
                    )
                continue
            row = self.row_of(r.conversation)
            slot = None if row is None else self.slots[row]
            if slot is None:
                raise ValueError(
                    f"prompt {r.index}: the conversation is not held by this generator"
                )
            if not slot.held or slot.claimed or any(slot is c for c in claims):
                raise ValueError(
                    f"prompt {r.index}: the conversation is running a turn or waiting for one"
                )
            claims.append(slot)
        rows = sum(r.params.n for r in requests if r.conversation is None)
        if keep and rows + held > max_batch:
            raise ValueError(
                f"keep=True holds a cache row per sample: {rows} new samples and {held} rows "
                f"already held exceed max_batch={max_batch}"
            )
        for slot in claims:
            slot.claimed = True

    def release(self, conversation: Conversation, *, claimed_ok: bool) -> None:
        """Free a conversation's row and close it (a closed one is left as it is).
        `claimed_ok`: a continuation of it may be waiting (it ends without running)."""
        if not conversation.open:
            return
        row = self.row_of(conversation)
        slot = None if row is None else self.slots[row]
        if row is None or slot is None:
            raise ValueError("release: the conversation is not held by this generator")
        if not slot.held or (slot.claimed and not claimed_ok):
            raise ValueError("release: the conversation is running a turn or waiting for one")
        self.slots[row] = None
        conversation.open = False

    def unclaim(self, conversations: Iterable[Conversation]) -> None:
        """Drop the claims of continuations that will not be admitted."""
        for c in conversations:
            row = self.row_of(c)
            slot = None if row is None else self.slots[row]
            if slot is not None and slot.held:
                slot.claimed = False

    def reset(self) -> None:
        """Forget every row but the held ones (a turn cut off closes its conversation)."""
        for i, s in enumerate(self.slots):
            if s is not None and not s.held:
                if s.conversation is not None:
                    s.conversation.open = False
                self.slots[i] = None

    def admit(
        self, pending: deque[Request], version: int | None
    ) -> list[tuple[Request, list[int]]]:
        """Take waiting requests (in order) while their groups fit into free rows (a
        continuation takes its conversation's row); returns each with its rows."""
        free = self.free()
        admitted = []
        while pending:
            req = pending[0]
            if req.conversation is not None:
                row = self.row_of(req.conversation)
                assert row is not None, "a claimed conversation holds its row"
                rows = [row]
            elif len(free) >= req.params.n:
                rows, free = free[: req.params.n], free[req.params.n :]
            else:
                break
            pending.popleft()
            for j, row in enumerate(rows):
                conv = req.conversation
                if conv is None and req.keep:
                    conv = Conversation(list(req.prompt), j)
                self.slots[row] = Slot(req, j, 1, marks=[(0, version)], conversation=conv)
            admitted.append((req, rows))
        return admitted

    def compaction(self, buckets: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """Move the active rows past the bucket they need into lower rows that are free or
        held (a held row swaps places with the active one). Returns (src, dst) for the
        device rows to copy, and the rows the active ones left."""
        active = self.active()
        target = next(x for x in buckets if x >= len(active))
        movers = [i for i in active if i >= target]
        if not movers:
            return [], [], []
        low = range(target)
        free = [i for i in low if self.slots[i] is None]
        held = [i for i in low if self.slots[i] is not None and self.slots[i].held]  # type: ignore[union-attr]
        holes = (free + held)[: len(movers)]
        swaps = [(m, h) for m, h in zip(movers, holes, strict=True) if self.slots[h] is not None]
        for m, h in zip(movers, holes, strict=True):
            self.slots[h], self.slots[m] = self.slots[m], self.slots[h]
        return movers + [h for _, h in swaps], holes + [m for m, _ in swaps], movers


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

    def __init__(
        self,
        rows: int,
        width: int,
        device: torch.device,
        route: tuple[int, int, int, torch.dtype] | None = None,
    ):
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
        self.route: torch.Tensor | None = None
        """[R, MoE layers, positions, top_k]: the experts of the token at each position of
        the row (`route` = (layers, positions, top_k, dtype); GeneratorConfig.record_routing)."""
        if route is not None:
            layers, positions, k, dtype = route
            self.route = zeros(rows, layers, positions, k, dtype=dtype)

    def tensors(self) -> list[torch.Tensor]:
        extra = [] if self.route is None else [self.route]
        return [getattr(self, f) for f in self.FIELDS] + extra

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
