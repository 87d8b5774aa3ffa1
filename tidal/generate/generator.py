"""The Generator: batched sampling with the training model's own module code.

Design (after gpt-fast's generate.py and nanochat's engine.py, written for tidal):

- One static KV cache of `max_batch` rows ("slots") x `max_seq_len` positions, with per-row
  lengths (tidal/models/kv_cache.py). It is allocated once; weights and cache never move, so
  captured CUDA graphs stay valid across weight updates (`load_weights` copies in place).
- Prefill once per prompt: waiting requests are admitted together into free slots and
  prefilled in one padded forward, the prompt's keys/values computed once per group of n
  samples and copied to the group's other slots.
- Decode: one token for every slot of a bucket (the first b slots, b a power of two) per
  step, on the device only (no host sync per token).
- Host checks every `check_every` steps: one device-to-host copy of the done flags and
  counts; finished samples (stop token, stop string, `max_new_tokens`) are collected, and
  their slots refilled at once with waiting requests (continuous batching), so long-tailed
  completion lengths do not idle the batch. When few rows remain, they are moved into the
  lowest slots and the next-smaller bucket runs.
- Warm-up: each compile and capture happens at the first call that needs it, unless
  `warm_up` paid for them first.

Randomness: per sample, a counter-based hash of (request seed, sample index, completion
index, token id) (tidal/generate/sampler.py): the same request and seed give the same tokens in
any batch.

Files: this one holds the host side (admission, host checks, results, streams); the device
side (prefill and decode steps, compiled and captured) is tidal/generate/steps.py, the
compiled block function tidal/generate/compiled.py; the config, samples and counters are in
tidal/generate/types.py, the bookkeeping of cache rows in tidal/generate/slots.py, the in-place
weight loads in tidal/generate/weights.py, the fused projections in tidal/generate/fused.py.

Lifecycle: build the model (seed init, a checkpoint, a Hugging Face folder, the store), wrap
it in a `Generator` once, optionally `warm_up` (any weights: graphs survive weight loads),
call `generate` for each batch of prompts and `load_weights` / `load_from_store` between
calls. One Generator per process (per rank under tensor parallelism: every rank calls the
same methods with the same arguments).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch

from tidal.generate.sampler import VARIANTS, SamplingParams, variant_of
from tidal.generate.slots import Request, Rows, Table, buckets, make_requests
from tidal.generate.steps import Steps
from tidal.generate.types import Continuation, Conversation, GeneratorConfig, GeneratorStats, Sample
from tidal.generate.weights import copy_weights, read_weights
from tidal.models.kv_cache import KVCache
from tidal.models.moe import expert_dtype, moe_shape
from tidal.models.transformer import Transformer

END = object()
"""What a `Generator.stream` feed returns to end the stream (also `Generator.END`)."""

TokenListener = Callable[[int, int, int, list[int]], None]
"""`on_tokens(batch, index, sample_index, ids)` of `Generator.stream`: new tokens of a sample
whose prompt asked for them (`SamplingParams.stream`)."""


class Generator:
    """Generate completions with a tidal Transformer (see the module docstring).

    Args:
        model: the model, on its device, weights loaded (any dtype; eval mode is not needed:
            the model has no dropout). Tensor parallel models use the plans of
            tidal/parallel/parallelize.py with `sequence_parallel=False`. With fused
            projections (`GeneratorConfig.fuse_projections`), the
            attention and MLP projection parameters are laid out anew here, values and
            Parameter objects kept: take the model's state dict after building the
            Generator, and update it in place.
        tokenizer: optional; needed for `text`, stop strings and the default stop token (its
            `eos_id`). Anything with `encode`, `decode(ids, skip_special_tokens=...)`,
            `eos_id` and `vocab_size`, such as tidal.train.data.Tokenizer.
        config: sizes and modes.

    Example::

        gen = Generator(model, tokenizer=tok, config=GeneratorConfig(max_batch=16))
        groups = gen.generate([tok.encode("ROMEO:")], SamplingParams(n=4, max_new_tokens=32))
        for s in groups[0]:
            print(s.finish_reason, s.text, sum(s.logprobs))
    """

    END = END
    """What a `stream` feed returns to end the stream."""

    def __init__(
        self,
        model: Transformer,
        *,
        tokenizer: Any = None,
        config: GeneratorConfig | None = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.config = cfg = config or GeneratorConfig()
        args = model.args
        self.capacity = cfg.max_seq_len or args.max_seq_len
        if self.capacity > args.max_seq_len:
            raise ValueError(
                f"GeneratorConfig.max_seq_len={self.capacity} exceeds the model's "
                f"max_seq_len={args.max_seq_len}"
            )
        self.device = model.rope.device
        self.vocab_size = args.vocab_size
        self.version: int | None = None
        """Version of the loaded weights, stamped on every token (None: unversioned)."""
        self.swap_hook: Callable[[], int | None] | None = None
        """Called between decode steps (at each host check): it may copy newer weights into
        the parameters in place and return their version, or return None. Rows in flight
        go on with the new weights; their later tokens are stamped with the new version."""
        self.stats = GeneratorStats()
        self.cache = KVCache.for_model(model, batch_size=cfg.max_batch, capacity=self.capacity)
        route = None
        if cfg.record_routing:
            moe = moe_shape(model)
            if moe is None:
                raise ValueError(
                    "GeneratorConfig.record_routing=True records the experts of a mixture-of-"
                    "experts model; this model is dense"
                )
            layers, n_experts, top_k = moe
            route = (layers, self.capacity, top_k, expert_dtype(n_experts))
        self._rows = Rows(cfg.max_batch, self.capacity + 1, self.device, route)
        self._table = Table(cfg.max_batch)
        self.buckets = buckets(cfg.max_batch)
        self.steps = Steps(model, self.cache, self._rows, cfg, self.stats)
        """The prefill and decode steps, compiled and captured (tidal/generate/steps.py)."""

    @property
    def compiles(self) -> bool:
        """Whether the prefill and decode steps are compiled (`GeneratorConfig.compile`,
        resolved for this model and device)."""
        return self.steps.compiles

    @property
    def captures(self) -> bool:
        """Whether decode steps are captured in CUDA graphs (`GeneratorConfig.cuda_graphs`,
        resolved)."""
        return self.steps.captures

    @property
    def fused(self) -> int:
        """Attention and MLP modules whose projections run as one product each
        (`GeneratorConfig.fuse_projections`, resolved); 0 when off."""
        return self.steps.fused

    @property
    def blocks(self) -> list[Callable[..., torch.Tensor]] | None:
        """The compiled block functions the cached forward runs (compile_scope="blocks" with
        compile on), else None."""
        return self.steps.blocks

    def compile_for_testing(self) -> None:
        """The test seam for the compiled paths on CPU: compile as `compile=None` does on
        CUDA, whatever the device (tests pass `torch.compile` dynamo's "eager" backend to
        trace without making kernels). Not for generation: a CPU model gains nothing."""
        self.steps.compile_for_testing()

    # -- weights --------------------------------------------------------------------------

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], *, version: int | None = None):
        """Copy `state_dict` into the model's parameters in place (no reallocation: captured
        CUDA graphs stay valid) and set `version`.

        The keys must be exactly the model's state-dict keys (`model.state_dict()`: e.g.
        `layers.0.attention.wq.weight`; no `output.weight` with tied embeddings) and each
        tensor must have the parameter's global shape; dtypes are converted. Plain tensors are
        sliced into tensor-parallel (DTensor) parameters.

        Raises:
            KeyError: missing or unexpected keys (both listed).
            ValueError: a shape differs (key and both shapes named).
        """
        copy_weights(self.model, state_dict)
        self.version = version

    def load_from_store(
        self,
        store: Any,
        key: str,
        *,
        version: int | None = None,
        timeout: float = 60.0,
    ) -> int:
        """Read version `version` of state dict `key` from a tidal store into the parameters,
        in place, resharding to this model's layout; returns the version read.

        Args:
            store: a `tidal.store.Store` (from `tidal.store.connect()`; the engine does not
                import tidal.store: anything with its `versions` and `get_state_dict` does).
            key: the key the trainer puts its state dict under (e.g. "policy").
            version: a version number, waited for up to `timeout` seconds (streamed while it
                is written); None: the newest committed version (or version 0, waited for,
                when the key has none yet).
            timeout: seconds to wait for the version.

        Raises:
            TimeoutError: the version did not arrive within `timeout`.
            KeyError: a parameter is missing in the stored state dict.
            ValueError: a stored tensor has another shape or dtype than the parameter.
        """
        self.version = read_weights(self.model, store, key, version=version, timeout=timeout)
        return self.version

    # -- generation -----------------------------------------------------------------------

    def warm_up(
        self,
        params: Sequence[SamplingParams] | None = None,
        *,
        buckets: Sequence[int] | None = None,
    ) -> float:
        """Compile and capture now what `generate` would at its first use of each piece: the
        prefill (one prompt and several; the first prefill, which allocates the KV cache,
        as well) and the decode step of every batch bucket in every sampler variant of
        `params`, with its CUDA graph. Afterwards, `generate` calls with those variants
        compile and capture nothing, whatever buckets continuous batching moves through and
        whatever the prompts' lengths. Returns the seconds it took (also added up in
        `stats.warmup_seconds`; `stats.graphs_captured` counts its graphs, the other
        counters are left as they were). Does nothing on a Generator that compiles nothing
        and captures nothing (CPU, or both off). The weights are only read: warm up before
        loading the real ones or after, the graphs stay valid.

        Args:
            params: the sampling settings `generate` will get; only their variant counts
                (greedy: temperature 0; sampled; sampled with top-k / top-p). None: all three.
            buckets: the decode batch sizes to warm (of `self.buckets`); None: all of them.

        Raises:
            ValueError: a bucket that is not one of `self.buckets`.

        Example::

            gen = Generator(model, config=GeneratorConfig(max_batch=128, compile_scope="blocks"))
            gen.warm_up([SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)])
        """
        variants = VARIANTS if params is None else sorted({variant_of(p) for p in params})
        sizes = sorted(set(self.buckets if buckets is None else buckets), reverse=True)
        bad = [b for b in sizes if b not in self.buckets]
        if bad:
            raise ValueError(
                f"warm_up buckets {bad} are not batch buckets of this Generator "
                f"(max_batch={self.config.max_batch}): {self.buckets}"
            )
        if not (self.compiles or self.captures):
            return 0.0
        start = time.perf_counter()
        before = dataclasses.replace(self.stats)  # warm-up's calls and steps are not counted
        hook, self.swap_hook = self.swap_hook, None  # the weights stay as they are
        try:
            # The prefill: the first one runs eagerly (it allocates the cache), then one prompt
            # (batch 1 is a graph of its own) and two of other widths. One token each: no step.
            one = SamplingParams(temperature=0.0, max_new_tokens=1, stop_token_ids=())
            long = min(17, self.capacity - 1)  # another multiple of the prefill's padding
            calls = [[[0]], [[0], [0] * long]]
            if not self.cache.allocated:
                calls.insert(0, [[0]])
            for prompts in calls:
                self.generate(prompts, one)
            # Every (bucket, variant) step on finished rows, which it leaves as they are.
            with torch.no_grad(), self.steps.autocast():
                self.steps.warm_up(variants, sizes)
            self._reset()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            self.swap_hook = hook
            stats = self.stats
            for f in dataclasses.fields(stats):
                if f.name != "graphs_captured":
                    setattr(stats, f.name, getattr(before, f.name))
        seconds = time.perf_counter() - start
        stats.warmup_seconds += seconds
        return seconds

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int] | Continuation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        keep: bool = False,
    ) -> list[list[Sample]]:
        """Complete every prompt `params.n` times.

        Args:
            prompts: token ids of each prompt (at least one token; BOS is not added), or a
                `Continuation` of a kept conversation (its observation's tokens, appended
                and prefilled from the conversation's cache row; n=1). Both kinds batch
                together.
            params: one SamplingParams for all prompts, or one per prompt.
            keep: keep each sample's cache row after its turn, for continuations
                (`Sample.conversation`), until `release` or a continuation with
                keep=False. Every sample then holds a row: they must fit in `max_batch`
                at once, beside the rows already held.

        Returns:
            One list per prompt, in order, of its n samples (sample_index 0..n-1). A
            continuation's sample has the whole conversation before its turn as
            `prompt_ids`; one whose tokens leave no room in the row for a new token ends as
            "truncated", without running, and its conversation is closed.

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, a prompt longer
                than `max_seq_len - 1`, prompt + max_new_tokens over `max_seq_len`, n over
                `max_batch` (less the rows held by conversations), a stop string without a
                tokenizer or one the tokenizer cannot produce (its encoding does not decode
                back to it), more than MAX_STOP_IDS stop token ids; a continuation with
                n > 1, of a closed conversation, of another generator's, or of one already
                running or waiting for a turn.
        """
        requests = self._requests(prompts, params, keep)  # every error before anything runs
        feed = iter([requests])
        (groups,) = self._run(lambda idle: next(feed, END))
        return groups

    def continue_(
        self,
        conversations: Sequence[Conversation],
        observations: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        keep: bool = True,
    ) -> list[Sample]:
        """Append each observation's tokens to its conversation and sample the next turn,
        from the conversation's cache row: `generate` of `Continuation`s, one sample each.

        Args:
            conversations: open conversations (`Sample.conversation` of a turn made with
                `keep=True`), each at most once.
            observations: token ids to append to each (a tool result, an environment or user
                message; may be empty to go on with the same turn).
            params: one SamplingParams (n=1) for all, or one each; `max_new_tokens` is
                clipped to the positions the row has left.
            keep: keep the rows after this turn (False: this turn is the last, the rows are
                freed when it ends).

        Returns:
            One sample per conversation, in order (`finish_reason` "truncated" when the
            observation leaves no room for a new token: the conversation is then closed).

        Example::

            (s,) = gen.generate([prompt], SamplingParams(max_new_tokens=64), keep=True)[0]
            (t,) = gen.continue_([s.conversation], [tok.encode("<tool_response>42")])
            gen.release(t.conversation)     # or continue again
        """
        if len(conversations) != len(observations):
            raise ValueError(
                f"{len(conversations)} conversations but {len(observations)} observations"
            )
        items = [
            Continuation(c, tuple(o)) for c, o in zip(conversations, observations, strict=True)
        ]
        return [g[0] for g in self.generate(items, params, keep=keep)]

    def release(self, conversation: Conversation) -> None:
        """Free the cache row of a conversation between its turns (the trajectory is done);
        a closed conversation is left as it is.

        Raises:
            ValueError: the conversation is running a turn or waiting for one, or is not
                this generator's.
        """
        self._table.release(conversation, claimed_ok=False)

    @property
    def conversations(self) -> list[Conversation]:
        """The open conversations: each holds a cache row, between turns or running one."""
        return self._table.conversations()

    def stream(
        self,
        feed: Callable[[bool], tuple[Sequence[Sequence[int] | Continuation], Any] | None | object],
        *,
        keep: bool = False,
        on_tokens: TokenListener | None = None,
    ) -> Iterator[list[list[Sample]]]:
        """Generate batch after batch without draining the slots in between: while the
        last rows of one batch finish, the next batch's groups take the slots freed.

        `feed(idle)` is asked for the next batch whenever every request fed so far has
        been admitted: it returns `(prompts, params)` (as `generate` takes them, with
        continuations among the prompts, and `keep` for every batch), None for
        "nothing yet" (decoding goes on and it is asked again after the next host check),
        or `Generator.END` to stop: the batches in flight finish and the iterator ends.
        `idle` is True when nothing is in flight; a feed with nothing to give should then
        wait (bounded) before returning None, or the loop spins.

        Yields each batch's groups (as `generate` returns them), in the order the batches
        were fed, each as soon as it and every batch before it are complete. `swap_hook`
        runs between decode steps as in `generate`. Raises what `generate` raises, when
        the batch is fed.

        `on_tokens(batch, index, sample_index, ids)` hears the new tokens of every running
        sample whose prompt's `SamplingParams.stream` is set, at each host check (every
        `check_every` decode steps), on this iterator's thread: `batch` counts the batches
        fed (from 0), `index` is the prompt's position in its batch, `ids` the tokens decoded
        since the last call. A sample that finishes at a check is not reported there: its
        whole `Sample` comes with its batch (its tokens begin with every token reported; its
        text, cut before a stop string, may end inside their text).

        Example::

            batches = iter([(prompts_a, params), (prompts_b, params)])
            for groups in gen.stream(lambda idle: next(batches, Generator.END)):
                print(len(groups))
        """

        def requests(idle: bool) -> list[Request] | None | object:
            item = feed(idle)
            if item is None or item is END:
                return item
            prompts, params = cast(tuple[Sequence[Sequence[int] | Continuation], Any], item)
            return self._requests(prompts, params, keep)

        return self._run(requests, on_tokens)

    @torch.no_grad()
    def _run(
        self, next_requests: Callable[[bool], Any], on_tokens: TokenListener | None = None
    ) -> Iterator[list[list[Sample]]]:
        """The continuous batcher under `generate` and `stream` (see `stream`)."""
        results: dict[int, list[list[Sample | None]]] = {}  # batch -> its groups, as they fill
        pending: deque[Request] = deque()
        fed = done = 0  # batches fed; batches yielded
        ended = False
        self.steps.check_weights()  # fused projections read the parameters where they were
        self._reset()
        try:
            while True:
                # Feed batches while every one fed so far has been admitted: a batch whose groups
                # all fit leaves room to ask for the next one before decoding.
                while not ended and not pending:
                    reqs = next_requests(not self._table.active())
                    if reqs is END:
                        ended = True
                        break
                    if reqs is None:
                        break
                    results[fed] = [[None] * r.params.n for r in reqs]
                    for r in reqs:
                        r.batch = fed
                        if r.truncated:
                            results[fed][r.index][0] = self._truncate(r)
                        else:
                            pending.append(r)
                    fed += 1
                    self._admit_and_prefill(pending)
                if pending or self._table.active():
                    self._admit_and_prefill(pending)
                    if pending and not self._table.active():
                        raise RuntimeError(
                            f"a request needs {pending[0].params.n} free cache rows but "
                            f"{len(self._table.held())} of max_batch={self.config.max_batch} are "
                            "held by kept conversations: release them (Generator.release)"
                        )
                    with self.steps.autocast():
                        self._decode_and_check(results, on_tokens)
                        self._maybe_swap()
                while done in results and all(s is not None for g in results[done] for s in g):
                    yield [list(g) for g in results.pop(done)]  # type: ignore[arg-type]
                    done += 1
                if ended and done == fed:
                    return
        finally:  # an abandoned stream: continuations not admitted leave their rows idle
            self._table.unclaim(r.conversation for r in pending if r.conversation)

    def _maybe_swap(self) -> None:
        """Between decode steps: let `swap_hook` switch the weights, and mark where each
        running row's tokens change version (its count is exact after a host check)."""
        if self.swap_hook is None:
            return
        version = self.swap_hook()
        if version is None or version == self.version:
            return
        self.version = version
        self.stats.weight_swaps += 1
        for i in self._table.active():
            slot = self._table.slots[i]
            assert slot is not None
            slot.marks.append((slot.count, version))

    def _requests(self, prompts, params, keep: bool) -> list[Request]:
        """Check a batch and make its requests; claim the rows of its continuations."""
        reqs = make_requests(
            prompts,
            params,
            vocab_size=self.vocab_size,
            capacity=self.capacity,
            model_max_seq_len=self.model.args.max_seq_len,
            max_batch=self.config.max_batch,
            tokenizer=self.tokenizer,
        )
        for r in reqs:
            r.keep = keep
        self._table.claim(reqs, self.config.max_batch, keep)
        return reqs

    def _truncate(self, req: Request) -> Sample:
        """The sample of a continuation that does not fit: no tokens; its row is freed."""
        conv = req.conversation
        assert conv is not None
        self._table.release(conv, claimed_ok=True)
        self.stats.truncated += 1
        return req.truncated_sample(self.tokenizer, self.version)

    # -- admission and prefill ------------------------------------------------------------

    def _reset(self) -> None:
        """Free every row not held by a conversation between turns."""
        self._table.reset()
        self._rows.done.fill_(True)
        if not self._table.held():
            self.cache.reset()
        else:
            free = torch.tensor(self._table.free(), dtype=torch.long, device=self.device)
            self.cache.lengths[free] = 0

    def _admit_and_prefill(self, pending: deque[Request]) -> None:
        """Admit what fits of `pending` into free rows (a continuation: its conversation's)
        and prefill it."""
        admitted = self._table.admit(pending, self.version)
        if admitted:
            with self.steps.autocast():
                self.steps.prefill(admitted)

    # -- decoding -------------------------------------------------------------------------

    def _decode_and_check(
        self, results: dict[int, list[list[Sample | None]]], on_tokens: TokenListener | None
    ) -> None:
        """Run up to `check_every` decode steps on the smallest bucket holding every active
        row, then collect the finished rows."""
        if not self._table.active():
            return
        self._compact()
        active = self._table.active()
        b = next(x for x in self.buckets if x > active[-1])
        slots = [self._table.slots[i] for i in active]
        # Rows still running grow by one token per step: never run past the longest need.
        steps = min(
            self.config.check_every,
            max(s.request.max_new - s.count for s in slots if s is not None),
        )
        sampled = any(s.request.params.temperature > 0 for s in slots if s is not None)
        truncate = any(s.request.params.truncates for s in slots if s is not None)
        start = time.perf_counter()
        if steps > 0:
            step = self.steps.step(b, sampled, truncate)
            for _ in range(steps):
                step()
            self.stats.decode_steps += steps
        self._check(active, steps, results, on_tokens)
        self.stats.decode_seconds += time.perf_counter() - start

    def _compact(self) -> None:
        """Move the active rows past the bucket they need into lower free (or held) rows."""
        src, dst, left = self._table.compaction(self.buckets)
        if not src:
            return
        src_t = torch.tensor(src, device=self.device)
        dst_t = torch.tensor(dst, device=self.device)
        self.cache.copy_rows(src_t, dst_t)
        self._rows.move(src_t, dst_t)
        self._rows.done[torch.tensor(left, device=self.device)] = True

    def _check(
        self, active: list[int], steps: int, results, on_tokens: TokenListener | None
    ) -> None:
        """One device-to-host copy of the done flags and counts; finish rows that hit a stop
        token, a stop string or their length; free their slots; give `on_tokens` the new
        tokens of the streamed rows still running."""
        rows = self._rows
        idx = torch.tensor(active, device=self.device)
        done_count = torch.stack([rows.done[idx].long(), rows.count[idx]]).cpu()
        self.stats.host_checks += 1
        finished: dict[int, tuple[int, str]] = {}  # slot -> (tokens kept, reason)
        to_search = []
        for k, slot_id in enumerate(active):
            slot = self._table.slots[slot_id]
            assert slot is not None
            done, count = bool(done_count[0, k]), int(done_count[1, k])
            slot.count = count if done else slot.count + steps
            assert done or slot.count == count, f"slot {slot_id}: {slot.count} != {count}"
            if slot.request.params.stop:
                to_search.append(slot_id)
            elif done:
                finished[slot_id] = (count, "")
        report = []
        if on_tokens is not None:
            for slot_id in active:
                slot = self._table.slots[slot_id]
                assert slot is not None
                if slot.request.params.stream and slot.count > slot.reported:
                    report.append(slot_id)
        if to_search or finished:
            fetch = sorted(set(to_search) | finished.keys())
            fidx = torch.tensor(fetch, device=self.device)
            width = 1 + max(self._table.slots[s].count for s in fetch)  # type: ignore[union-attr]
            toks, lps, slps = (
                t[fidx, :width].cpu() for t in (rows.out_tok, rows.out_lp, rows.out_slp)
            )
            host = {s: (toks[i], lps[i], slps[i]) for i, s in enumerate(fetch)}
            for slot_id in to_search:
                slot = self._table.slots[slot_id]
                assert slot is not None
                hit = slot.search_stop(host[slot_id][0][: slot.count].tolist(), self.tokenizer)
                if hit is not None:
                    finished[slot_id] = (hit, "stop")
                elif bool(done_count[0, active.index(slot_id)]):
                    finished[slot_id] = (slot.count, "")
            for slot_id, (n, reason) in finished.items():
                slot = self._table.slots[slot_id]
                assert slot is not None
                tok, lp, slp = host[slot_id]
                ids = tok[:n].tolist()
                if not reason:
                    reason = "stop" if ids[-1] in slot.request.stop_ids else "length"
                sample = slot.sample(
                    ids, lp[:n].tolist(), slp[:n].tolist(), reason, self.tokenizer, self.version
                )
                if rows.route is not None:  # every position the model ran: prompt + n - 1
                    fed = len(slot.request.prompt) + n - 1
                    sample.routed_experts = rows.route[slot_id, :, :fed].to("cpu", copy=True)
                results[slot.request.batch][slot.request.index][slot.sample_index] = sample
                self._end_turn(slot_id, sample)
            rows.done[torch.tensor(list(finished), device=self.device, dtype=torch.long)] = True
        report = [s for s in report if s not in finished]
        if report:  # one more copy: the new tokens alone
            assert on_tokens is not None
            slots = [self._table.slots[s] for s in report]
            lo = min(s.reported for s in slots)  # type: ignore[union-attr]
            hi = max(s.count for s in slots)  # type: ignore[union-attr]
            ridx = torch.tensor(report, device=self.device)
            new = rows.out_tok[ridx, lo:hi].cpu()
            for k, slot in enumerate(slots):
                assert slot is not None
                ids = new[k, slot.reported - lo : slot.count - lo].tolist()
                slot.reported = slot.count
                on_tokens(slot.request.batch, slot.request.index, slot.sample_index, ids)

    def _end_turn(self, row: int, sample: Sample) -> None:
        """Free a finished row, or hold it for its conversation's next turn."""
        slot = self._table.slots[row]
        assert slot is not None
        conv = sample.conversation = slot.conversation
        if conv is None:
            self._table.slots[row] = None
            return
        conv.ids = sample.prompt_ids + sample.completion_ids
        conv.turns += 1
        slot.held = True
        if not slot.request.keep:
            self._table.release(conv, claimed_ok=False)


__all__ = ["END", "Generator"]
