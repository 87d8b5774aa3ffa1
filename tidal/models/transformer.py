"""Llama 3, Qwen 2 / 2.5, Qwen 3 and Qwen 3 MoE decoder-only transformers, in one file.

The families share one block structure; the differences are flags on `ModelArgs`:

- Token embedding, then `n_layers` pre-norm blocks, a final RMSNorm and an output projection.
- Attention: grouped-query attention (GQA, `n_kv_heads` <= `n_heads`), rotary position
  embeddings in the rotate-half layout that Hugging Face checkpoints use (so weights load
  without a permutation), no biases except Qwen 2's. Llama 3.1 frequency scaling
  (`rope_scaling`) for the Llama flavors that have it. Qwen 2 / 2.5 adds biases on the
  query, key and value projections only (`qkv_bias`; the output projection and the MLP have
  none) and uses RoPE base 1e6; its sliding-window attention is off in every released
  checkpoint, and tidal, which implements full causal attention only, refuses a config that
  turns it on (tidal/models/hf/qwen2.py). Qwen 3 drops the biases and adds a per-head
  RMSNorm on queries and keys (QK-norm) and a head dim that need not equal dim / n_heads.
- MLP: SwiGLU, `w2(silu(w1 x) * w3 x)`; or, with `ModelArgs.moe`, a mixture of SwiGLU
  experts in every block (Qwen 3 MoE, with DeepSeek V3's shared experts and aux-loss-free
  balancing as options: tidal/models/moe.py).
- Norms: RMSNorm everywhere (eps 1e-5 for Llama, 1e-6 for Qwen).
- Output: a separate projection, or tied to the embedding (`tie_embeddings`: Llama 3.2 1B,
  Qwen 2.5 0.5B and 1.5B, small Qwen 3).
- Attention kernels: `scaled_dot_product_attention` (causal) by default; flex attention with
  a document-causal block mask for packed sequences when `attention="flex"`.
- Generation: `forward_cached` runs the same blocks over a `KVCache` (per-row lengths) at
  per-row positions, so a generator steps rows of different lengths with this same module
  (see tidal/models/kv_cache.py and tidal/generate/generator.py). Each block gets its own
  layer's cache and reads no layer index, so one compiled block serves every layer;
  `forward_cached(blocks=...)` runs a generator's compiled copies of the blocks without
  changing the model.
- Batch-invariant mode (`forward(..., batch_invariant=True)`): matmuls, norms and attention
  with reduction orders that do not depend on the batch, the sequence length or prefill vs
  decode (tidal/models/batch_invariant.py), so generator and trainer log-probs match bit for bit.
- Training hooks: `forward(..., head=fn)` hands the final hidden states and `output_weight()`
  to `fn` in place of the logits (the fused loss of tidal/train/loss.py), and
  `fuse_projections()` computes Q/K/V and W1/W3 as one product each (`Attention.project`
  and `FeedForward.gate_up`, which a generator's fused copies of the modules override).

The model knows nothing of devices, ranks or precision: build it on the meta device, move it
with `to_empty(device=...)`, then call `init_weights()` once.

Shape legend: B batch, T query time, S key time (cache length), D model dim, H query heads,
G key/value heads, K head dim, E a projection's features (heads x head dim), F MLP hidden dim,
V vocabulary.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from tidal.models import batch_invariant as bi
from tidal.models.kv_cache import KVCache, LayerCache
from tidal.models.moe import MoE, MoEArgs


@dataclass(kw_only=True, frozen=True, slots=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling (long-context extension of the base frequencies)."""

    factor: float = 8.0
    """How much the low frequencies are stretched."""
    low_freq_factor: float = 1.0
    """Wavelengths above original_max_seq_len / low_freq_factor are fully scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths below original_max_seq_len / high_freq_factor are left alone."""
    original_max_seq_len: int = 8192
    """Context length the base frequencies were trained for."""


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelArgs:
    """Architecture of one decoder. Named flavors live in tidal/models/flavors.py."""

    family: Literal["llama3", "qwen2", "qwen3", "qwen3_moe"] = "llama3"
    """Model family; selects nothing by itself but names the checkpoint format."""
    dim: int = 256
    """Model (residual stream) width D."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 8
    """Query heads H."""
    n_kv_heads: int = 4
    """Key/value heads G; must divide n_heads (GQA)."""
    head_dim: int | None = None
    """Head dim K; derived as dim // n_heads when None."""
    ffn_dim: int = 768
    """SwiGLU hidden width F (of the dense MLP; with `moe`, Hugging Face's intermediate_size,
    kept for its config.json)."""
    vocab_size: int = 4096
    """Vocabulary size V (rows of the embedding)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500_000.0
    """RoPE base frequency."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1 frequency scaling, or None."""
    qk_norm: bool = False
    """RMSNorm on each query and key head before RoPE (Qwen 3)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen 2 / 2.5); initialized to zero."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the output projection."""
    max_seq_len: int = 2048
    """Longest sequence (prompt plus generation) the RoPE tables cover."""
    attention: Literal["sdpa", "flex"] = "sdpa"
    """Attention kernel: causal SDPA, or flex attention with document-causal masking."""
    moe: MoEArgs | None = None
    """Mixture-of-experts MLP in every block (tidal/models/moe.py); None for a dense model."""
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    """Free-form notes (e.g. the published parameter count); not used by the math."""

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.k % 2:
            raise ValueError(f"head dim {self.k} must be even for RoPE")
        if self.attention not in ("sdpa", "flex"):
            raise ValueError(f"attention must be 'sdpa' or 'flex', got {self.attention!r}")

    @property
    def k(self) -> int:
        """Head dim K."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads


def rope_frequencies(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies [K/2] in fp32, with Llama 3.1 scaling applied when configured."""
    k = args.k
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, k, 2, device=device).float() / k))
    s = args.rope_scaling
    if s is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_wavelen = s.original_max_seq_len / s.high_freq_factor
    # Between the two wavelengths, interpolate smoothly between scaled and unscaled.
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    middle = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(middle, interpolated, out)


