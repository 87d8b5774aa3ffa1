"""The device side of a Generator: the prefill and decode steps over the model and its KV
cache, compiled and captured as the config asks (tidal/generate/generator.py drives them from
the host: admission, host checks, results).

- Prefill (`Steps.prefill`): admitted prompts, right-padded to a multiple of 16 tokens, in one
  forward per chunk of at most `prefill_tokens` tokens that writes each prompt's keys/values
  into the first row of its group; the row is then copied into the group's other n - 1 rows
  (the prompt's KV is computed once, not n times), each row's sampling state is set
  (`Rows`) and each row samples its own first token from the shared last logits. A
  continuation of a conversation feeds only its new tokens, at the positions after those its
  row already caches, in the same forward as new prompts.
- Decode (`Steps.step`): one token for every row of a bucket (the first b rows, b a power of
  two) per step. Everything a step needs lives in device tensors (last token, position,
  count, sampling parameters, random keys, stop ids, output buffers); a step reads and
  updates them in place and never syncs with the host: no `.item()`, no data-dependent
  Python branches. Finished rows are frozen (their position stops advancing).
- CUDA: the decode step of each (bucket, sampler variant) is compiled with torch.compile
  (inductor, no cudagraphs of its own) and captured into a CUDA graph, replayed each step.
  The prefill is compiled with dynamic shapes. With `compile_scope="blocks"`, one function of
  a transformer block is compiled instead and serves every layer (each block gets its own
  layer's cache view, so no layer index is baked into a graph), the sampler and row updates
  are compiled apart per sampler variant, and the rest of the step runs eagerly; the step is
  still captured whole. In batch-invariant mode the step is not compiled (inductor would fuse
  the ops into kernels the trainer does not run) but still captured: a graph replays exactly
  the eager kernels. CPU: eager.
- Fused projections (`GeneratorConfig.fuse_projections`; on for CUDA outside batch-invariant
  mode and tensor parallelism): both steps run fused copies of the blocks, Q|K|V and W1|W3
  as one product each over stacked weights that hold the model's parameters
  (tidal/generate/fused.py), through `forward_cached(blocks=...)`, compiled or not.
- Each compile and capture happens at the first call that needs it, unless
  `Generator.warm_up` paid for them first (`Steps.warm_up`: every bucket and sampler variant
  asked for; the compiled blocks are dynamic in the batch and time from their first shape;
  tidal/generate/compiled.py).

Shape legend: P prompts in a prefill, T time, S rows of a prefill's groups, B rows of a
bucket, V vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tidal.generate.compiled import compiled_blocks, mark_batch
from tidal.generate.fused import FusedBlocks, fuse_enabled
from tidal.generate.sampler import sample, variant
from tidal.generate.slots import Request, Rows, round_up
from tidal.generate.types import MAX_STOP_IDS, GeneratorConfig, GeneratorStats
from tidal.models.kv_cache import KVCache
from tidal.models.moe import grouped_mm_available, moe_layers
from tidal.models.transformer import Transformer

PREFILL_PAD = 16
"""Prompts are right-padded to a multiple of this many tokens."""


class Steps:
    """The prefill and decode steps of one Generator, over its model, KV cache and row
    state, compiled and captured as `config` asks (see the module docstring).

    Args:
        model: the Generator's model.
        cache: its KV cache (`max_batch` rows).
        rows: the device state of the cache rows, which the steps read and update in place.
        config: the Generator's config (`compile`, `cuda_graphs`, `compile_scope`,
            `tune_kernels`, `batch_invariant`, `amp_dtype`, `prefill_tokens`,
            `fuse_projections`).
        stats: the Generator's counters (prefill calls and tokens, graphs captured).

    Raises:
        ValueError: `compile` or `cuda_graphs` on for a model off CUDA, `compile` with
            `batch_invariant`, `tune_kernels` without compile, `fuse_projections` with
            `batch_invariant` or DTensor parameters.
    """

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        rows: Rows,
        config: GeneratorConfig,
        stats: GeneratorStats,
    ):
        self.model, self.cache, self.rows, self.config, self.stats = (
            model,
            cache,
            rows,
            config,
            stats,
        )
        self.device = model.rope.device
        cfg = config
        sharded = any(isinstance(p, DTensor) for p in model.parameters())
        cuda = self.device.type == "cuda"
        self._graphs_on = cfg.cuda_graphs if cfg.cuda_graphs is not None else cuda and not sharded
        self._compile_on = (
            cfg.compile
            if cfg.compile is not None
            else cuda and not sharded and not cfg.batch_invariant
        )
        if cfg.tune_kernels and not self._compile_on:
            raise ValueError(
                "GeneratorConfig.tune_kernels tunes compiled kernels: it needs compile"
            )
        if (self._graphs_on or self._compile_on) and not cuda:
            raise ValueError("GeneratorConfig.compile / cuda_graphs need a model on a CUDA device")
        if self._compile_on and cfg.batch_invariant:
            raise ValueError(
                "GeneratorConfig.compile=True with batch_invariant=True: compiled kernels fuse "
                "ops differently from the trainer's eager forward; leave compile=None"
            )
        self._moe = moe_layers(model)
        sync = moe_host_sync(model, cfg)
        if self._graphs_on and sync is not None:
            if cfg.cuda_graphs:
                raise ValueError(
                    f"GeneratorConfig.cuda_graphs=True: this mixture-of-experts model's experts "
                    f"read their token counts on the host in each step ({sync}), which a CUDA "
                    "graph cannot capture; leave cuda_graphs=None (off for it)"
                )
            self._graphs_on = False
        self._graphs: dict[tuple[int, bool, bool], Any] = {}
        self._pool: Any = None
        self._fns: dict[bool | str, Any] = {}
        if cfg.compile_scope == "blocks" and not self._compile_on:
            warnings.warn(
                "GeneratorConfig.compile_scope='blocks' is ignored: nothing is compiled "
                "(compile off, a CPU model, batch-invariant mode or DTensor parameters)",
                stacklevel=3,
            )
        self._fused = FusedBlocks(model) if fuse_enabled(cfg, model) else None
        # What the cached forward runs in place of the model's blocks: the compiled block
        # functions, else the fused copies of the blocks, else None (the model's own).
        self._eager_blocks: list[Any] | None = self._fused.blocks if self._fused else None
        self._prefill_fn: Callable[..., torch.Tensor] = self._prefill_forward
        self._blocks: list[Any] | None = self._eager_blocks
        self._compiled: list[Callable[..., torch.Tensor]] | None = None
        self._setup_compile()

    # -- what is compiled and captured ----------------------------------------------------

    @property
    def compiles(self) -> bool:
        """Whether the prefill and decode steps are compiled."""
        return self._compile_on

    @property
    def captures(self) -> bool:
        """Whether decode steps are captured in CUDA graphs."""
        return self._graphs_on

    @property
    def blocks(self) -> list[Callable[..., torch.Tensor]] | None:
        """The compiled block functions the cached forward runs (compile_scope="blocks" with
        compile on), else None."""
        return self._compiled

    @property
    def fused(self) -> int:
        """Attention and MLP modules whose projections run as one product each
        (`GeneratorConfig.fuse_projections`, resolved); 0 when off."""
        return self._fused.fused if self._fused is not None else 0

    @property
    def fused_blocks(self) -> list[Any] | None:
        """The fused copies of the model's blocks, one per layer, that the steps run (compiled
        or not), or None without fused projections."""
        return self._fused.blocks if self._fused is not None else None

    def check_weights(self) -> None:
        """Raise when a parameter the fused projections read was moved to new memory (see
        `FusedBlocks.check`); nothing to check without them."""
        if self._fused is not None:
            self._fused.check()

    def compile_for_testing(self) -> None:
        """Compile as `compile=None` does on CUDA, whatever the device (`Generator`'s test
        seam of the same name)."""
        self._compile_on = True
        self._setup_compile()

    def _setup_compile(self) -> None:
        """The compiled pieces `_compile_on` and `compile_scope` ask for. "step": the prefill
        whole, with dynamic shapes (decode steps are compiled at their first use, in
        `step`). "blocks": one block function shared by every layer, for the prefill and
        the decode steps alike (the batch and time dimensions dynamic from the first call, so
        a few graphs serve every bucket: `compiled_blocks`). Either compiles the fused copies
        of the blocks when projections are fused."""
        self._prefill_fn, self._blocks = self._prefill_forward, self._eager_blocks
        self._compiled = None
        if not self._compile_on:
            return
        if self.config.compile_scope == "step":
            self._prefill_fn = torch.compile(self._prefill_forward, dynamic=True)
            return
        layers = self._eager_blocks or list(self.model.layers.values())
        self._blocks = self._compiled = compiled_blocks(layers, self._inductor_options())

    def _inductor_options(self) -> dict[str, Any] | None:
        return {"coordinate_descent_tuning": True} if self.config.tune_kernels else None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast the steps run under: `amp_dtype`'s, else the caller's, else none."""
        dev = self.device.type
        amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.config.amp_dtype or "")
        if amp is None and torch.is_autocast_enabled(dev):
            amp = torch.get_autocast_dtype(dev)  # the caller's autocast, kept
        if amp is None:
            return contextlib.nullcontext()
        # No cast cache: a captured graph must cast the current weights on every replay.
        return torch.autocast(dev, dtype=amp, cache_enabled=False)

    # -- prefill --------------------------------------------------------------------------

    def prefill(self, admitted: Sequence[tuple[Request, list[int]]]) -> None:
        """Prefill each admitted prompt once into its group's first row (of the rows listed
        with it), copy it to the group's other rows, and sample every row's first token."""
        chunk: list[tuple[Request, list[int]]] = []
        for item in admitted:
            width = round_up(max(r.new_tokens for r, _ in [*chunk, item]), PREFILL_PAD)
            if chunk and width * (len(chunk) + 1) > self.config.prefill_tokens:
                self._prefill_chunk(chunk)
                chunk = []
            chunk.append(item)
        if chunk:
            self._prefill_chunk(chunk)

    def _prefill_forward(self, tokens_PT, positions_PT, rows_P, last_P) -> torch.Tensor:
        return self.model.forward_cached(
            tokens_PT,
            self.cache,
            positions=positions_PT,
            rows=rows_P,
            logits_at=last_P,
            batch_invariant=self.config.batch_invariant,
            # Compiled blocks once the cache exists: its allocation stays out of compiled code.
            blocks=self._blocks if self.cache.allocated else self._eager_blocks,
        )[:, 0]

    def _prefill_chunk(self, chunk: list[tuple[Request, list[int]]]) -> None:
        dev, rows = self.device, self.rows
        capacity = self.cache.capacity
        width = min(round_up(max(r.new_tokens for r, _ in chunk), PREFILL_PAD), capacity)
        tokens = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, (r, _) in enumerate(chunk):
            tokens[i, : r.new_tokens] = torch.tensor(r.prompt[r.start :])
        new = torch.tensor([r.new_tokens for r, _ in chunk])
        first = torch.tensor([slots[0] for _, slots in chunk])
        # A continuation's tokens go after what its row caches. Padding past the row's last
        # position is written at that position (the real tokens end before it: a new token
        # needs it) and, as all padding, rewritten before it is read.
        start = torch.tensor([r.start for r, _ in chunk])
        positions = (start[:, None] + torch.arange(width)).clamp(max=capacity - 1)
        # The first prefill allocates the cache (in the dtype the keys come out in) eagerly,
        # outside any compiled code.
        prefill = self._prefill_fn if self.cache.allocated else self._prefill_forward
        logits_PV = prefill(tokens.to(dev), positions.to(dev), first.to(dev), (new - 1).to(dev))
        self.stats.prefill_calls += 1
        self.stats.prefill_tokens += int(new.sum())
        self.cache.lengths[first.to(dev)] = (start + new).to(dev)
        if rows.route is not None:  # the prompt tokens' experts, at their positions
            valid_PT = torch.arange(width) < new[:, None]
            route_PTLK = torch.stack(
                [_experts(m).view(len(chunk), width, -1) for m in self._moe], 2
            )
            r_M = first[:, None].expand(-1, width)[valid_PT].to(dev)
            rows.route[r_M, :, positions[valid_PT].to(dev)] = route_PTLK[valid_PT.to(dev)].to(
                rows.route.dtype
            )

        # Every slot of a group: copy the prompt's cache row, then per-slot state.
        src = [slots[0] for _, slots in chunk for _ in slots[1:]]
        dst = [s for _, slots in chunk for s in slots[1:]]
        if dst:
            self.cache.copy_rows(torch.tensor(src, device=dev), torch.tensor(dst, device=dev))
            if rows.route is not None:
                rows.route[torch.tensor(dst, device=dev)] = rows.route[
                    torch.tensor(src, device=dev)
                ]
        group = [i for i, (_, slots) in enumerate(chunk) for _ in slots]
        slots_t = torch.tensor([s for _, slots in chunk for s in slots], device=dev)
        params = [(r, j) for r, slots in chunk for j in range(len(slots))]

        def per_slot(values, dtype):
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        rows.temperature[slots_t] = per_slot(
            [r.params.temperature for r, _ in params], torch.float32
        )
        rows.top_k[slots_t] = per_slot([r.params.top_k for r, _ in params], torch.long)
        rows.top_p[slots_t] = per_slot([r.params.top_p for r, _ in params], torch.float32)
        rows.min_p[slots_t] = per_slot([r.params.min_p for r, _ in params], torch.float32)
        rows.max_new[slots_t] = per_slot([r.max_new for r, _ in params], torch.long)
        rows.key[slots_t] = per_slot([r.key(j) for r, j in params], torch.long)
        stop = torch.full((len(params), MAX_STOP_IDS), -1, dtype=torch.long)
        for i, (r, _) in enumerate(params):
            stop[i, : len(r.stop_ids)] = torch.tensor(r.stop_ids, dtype=torch.long)
        rows.stop_ids[slots_t] = stop.to(dev)
        prompt_len = per_slot([len(r.prompt) for r, _ in params], torch.long)

        logits_SV = logits_PV[torch.tensor(group, device=dev)]
        sampled = any(r.params.temperature > 0 for r, _ in params)
        truncate = any(r.params.truncates for r, _ in params)
        zero = torch.zeros(len(params), dtype=torch.long, device=dev)
        tok, lp, slp = sample(
            logits_SV,
            temperature_B=rows.temperature[slots_t],
            top_k_B=rows.top_k[slots_t],
            top_p_B=rows.top_p[slots_t],
            min_p_B=rows.min_p[slots_t],
            keys_B=rows.key[slots_t],
            steps_B=zero,
            sampled=sampled,
            truncate=truncate,
            batch_invariant=self.config.batch_invariant,
        )
        rows.last[slots_t] = tok
        rows.pos[slots_t] = prompt_len
        rows.count[slots_t] = 1
        rows.out_tok[slots_t, 0] = tok
        rows.out_lp[slots_t, 0] = lp
        rows.out_slp[slots_t, 0] = slp
        hit = (tok[:, None] == rows.stop_ids[slots_t]).any(dim=-1)
        rows.done[slots_t] = hit | (rows.max_new[slots_t] <= 1)

    # -- decode ---------------------------------------------------------------------------

    def step(self, b: int, sampled: bool, truncate: bool) -> Callable[[], None]:
        """The decode step of bucket b in a sampler variant, as a call of no arguments: the
        graph's replay when steps are captured (captured now at its first use), else the
        (compiled) step."""
        fn = self.function(variant(sampled, truncate))
        if not self._graphs_on:
            return lambda: fn(b)
        key = (b, sampled, truncate)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(lambda: fn(b))
        return graph.replay

    def function(self, name: str) -> Callable[[int], None]:
        """The decode step of sampler variant `name` as a function of the bucket, compiled
        when the Generator compiles (at the first call for this variant), not captured:
        benchmarks profile its kernels through it."""
        fn = self._fns.get(name)
        if fn is None:
            fn = getattr(self, f"_step_{name}")
            if self._compile_on and self.config.compile_scope == "step":
                fn = torch.compile(fn, dynamic=False, options=self._inductor_options())
            elif self._compile_on:
                record = torch.compile(
                    getattr(self, f"_record_{name}"), options=self._inductor_options()
                )
                fn = functools.partial(self._step_blocks, record)
            self._fns[name] = fn
        return fn

    def warm_up(self, variants: Sequence[str], sizes: Sequence[int]) -> None:
        """Compile and capture the decode step of every bucket in `sizes` (the largest first:
        its compile is the dynamic one) in every sampler variant of `variants`, on rows that
        are all finished (frozen: they compute as running rows do and change nothing)."""
        for name in variants:
            for b in sizes:
                step = self.step(b, name != "greedy", name == "truncated")
                if not self._graphs_on:  # else `step` captured it, running it
                    step()

    def _decode_step(self, b: int, sampled: bool, truncate: bool) -> None:
        """One token for every row of bucket b, in place (no host sync)."""
        self._record(self._decode_logits(b), sampled, truncate)

    def _decode_logits(self, b: int) -> torch.Tensor:
        """The next-token logits [b, V] of the rows of bucket b (their keys and values cached)."""
        rows = self.rows
        logits_BV = self.model.forward_cached(
            rows.last[:b, None],
            self.cache,
            positions=rows.pos[:b, None],
            batch_invariant=self.config.batch_invariant,
            blocks=self._blocks,
        )[:, 0]
        if rows.route is not None:  # each row's token's experts, at its position (no sync)
            route_BLK = torch.stack([_experts(m) for m in self._moe], 1)
            L, K = route_BLK.shape[1:]
            idx_BL1K = rows.pos[:b].view(b, 1, 1, 1).expand(b, L, 1, K)
            rows.route[:b].scatter_(2, idx_BL1K, route_BLK[:, :, None].to(rows.route.dtype))
        return logits_BV

    def _record(self, logits_BV: torch.Tensor, sampled: bool, truncate: bool) -> None:
        """Sample the next token of each of the first b = len(logits_BV) rows, record it and
        its log-probs, and advance the rows' state, in place (no host sync)."""
        rows, b = self.rows, logits_BV.shape[0]
        count_B = rows.count[:b]
        tok, lp, slp = sample(
            logits_BV,
            temperature_B=rows.temperature[:b],
            top_k_B=rows.top_k[:b],
            top_p_B=rows.top_p[:b],
            min_p_B=rows.min_p[:b],
            keys_B=rows.key[:b],
            steps_B=count_B,
            sampled=sampled,
            truncate=truncate,
            batch_invariant=self.config.batch_invariant,
        )
        active_B = ~rows.done[:b]
        # A finished row writes one past its last token (harmless) and stays frozen.
        idx_B1 = count_B[:, None]
        rows.out_tok[:b].scatter_(1, idx_B1, tok[:, None])
        rows.out_lp[:b].scatter_(1, idx_B1, lp[:, None])
        rows.out_slp[:b].scatter_(1, idx_B1, slp[:, None])
        step_B = active_B.long()
        rows.count[:b] += step_B
        rows.pos[:b] += step_B
        rows.last[:b] = torch.where(active_B, tok, rows.last[:b])
        hit_B = (tok[:, None] == rows.stop_ids[:b]).any(dim=-1)
        rows.done[:b] |= active_B & (hit_B | (rows.count[:b] >= rows.max_new[:b]))

    # Three entry points, one per sampler variant, so that torch.compile keeps a cache of
    # its own per variant (one graph per bucket in each, under dynamo's recompile limit).
    def _step_greedy(self, b: int) -> None:
        self._decode_step(b, False, False)

    def _step_sampled(self, b: int) -> None:
        self._decode_step(b, True, False)

    def _step_truncated(self, b: int) -> None:
        self._decode_step(b, True, True)

    # compile_scope="blocks": the step runs eagerly around the compiled blocks, and the
    # sampler and row updates are compiled apart, again one entry point per variant.
    def _step_blocks(self, record: Callable[[torch.Tensor], None], b: int) -> None:
        record(mark_batch(self._decode_logits(b)))  # compiled dynamic in the batch at once

    def _record_greedy(self, logits_BV: torch.Tensor) -> None:
        self._record(logits_BV, False, False)

    def _record_sampled(self, logits_BV: torch.Tensor) -> None:
        self._record(logits_BV, True, False)

    def _record_truncated(self, logits_BV: torch.Tensor) -> None:
        self._record(logits_BV, True, True)

    def _capture(self, step) -> Any:
        """Capture `step` in a CUDA graph. Warm-up runs (compilation, cuBLAS set-up) execute
        real steps, so the row state is saved before and restored after; the cache entries
        they write lie at or past each row's position and are rewritten before being read."""
        saved = [t.clone() for t in self.rows.tensors()]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            step()
        for t, s in zip(self.rows.tensors(), saved, strict=True):
            t.copy_(s)
        self.stats.graphs_captured += 1
        return graph


def _experts(layer: Any) -> torch.Tensor:
    """The experts an MoE layer's last forward chose, [N, K]."""
    assert layer.last_experts_NK is not None
    return layer.last_experts_NK


def moe_host_sync(model: Transformer, config: GeneratorConfig) -> str | None:
    """Why a decode step of this mixture-of-experts model would read the per-expert token
    counts on the host (the experts' loop path, tidal/models/moe.py), or None: a dense model,
    or experts through `torch._grouped_mm` (bf16 on an sm90+ GPU), which has no host sync."""
    layers = moe_layers(model)
    if not layers:
        return None
    if config.batch_invariant:
        return "batch-invariant mode runs one matmul per expert"
    ex = layers[0].experts
    if ex.impl == "loop":
        return "GroupedExperts.impl='loop'"
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.amp_dtype or "")
    dtype = amp or ex.w1.dtype
    if ex.impl == "auto" and not grouped_mm_available(ex.w1, dtype, *ex.w1.shape[1:]):
        return f"no grouped GEMM for {dtype} on {ex.w1.device}: one matmul per expert"
    return None


__all__ = ["PREFILL_PAD", "Steps", "moe_host_sync"]
