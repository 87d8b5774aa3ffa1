"""The compiled pieces of a Generator with compile_scope="blocks" (tidal/generate/generator.py
builds them; `Generator.warm_up` pays for their first compiles before the first `generate`).

A Generator compiles and captures at the first call that needs each piece: the compiled
prefill, each decode step's compile (per batch bucket and sampler variant with
compile_scope="step"; the block function and the sampler with "blocks") and each CUDA graph
(per bucket and variant). In an RL run those first calls fall inside the steps: continuous
batching reaches a bucket it has not met yet, an evaluation is the first greedy call. On one
H200 the RL peer benchmark's sync run (compile_scope="blocks") took 0.34 s a step at the
median but 0.53 s on the mean, from steps of 0.5-4.9 s that compiled or captured.

Two things move them out of the steps:

- `compiled_blocks` (here): compile_scope="blocks"'s block function is called with the batch
  and time dimensions of its activations marked dynamic (`torch._dynamo.maybe_mark_dynamic`),
  so its first compile is the general graph, where dynamo's automatic dynamic shapes would
  compile a static graph for the first size and recompile at the second. Size 1 is still a
  graph of its own (dynamo specializes sizes 0 and 1). `mark_batch` does the same for the
  sampler's compiled row updates.
- `Generator.warm_up`: runs the prefill (once eagerly: it allocates the KV cache; then one
  prompt and several, compiled) and the decode step of every requested (bucket, variant) on
  rows that are all finished (frozen: they compute as running rows do and change nothing),
  which compiles them and captures their CUDA graphs.

Nothing is done on a Generator that neither compiles nor captures (CPU, or both off): eager
code has no first-use cost worth a warm-up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._dynamo import maybe_mark_dynamic


def run_block(
    block: torch.nn.Module,
    x_BTD: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    mask: Any,
    cache: Any,
) -> torch.Tensor:
    """`block(...)`, as a function of the block: compiled once (compile_scope="blocks"), it
    serves every layer, whose weights and cache buffers are inputs of the same graphs."""
    return block(x_BTD, rope, mask, cache)


def compiled_blocks(
    layers: Sequence[torch.nn.Module], options: dict[str, Any] | None
) -> list[Callable[..., torch.Tensor]]:
    """One compiled `run_block` for every layer, as `Transformer.forward_cached(blocks=...)` calls
    them. The first layer's call marks the batch and time dimensions of what a forward hands
    every block (the hidden states, RoPE tables, query positions, cache rows) dynamic, so a
    compile is dynamic in them from the first size on; the later layers get the first one's
    output, and hit its graph."""
    block_fn = torch.compile(run_block, options=options)

    def first(block, x_BTD, rope, mask, cache) -> torch.Tensor:
        for t in (x_BTD, *rope, getattr(mask, "positions", None)):
            if t is not None:
                maybe_mark_dynamic(t, 0)  # batch (prompts in a prefill, rows in a step)
                maybe_mark_dynamic(t, 1)  # time (a prefill's padded width)
        rows = getattr(mask, "rows", None)
        if rows is not None:
            maybe_mark_dynamic(rows, 0)
        return block_fn(block, x_BTD, rope, mask, cache)

    return [functools.partial(first if i == 0 else block_fn, b) for i, b in enumerate(layers)]


def mark_batch(logits_BV: torch.Tensor) -> torch.Tensor:
    """`logits_BV` with its batch dimension marked dynamic (for a compiled sampler)."""
    maybe_mark_dynamic(logits_BV, 0)
    return logits_BV