def rope_tables(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """cos and sin for every position, stacked as [2, max_seq_len, K] (rotate-half layout)."""
    inv_freq = rope_frequencies(args, device)
    t = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    angles_TK = torch.outer(t, inv_freq).repeat(1, 2)  # both halves share the frequencies
    return torch.stack([angles_TK.cos(), angles_TK.sin()])


def apply_rope(x_BTHK: torch.Tensor, cos_BTK: torch.Tensor, sin_BTK: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + K/2) of each head by the angle of its position.

    Computed in the activations' dtype, as the Hugging Face reference does (the tables are
    fp32 and cast here): under bf16 autocast this is 3.5% faster per Llama 3 1B step on an
    H200 than an fp32 rotation, and matches the numerics of HF checkpoints.
    """
    x1, x2 = x_BTHK.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    cos, sin = cos_BTK.unsqueeze(2).to(x_BTHK.dtype), sin_BTK.unsqueeze(2).to(x_BTHK.dtype)
    return x_BTHK * cos + rotated * sin


class Attention(nn.Module):
    FUSABLE = ("wq", "wk", "wv")

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.k
        self.kind = args.attention
        self.wq = nn.Linear(args.dim, args.n_heads * args.k, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.k, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.k, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.k, args.dim, bias=False)
        self.fused = False  # one product for Q, K and V (`Transformer.fuse_projections`)
        self.q_norm: nn.RMSNorm | None = None
        self.k_norm: nn.RMSNorm | None = None
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(args.k, eps=args.norm_eps)
            self.k_norm = nn.RMSNorm(args.k, eps=args.norm_eps)

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMask,
        cache: LayerCache | None,
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BTE, k_BTE, v_BTE = self.project(x_BTD)
        # -1 instead of the head count keeps the views valid when TP shards the heads.
        q_BTHK = q_BTE.view(B, T, -1, self.head_dim)
        k_BTGK = k_BTE.view(B, T, -1, self.head_dim)
        v_BTGK = v_BTE.view(B, T, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        q_BTHK, k_BTGK = apply_rope(q_BTHK, *rope), apply_rope(k_BTGK, *rope)

        # Kernels want heads before time.
        q_BHTK, k_BGSK, v_BGSK = (t.transpose(1, 2) for t in (q_BTHK, k_BTGK, v_BTGK))
        if cache is not None:  # the mask of a cached forward knows where the tokens go
            assert mask.positions is not None, "a cached forward needs token positions"
            k_BGSK, v_BGSK = cache.update(k_BGSK, v_BGSK, mask.positions, mask.rows)
        o_BHTK = mask.attend(q_BHTK, k_BGSK, v_BGSK)
        return self.wo(o_BHTK.transpose(1, 2).reshape(B, T, -1))

    def project(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query, key and value projections [B, T, E] of `x_BTD`: three products, or one
        over the concatenated weights when `fused`. A generator's fused copy of the module
        (tidal/generate/fused.py) overrides it with one product over weights it holds."""
        if not self.fused:
            return self.wq(x_BTD), self.wk(x_BTD), self.wv(x_BTD)
        projections = (self.wq.weight, self.wk.weight, self.wv.weight)
        biases = (self.wq.bias, self.wk.bias, self.wv.bias)  # all None, or all set
        bias_E = torch.cat(biases) if biases[0] is not None else None
        # One product over the stacked weights, split back along the features (views).
        qkv_BTE = F.linear(x_BTD, torch.cat(projections), bias_E)
        q_BTE, k_BTE, v_BTE = qkv_BTE.split([w.shape[0] for w in projections], dim=-1)
        return q_BTE, k_BTE, v_BTE


