"""Key/value cache for generation with the training model code.

Lifecycle: the generator allocates one `KVCache` for a batch, calls the model on the prompt
(prefill, `length` 0), then on one new token at a time; after each call it advances
`cache.length` by the number of tokens it fed. Every layer appends its keys and values at
`length` and attends over `[0, length + T)`.

Shape legend: B batch, G key/value heads, S cache capacity, K head dim.
"""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated keys and values for every layer: [n_layers, B, G, S, K] each."""

    def __init__(
        self,
        *,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        shape = (n_layers, batch_size, n_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0
        """Tokens already cached (the absolute position of the next token)."""

    @classmethod
    def for_model(cls, model, batch_size: int, capacity: int | None = None, **kw) -> KVCache:
        """A cache shaped for `model` (a tidal Transformer)."""
        a = model.args
        capacity = capacity or a.max_seq_len
        if capacity > a.max_seq_len:
            raise ValueError(f"cache capacity {capacity} exceeds max_seq_len={a.max_seq_len}")
        kw.setdefault("device", model.rope.device)
        return cls(
            n_layers=a.n_layers,
            batch_size=batch_size,
            n_kv_heads=a.n_kv_heads,
            head_dim=a.k,
            capacity=capacity,
            **kw,
        )

    def update(
        self, layer: int, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values of `layer` at `length`; return the whole valid prefix."""
        T = k_BGTK.shape[2]
        end = self.length + T
        if end > self.capacity:
            raise ValueError(f"KV cache full: {end} tokens > capacity {self.capacity}")
        self.k[layer, :, :, self.length : end] = k_BGTK
        self.v[layer, :, :, self.length : end] = v_BGTK
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        """Mark `n` more tokens as cached (call once per forward, after all layers ran)."""
        self.length += n

    def reset(self) -> None:
        self.length = 0
