"""Key/value cache for generation with the training model code.

Lifecycle: the generator allocates one `KVCache` for a batch, calls the model on the prompt
(prefill, `length` 0), then on one new token at a time; after each call it advances
`cache.length` by the number of tokens it fed. Every layer appends its keys and values at
`length` and attends over `[0, length + T)`.

Shape legend: B batch, G key/value heads, T new tokens, S cache capacity, K head dim.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values for every layer: [n_layers, B, G, S, K] each.

    The buffers are allocated at the first `update`, in the dtype, device and head count of
    the keys the model produces (bf16 under autocast, G / tp heads under tensor parallel),
    unless `dtype`/`device` are given.
    """

    def __init__(
        self,
        *,
        n_layers: int,
        batch_size: int,
        capacity: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        self.n_layers, self.batch_size, self.capacity = n_layers, batch_size, capacity
        self.dtype, self.device = dtype, device
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0
        """Tokens already cached (the absolute position of the next token)."""

    @classmethod
    def for_model(cls, model, batch_size: int, capacity: int | None = None, **kw) -> KVCache:
        """A cache sized for `model` (a tidal Transformer)."""
        a = model.args
        capacity = capacity or a.max_seq_len
        if capacity > a.max_seq_len:
            raise ValueError(f"cache capacity {capacity} exceeds max_seq_len={a.max_seq_len}")
        return cls(n_layers=a.n_layers, batch_size=batch_size, capacity=capacity, **kw)

    def update(
        self, layer: int, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values of `layer` at `length`; return the whole valid prefix."""
        B, G, T, K = k_BGTK.shape
        if self.k is None or self.v is None:
            shape = (self.n_layers, B, G, self.capacity, K)
            dtype, device = self.dtype or k_BGTK.dtype, self.device or k_BGTK.device
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
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