class FeedForward(nn.Module):
    FUSABLE = ("w1", "w3")

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.fused = False  # one product for W1 and W3 (`Transformer.fuse_projections`)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        gate_BTF, up_BTF = self.gate_up(x_BTD)
        return self.w2(F.silu(gate_BTF) * up_BTF)

    def gate_up(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate and up projections [B, T, F] of `x_BTD`: two products, or one over the
        concatenated weights when `fused`. A generator's fused copy of the module
        (tidal/generate/fused.py) overrides it with one product over weights it holds."""
        if not self.fused:
            return self.w1(x_BTD), self.w3(x_BTD)
        w13 = torch.cat((self.w1.weight, self.w3.weight))
        gate_BTF, up_BTF = F.linear(x_BTD, w13).chunk(2, dim=-1)
        return gate_BTF, up_BTF


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward: FeedForward | MoE = (
            FeedForward(args.dim, args.ffn_dim) if args.moe is None else MoE(args.dim, args.moe)
        )

    def forward(self, x_BTD, rope, mask, cache: LayerCache | None = None):
        """`cache`: this layer's view of the KV cache (`KVCache.layers[layer_id]`). The block
        reads no layer index, so one compiled graph serves every layer."""
        h_BTD = x_BTD + self.attention(self.attention_norm(x_BTD), rope, mask, cache)
        return h_BTD + self.feed_forward(self.ffn_norm(h_BTD))


class AttentionMask:
    """How queries may see keys in one forward pass, shared by every layer.

    - causal: plain causal attention over the new tokens (training, scoring);
    - cache: queries at per-row absolute `positions` [B, T] see the cache positions up to
      their own (rows of different lengths, prefill or decode); `rows` names the cache rows
      (None: rows 0..B-1);
    - document: flex attention restricted to the same document (packed sequences);
    - dense: SDPA with an explicit [B, T, T] mask of the keys each query sees (`visible`):
      the same document masking without flex (packed chat samples on CPU; on a GPU flex
      is faster, as SDPA with a mask cannot use the flash kernel).

    With `batch_invariant`, causal and cache attention use the fixed-order chunked kernel of
    tidal/models/batch_invariant.py, so a query gets the same bits in training and decoding.
    """

    def __init__(
        self,
        kind: str,
        *,
        positions: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        block_mask=None,
        visible: torch.Tensor | None = None,
        batch_invariant: bool = False,
    ):
        self.kind, self.positions, self.rows = kind, positions, rows
        self.block_mask, self.batch_invariant = block_mask, batch_invariant
        self.visible_BTS = visible

    def attend(self, q_BHTK, k_BGSK, v_BGSK) -> torch.Tensor:
        if self.kind == "document":
            from torch.nn.attention.flex_attention import flex_attention

            return flex_attention(
                q_BHTK, k_BGSK, v_BGSK, block_mask=self.block_mask, enable_gqa=True
            )
        B, _, T, _ = q_BHTK.shape
        if self.batch_invariant:
            q_pos_BT = self.positions
            if q_pos_BT is None:  # causal: the keys are the new tokens, in order
                q_pos_BT = torch.arange(T, device=q_BHTK.device).expand(B, T)
            return bi.attention(q_BHTK, k_BGSK, v_BGSK, q_pos_BT)
        if self.kind == "causal":
            return F.scaled_dot_product_attention(
                q_BHTK, k_BGSK, v_BGSK, is_causal=True, enable_gqa=True
            )
        if self.kind == "dense":
            assert self.visible_BTS is not None, "dense attention needs its mask"
            return F.scaled_dot_product_attention(
                q_BHTK, k_BGSK, v_BGSK, attn_mask=self.visible_BTS[:, None], enable_gqa=True
            )
        assert self.positions is not None, "cache attention needs the query positions"
        S = k_BGSK.shape[2]
        # Cache slot s holds position s: a query sees the slots up to its own position;
        # slots past a row's length (stale keys of an earlier occupant) stay hidden.
        visible_BTS = torch.arange(S, device=q_BHTK.device) <= self.positions[:, :, None]
        return F.scaled_dot_product_attention(
            q_BHTK, k_BGSK, v_BGSK, attn_mask=visible_BTS[:, None], enable_gqa=True
        )


def document_causal(document_ids_BT: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool: query t sees key s when s <= t and both are in the same document."""
    T = document_ids_BT.shape[1]
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=document_ids_BT.device).tril()
    return causal_TT & (document_ids_BT[:, :, None] == document_ids_BT[:, None, :])


