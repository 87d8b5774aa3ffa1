"""Text sampling with the training model and a KV cache (for the end-of-run sample)."""

from __future__ import annotations

import torch

from tidal.models.kv_cache import KVCache
from tidal.models.transformer import Transformer


def sample_next(
    logits_BV: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row from the last-position logits: greedy at temperature 0."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV.float() / temperature
    if top_k:
        kth = torch.topk(logits_BV, min(top_k, logits_BV.shape[-1])).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    probs_BV = torch.softmax(logits_BV, dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 50,
    stop_id: int | None = None,
    seed: int = 0,
) -> list[int]:
    """Continue one prompt by up to `max_new_tokens` tokens; returns the new token ids."""
    device = model.rope.device
    capacity = min(model.args.max_seq_len, len(prompt_ids) + max_new_tokens)
    prompt_ids = prompt_ids[-(capacity - max_new_tokens) :] if capacity > max_new_tokens else []
    if not prompt_ids:
        raise ValueError("prompt is empty or leaves no room for max_new_tokens")
    cache = KVCache.for_model(model, batch_size=1, capacity=capacity)
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens_BT = torch.tensor([prompt_ids], device=device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits_BTV = model(tokens_BT, cache=cache)
        cache.advance(tokens_BT.shape[1])
        next_B = sample_next(logits_BTV[:, -1], temperature, top_k, gen)
        token = int(next_B[0])
        if token == stop_id:
            break
        out.append(token)
        tokens_BT = next_B[:, None]
    return out
