"""Static key/value cache with per-row lengths, for generation with the training model code.

Lifecycle: a generator allocates one `KVCache` of `batch_size` rows ("slots") and `capacity`
positions per row, once. Each forward with the cache writes the new keys/values of every layer
at the tokens' absolute positions (one position per token, so rows of one batch may be at
different lengths) and attends over the cached prefix of each row. The buffers never move or
grow, so a captured CUDA graph that reads and writes them stays valid; a row is reused by
writing a new prompt over it from position 0 (stale entries past a row's length are masked).

- `lengths[b]`: tokens cached in row b (the position its next token goes to). The model does
  not read it when the caller gives positions; `advance` and `copy_rows` keep it current.
- Rows: a forward over B rows uses cache rows 0..B-1 (a bucket of the first rows, read as a
  view), or the rows named by a `rows` index tensor (a prefill into free slots, read by gather).
- Sharing a prompt: `copy_rows(src, dst)` copies whole rows, so a prompt prefilled once serves
  every sample of its group.

Shape legend: L layers, B batch (cache rows), G key/value heads, T new tokens, S capacity,
K head dim.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One layer's keys and values: a view of a `KVCache` that a block writes and reads.

    A block receives its own `LayerCache` (`cache.layers[i]`), not the whole cache and a
    layer index: compiled per block, every layer then runs one compiled graph (the buffers
    are graph inputs like the block's weights), where a Python int index would be a constant
    of the graph and cost one compile per layer.
    """

    def __init__(self, cache: KVCache):
        self._cache = cache
        self.k: torch.Tensor | None = None
        """Keys [B, G, S, K] of every cache row; None until the cache is allocated."""
        self.v: torch.Tensor | None = None
        """Values [B, G, S, K]."""

    def update(
        self,
        k_BGTK: torch.Tensor,
        v_BGTK: torch.Tensor,
        positions_BT: torch.Tensor,
        rows_B: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this layer's new keys/values at their positions; return the rows' buffers.

        Args:
            k_BGTK, v_BGTK: keys and values of the T new tokens of each of the B rows.
            positions_BT: absolute position of each new token (< capacity; not checked here,
                the caller keeps positions in range without reading them back).
            rows_B: cache rows of the batch's rows; None for rows 0..B-1.

        Returns:
            Keys and values [B, G, S, K] of the batch's rows, every position; positions past a
            row's length hold stale values that the attention mask must hide.
        """
        B, G, T, K = k_BGTK.shape
        if self.k is None or self.v is None:  # the first write allocates every layer
            self._cache.allocate(G, K, k_BGTK.dtype)
        k_cache, v_cache = self.k, self.v
        assert k_cache is not None and v_cache is not None
        rows = rows_B if rows_B is not None else torch.arange(B, device=k_cache.device)
        # Advanced indices on dims 0 and 2 (split by the head slice) put the index shape
        # first: the destination is [B, T, G, K], the keys in time-major order.
        index = (rows[:, None], slice(None), positions_BT)
        k_cache[index] = k_BGTK.transpose(1, 2).to(k_cache.dtype)
        v_cache[index] = v_BGTK.transpose(1, 2).to(v_cache.dtype)
        if rows_B is None:
            return k_cache[:B], v_cache[:B]
        return k_cache[rows_B], v_cache[rows_B]


class KVCache:
    """Keys and values of every layer, one [B, G, S, K] buffer per layer and kind.

    The buffers are allocated at the first write, in the dtype, device and head count of the
    keys the model produces (bf16 under autocast, G / tp heads under tensor parallel), unless
    `dtype` is given. One buffer per layer (not one [L, ...] tensor) keeps every write an
    in-place update of a whole graph input when the decode step is compiled. Layer i's block
    reads and writes them through `layers[i]` (a `LayerCache`).

    Example::

        cache = KVCache.for_model(model, batch_size=2, capacity=64)
        model.forward_cached(prompt_BT, cache)  # writes positions 0..T-1 of rows 0 and 1
        cache.advance(prompt_BT.shape[1])
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
        if batch_size < 1 or capacity < 1:
            raise ValueError(
                f"KVCache needs batch_size >= 1 and capacity >= 1, got {batch_size}, {capacity}"
            )
        self.n_layers, self.batch_size, self.capacity = n_layers, batch_size, capacity
        self.dtype = dtype
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        """Tokens cached per row [B] (the absolute position of each row's next token)."""
        self.layers = [LayerCache(self) for _ in range(n_layers)]
        """Each layer's view of the buffers, handed to its block by the model."""

    @classmethod
    def for_model(cls, model, batch_size: int, capacity: int | None = None, **kw) -> KVCache:
        """A cache sized for `model` (a tidal Transformer), on the model's device."""
        a = model.args
        capacity = capacity or a.max_seq_len
        if capacity > a.max_seq_len:
            raise ValueError(f"cache capacity {capacity} exceeds max_seq_len={a.max_seq_len}")
        kw.setdefault("device", model.rope.device)
        return cls(n_layers=a.n_layers, batch_size=batch_size, capacity=capacity, **kw)

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    def allocate(self, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """Allocate the buffers now (zeros), for keys with `n_kv_heads` local heads."""
        shape = (self.batch_size, n_kv_heads, self.capacity, head_dim)
        dtype, device = self.dtype or dtype, self.lengths.device
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.n_layers)]
        for layer, k, v in zip(self.layers, self.k, self.v, strict=True):
            layer.k, layer.v = k, v

    def advance(self, n: int | torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Mark `n` more tokens as cached in `rows` (every row when None); `n` may be a
        per-row tensor."""
        if rows is None:
            self.lengths += n
        else:
            self.lengths[rows] += n

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole rows `src[i]` -> `dst[i]` in every layer (and their lengths)."""
        for buf in (*self.k, *self.v):
            buf[dst] = buf[src]
        self.lengths[dst] = self.lengths[src]

    def reset(self) -> None:
        """Forget every row (the buffers stay allocated)."""
        self.lengths.zero_()