def document_block_mask(document_ids_BT: torch.Tensor):
    """Flex-attention block mask: causal, and only within the same document."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = document_ids_BT.shape

    def same_doc_causal(b, h, q, kv):
        return (q >= kv) & (document_ids_BT[b, q] == document_ids_BT[b, kv])

    return create_block_mask(same_doc_causal, B, None, T, T, device=document_ids_BT.device)


class Transformer(nn.Module):
    """Decoder-only language model. See the module docstring for the architecture."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        # Pipeline stages set the ends they do not own to None (tidal/parallel/pipeline.py).
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by layer index keeps names stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Tied embeddings reuse tok_embeddings.weight in forward (no second parameter object,
        # so to_empty and FSDP never see a shared parameter).
        self.output: nn.Linear | None = (
            None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        )
        # cos/sin tables are derived, not learned: left out of state dicts.
        self.rope: torch.Tensor
        self.register_buffer("rope", rope_tables(args), persistent=False)

    def fuse_projections(self) -> int:
        """Compute Q, K and V as one product with the concatenated weights (and biases, with
        `qkv_bias`), and W1 and W3 as another, in every block whose projections are plain
        `nn.Linear` layers without hooks (a float8 layer, or one that tensor parallelism
        wrapped with its input and output hooks, keeps its own product). Parameters and
        state-dict keys do not change.

        The weights are concatenated on each forward and the concatenation is saved for
        backward. With fp32 weights under bf16 autocast that takes the place of the bf16 copies
        autocast saves anyway (compiled, one kernel makes it); with weights already in the
        compute dtype (FSDP's bf16 parameters, plain fp32) it is one more copy of each layer's
        projection weights held until backward. A decoding step would copy the weights for a
        few tokens: fuse models that train, not generators (a Generator fuses its own way,
        over weights laid out once: `GeneratorConfig.fuse_projections`). Returns the number
        of fused modules."""
        fused = 0
        for module in self.modules():
            if isinstance(module, (Attention, FeedForward)) and all(
                plain_linear(getattr(module, name)) for name in module.FUSABLE
            ):
                module.fused = True
                fused += 1
        return fused

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise every parameter and buffer in place (after `to_empty`).

        Linear weights (and stacked experts) are truncated normals with std 0.02, the
        residual-branch outputs (wo, w2) scaled down with depth, the output projection with
        std dim**-0.5, norms at one, biases (Qwen 2's q/k/v, MoE expert biases) at zero.
        Each parameter draws from its own generator seeded by (seed, parameter name), so a
        parameter gets the same values whichever other parameters exist in this process (a
        pipeline stage) and however it is sharded.
        """
        device = self.rope.device
        self.rope.copy_(rope_tables(self.args, device=device))
        for module in self.modules():
            if isinstance(module, MoE):
                module.init_buffers()
        for name, param in self.named_parameters():
            # Names as in the state dict: wrappers (activation checkpointing, compile) that a
            # parallelize step may have put around blocks add segments that are not saved.
            name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
            if name.endswith(".bias"):
                param.zero_()
                continue
            std = self._init_std(name)
            if std is None:
                param.fill_(1.0)  # RMSNorm scales
            else:
                _normal(param, std, _generator(seed, name, param))

    def _init_std(self, name: str) -> float | None:
        if name == "tok_embeddings.weight":
            return self.args.dim**-0.5 if self.args.tie_embeddings else 1.0
        if name == "output.weight":
            return self.args.dim**-0.5
        if "norm" in name.rsplit(".", 2)[-2]:
            return None
        if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
            layer_id = int(name.split(".")[1])
            return 0.02 / math.sqrt(2 * (layer_id + 1))
        return 0.02

    def forward(
        self,
        tokens_BT: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        attention=None,
        head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        """Logits [B, T, V] for the given tokens: the training and scoring forward (causal,
        no cache; a generator's prefill and decode steps go through `forward_cached`).

        Args:
            tokens_BT: token ids; hidden states [B, T, D] on pipeline stages that have no
                embedding (their `tok_embeddings` is None; stages without `norm` return
                hidden states).
            positions: absolute positions [B, T] or [T] for RoPE; defaults to arange(T).
            document_ids: [B, T] document index of each token, for document-causal masking:
                with flex attention a block mask, with SDPA a dense [B, T, T] mask (None:
                plainly causal; ignored with batch_invariant).
            attention: an object with `attend(q_BHTK, k_BGTK, v_BGTK)` that replaces the
                built-in masking for this call (context parallelism supplies one that
                gathers keys over ranks); `positions` should then be given.
            head: called as `head(h_BTD, weight_VD)` on the final normed hidden states and
                the output projection's weight (the embedding's when tied); its result is
                returned in place of the logits. A loss that fuses the projection
                (`tidal.train.loss.linear_cross_entropy_sum`) runs this way inside the
                forward, where FSDP holds the weight unsharded; `head=lambda h, w: h` returns
                the hidden states.
            batch_invariant: compute with the fixed-reduction-order kernels of
                tidal/models/batch_invariant.py (causal SDPA only): each row's result is then
                independent of the other rows, the padding and the split into prefill and
                decode steps. Slower; for exact log-prob parity with a generator.
        """
        B, T = tokens_BT.shape[:2]
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds max_seq_len={self.args.max_seq_len}")
        self._check_batch_invariant(batch_invariant, attention)
        if positions is None:
            positions = torch.arange(T, device=tokens_BT.device)
        rope = self._rope_at(positions, B, T)
        if attention is not None:
            mask = attention
        elif self.args.attention == "flex":
            if document_ids is None:
                document_ids = torch.zeros(B, T, dtype=torch.int32, device=tokens_BT.device)
            mask = AttentionMask("document", block_mask=document_block_mask(document_ids))
        elif document_ids is not None and not batch_invariant:
            mask = AttentionMask("dense", visible=document_causal(document_ids))
        else:
            mask = AttentionMask("causal", batch_invariant=batch_invariant)

        with bi.BatchInvariantMode() if batch_invariant else contextlib.nullcontext():
            h_BTD = self._hidden_states(tokens_BT, rope, mask)
            if self.norm is None:  # a pipeline stage before the last
                return h_BTD
            h_BTD = self.norm(h_BTD)
            if head is not None:
                return head(h_BTD, self.output_weight())
            return self.logits(h_BTD)

    def forward_cached(
        self,
        tokens_BT: torch.Tensor,
        cache: KVCache,
        *,
        positions: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        batch_invariant: bool = False,
        blocks: Sequence[Callable[..., torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] of a prefill or decode step over a KV cache: the new keys and
        values are written at their positions and each query attends over its row's cached
        prefix (the caller advances the cache). A model wrapped by FSDP2 registers this
        method as a forward (tidal/parallel/parallelize.py).

        Args:
            tokens_BT: token ids of the new tokens.
            cache: the KVCache (tidal/models/kv_cache.py).
            positions: absolute positions [B, T] or [T] (RoPE, and where each token's keys
                go); defaults to each row's `cache.lengths` + arange(T).
            rows: [B] cache rows of the batch's rows (a prefill into free slots); None for
                rows 0..B-1.
            logits_at: [B] time index per row: project only that position ([B, 1, V]), e.g.
                the last prompt token of each right-padded row in a prefill.
            batch_invariant: the fixed-reduction-order kernels (see `forward`): a row's
                logits are bitwise those of the training forward over the same tokens.
            blocks: callables run in place of `self.layers`' blocks, one per block, in order,
                each called as the block is: `fn(h_BTD, (cos, sin), mask, layer_cache)`. A
                generator passes its compiled copies (`torch.compile` of the same blocks)
                this way, so the model object itself is left as the trainer uses it.
        """
        B, T = tokens_BT.shape[:2]
        self._check_batch_invariant(batch_invariant, None)
        if blocks is not None and len(blocks) != len(self.layers):
            raise ValueError(f"blocks has {len(blocks)} callables, the model {len(self.layers)}")
        if positions is None:
            lengths = cache.lengths[:B] if rows is None else cache.lengths[rows]
            positions = lengths[:, None] + torch.arange(T, device=tokens_BT.device)
        if positions.dim() == 1:
            positions = positions.expand(B, T)
        rope = self._rope_at(positions, B, T)
        mask = AttentionMask(
            "cache", positions=positions, rows=rows, batch_invariant=batch_invariant
        )
        with bi.BatchInvariantMode() if batch_invariant else contextlib.nullcontext():
            h_BTD = self._hidden_states(tokens_BT, rope, mask, cache, blocks)
            if self.norm is None:  # a pipeline stage before the last
                return h_BTD
            if logits_at is not None:
                h_BTD = h_BTD[torch.arange(B, device=h_BTD.device), logits_at][:, None]
            return self.logits(self.norm(h_BTD))

    def _check_batch_invariant(self, batch_invariant: bool, attention) -> None:
        if batch_invariant and (attention is not None or self.args.attention == "flex"):
            raise ValueError(
                "batch_invariant=True supports the causal SDPA path and the KV cache only "
                f"(attention={self.args.attention!r}, custom attention "
                f"{attention is not None})"
            )

    def _rope_at(
        self, positions: torch.Tensor, B: int, T: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables (cos, sin) [B, T, K] at `positions` ([B, T], or [T] for the batch)."""
        cos, sin = self.rope[0][positions], self.rope[1][positions]
        if cos.dim() == 2:  # one position vector shared by the batch
            cos, sin = cos.expand(B, T, -1), sin.expand(B, T, -1)
        return cos, sin

    def _hidden_states(
        self,
        tokens_BT: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask,
        cache: KVCache | None = None,
        blocks: Sequence[Callable[..., torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """The embedding (on a stage that has it) and every block: the hidden states [B, T, D]
        before the final norm."""
        # Pipeline stages after the first have no embedding and receive hidden states.
        h_BTD = self.tok_embeddings(tokens_BT) if self.tok_embeddings is not None else tokens_BT
        # A ModuleDict key is the layer's index in the full model (pipeline stages hold a
        # subset): it names the layer's part of the cache.
        for i, name in enumerate(self.layers):
            block = blocks[i] if blocks is not None else self.layers[name]
            layer_cache = cache.layers[int(name)] if cache is not None else None
            h_BTD = block(h_BTD, rope, mask, layer_cache)
        return h_BTD

    def output_weight(self) -> torch.Tensor:
        """The output projection's weight [V, D]: the embedding's with tied embeddings."""
        if self.output is not None:
            return self.output.weight
        assert self.tok_embeddings is not None, "tied output needs the embedding on this stage"
        return self.tok_embeddings.weight

    def logits(self, h_BTD: torch.Tensor) -> torch.Tensor:
        """Output projection of final hidden states: [..., D] -> [..., V]."""
        if self.output is not None:
            return self.output(h_BTD)
        return F.linear(h_BTD, self.output_weight())


def plain_linear(module: nn.Module) -> bool:
    """Whether `module` is exactly an `nn.Linear` without forward hooks (not a float8 layer,
    nor one that tensor parallelism wrapped): one whose product may be fused with others."""
    return type(module) is nn.Linear and not module._forward_pre_hooks and not module._forward_hooks


def _generator(seed: int, name: str, param: torch.Tensor) -> torch.Generator:
    from torch.distributed.tensor import DTensor

    device = param.to_local().device if isinstance(param, DTensor) else param.device
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _normal(w: torch.Tensor, std: float, gen: torch.Generator | None) -> None:
    """Truncated normal init. A sharded (DTensor) weight gets its slice of the full tensor
    drawn from the same generator, so every layout initializes the same values as one
    process with the same seed."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(w, DTensor):
        nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=gen)
        return
    full = torch.empty(w.shape, dtype=w.dtype, device=w.to_local().device)
    nn.init.trunc_normal_(full, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=gen)
    # src_data_rank=None: every rank already holds the full tensor; slice, don't scatter.
    local = distribute_tensor(full, w.device_mesh, w.placements, src_data_rank=None).to_local()
    w.to_local().copy_(local)
