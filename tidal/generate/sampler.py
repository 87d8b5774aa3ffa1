"""Sampling parameters and the batched sampler of the Generator (tidal/generate/generator.py).

The sampler works on a batch of rows with per-row parameters, on the device, without reading
anything back to the host: it can run inside a compiled decode step or a captured CUDA graph.

- Randomness is a counter-based hash, not a generator state: the noise of vocabulary entry v
  for the token at completion index i of a sample is a function of (the sample's key, i, v).
  A sample's key is derived from its request's seed and its index in the group (`sample_key`),
  so the same request and seed give the same tokens whatever else is in the batch, which rows
  it lands in, and how the run is split into steps (exactly so in batch-invariant mode, where
  the logits themselves are exact; otherwise up to ties that floating-point noise may flip).
- A token is drawn by the Gumbel-max trick: argmax(logits / temperature + Gumbel noise) over
  the tokens the truncation keeps, which samples the tempered, truncated softmax exactly.
- Truncation, in this order on the tempered logits: top-k, then top-p (nucleus, on the
  top-k-renormalized distribution), then min-p (tokens whose probability is below min_p times
  the top token's; unchanged by the earlier steps, which keep the top token). Ties at a
  threshold are kept.
- Two log-probs per token: `logprobs` under the model's own distribution (temperature 1, no
  truncation: what a trainer's forward computes) and `sampling_logprobs` under the
  distribution actually sampled (after temperature and truncation; 0 for greedy rows).

Shape legend: B rows, V vocabulary, T time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tidal.models import batch_invariant as bi

_M32 = 0xFFFFFFFF


@dataclass(kw_only=True, frozen=True, slots=True)
class SamplingParams:
    """How to continue one prompt.

    Example::

        SamplingParams(n=8, temperature=1.0, top_p=0.95, max_new_tokens=512, seed=3)
        SamplingParams(temperature=0.0, stop=("\\n\\n",))   # greedy, stop at a blank line
    """

    n: int = 1
    """Samples of this prompt (a GRPO group); they share the prompt's prefill."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy decoding (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p; in (0, 1]."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one; in [0, 1]."""
    max_new_tokens: int = 256
    """Most tokens to generate per sample (the stop token included)."""
    stop_token_ids: tuple[int, ...] | None = None
    """Token ids that end a sample (kept as its last token). None: the tokenizer's EOS when the
    generator has a tokenizer, else none; () for none."""
    stop: tuple[str, ...] = ()
    """Strings that end a sample: the completion ends with the token that completes one, and
    `text` is cut before it. Each must round-trip through the tokenizer (see Generator)."""
    seed: int = 0
    """Seed of this request; sample j of the group draws from (seed, j)."""
    stream: bool = False
    """Report this prompt's tokens as they are decoded, at each host check, to the
    `on_tokens` listener of `Generator.stream` (the server's token streaming). Changes no
    token sampled."""

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"SamplingParams.temperature must be finite and >= 0 (0 = greedy), "
                f"got {self.temperature!r}"
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(
                f"SamplingParams.top_k must be an int >= 0 (0 = off), got {self.top_k!r}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}"
            )
        if isinstance(self.stop, str):
            raise ValueError(f"SamplingParams.stop must be a tuple of strings, got {self.stop!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {self.stop!r}")
        ids = self.stop_token_ids
        if ids is not None and any(not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids must be non-negative ints, got {ids!r}"
            )
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"SamplingParams.seed must be an int in [0, 2**63), got {self.seed!r}")

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p apply (they need a sort of the vocabulary)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1)


# -- counter-based randomness ------------------------------------------------------------


def _mix32_int(x: int) -> int:
    """The 32-bit integer hash of `_mix32`, on the host."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x1B873593) & _M32
    return x ^ (x >> 16)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) on int64 tensors holding values in
    [0, 2**32); the multipliers are below 2**31, so no product overflows int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & _M32
    return x ^ (x >> 16)


def sample_key(seed: int, sample_index: int, turn: int = 0) -> int:
    """The 32-bit random key of sample `sample_index` of a request seeded `seed`; for a turn
    after the first of a conversation (`Generator` continuations), of its turn `turn`, so
    that each turn draws its own noise even with the same seed."""
    h = _mix32_int(seed & _M32)
    h = _mix32_int(h ^ _mix32_int((seed >> 32) ^ 0x9E3779B9))
    key = _mix32_int(h ^ _mix32_int(sample_index + 0x85EBCA6B))
    return key if turn == 0 else _mix32_int(key ^ _mix32_int(turn + 0xC2B2AE35))


def gumbel_noise(keys_B: torch.Tensor, steps_B: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V] in fp32, a pure function of (key, step, token id)."""
    vocab_V = _mix32(torch.arange(vocab_size, device=keys_B.device, dtype=torch.long))
    row_B = _mix32(keys_B ^ _mix32(steps_B & _M32))
    bits_BV = _mix32(vocab_V[None, :] ^ row_B[:, None])
    u_BV = ((bits_BV >> 8).float() + 0.5) * 2.0**-24  # 24 random bits, strictly inside (0, 1)
    return -torch.log(-torch.log(u_BV))


# -- the sampler --------------------------------------------------------------------------

ROW_CHUNK = 1024
"""Most vocabulary entries per chunk in the sampler's row reductions (`row_stats`)."""


def log_softmax(logits_BV: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """fp32 log-softmax over the vocabulary (per-row fixed reduction order if asked)."""
    if batch_invariant:
        return bi.log_softmax(logits_BV)
    return torch.log_softmax(logits_BV.float(), dim=-1)


def row_stats(
    x_BV: torch.Tensor, noise_BV: torch.Tensor | None = None, *, chunks: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """argmax(x + noise) [B] (the first index of the largest, as torch.argmax), max(x) [B]
    and logsumexp(x) [B] of fp32 rows, in one pass over each row's chunks.

    Each row is cut into C chunks of W entries (the last padded with -inf): every chunk
    reduces to its max, the index of its first max and its sum of exp relative to its own
    max; a combine over the chunks gives the row's values. The argmax and max are exact; the
    logsumexp is log-softmax's normalizer up to the order of its sum.

    Why chunks: compiled, a reduction over a whole row is one thread block's loop, and
    inductor splits no arg-reduction over blocks, so at batch 1 an argmax over a 128k
    vocabulary ran on one of an H200's 132 SMs; the B x C chunk reductions run on as many
    blocks. `chunks` (C) defaults to V / ROW_CHUNK rounded up inside torch.compile and to 1
    in eager mode, whose kernels already spread a long row over the device.
    """
    B, V = x_BV.shape
    if chunks is None:
        chunks = -(-V // ROW_CHUNK) if torch.compiler.is_compiling() else 1
    W = -(-V // chunks)
    pad = (0, chunks * W - V)

    def view(t_BV: torch.Tensor, fill: float) -> torch.Tensor:
        if pad[1]:
            t_BV = torch.nn.functional.pad(t_BV, pad, value=fill)
        return t_BV.view(B, chunks, W)

    x_BCW = view(x_BV, -math.inf)
    y_BCW = x_BCW if noise_BV is None else x_BCW + view(noise_BV, 0.0)
    top_BC, at_BC = y_BCW.max(dim=-1)
    c_B1 = top_BC.argmax(dim=-1, keepdim=True)  # the first chunk holding the row's max
    argmax_B = (c_B1 * W + at_BC.gather(1, c_B1))[:, 0]
    # logsumexp: each chunk's sum relative to its own max (a finite stand-in for a chunk of
    # -inf only, whose sum is then 0), rescaled to the row's max.
    chunk_max_BC = top_BC if noise_BV is None else x_BCW.amax(dim=-1)
    shift_BC = chunk_max_BC.clamp(min=torch.finfo(x_BV.dtype).min)
    sum_BC = (x_BCW - shift_BC[:, :, None]).exp().sum(dim=-1)
    max_B = chunk_max_BC.amax(dim=-1)
    lse_B = max_B + (sum_BC * (shift_BC - max_B[:, None]).exp()).sum(dim=-1).log()
    return argmax_B, max_B, lse_B


def truncate_logits(
    scaled_BV: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor
) -> torch.Tensor:
    """Mask (-inf) the tokens that top-k and then top-p drop."""
    V = scaled_BV.shape[-1]
    sorted_BV = scaled_BV.sort(dim=-1, descending=True).values
    rank_V = torch.arange(V, device=scaled_BV.device)
    k_B = torch.where(top_k_B > 0, top_k_B.clamp(max=V), V)
    in_k_BV = rank_V[None, :] < k_B[:, None]
    probs_BV = torch.softmax(sorted_BV.masked_fill(~in_k_BV, -math.inf), dim=-1)
    # A token stays when the mass of the tokens ranked before it is below top_p (a prefix).
    before_BV = probs_BV.cumsum(dim=-1) - probs_BV
    n_keep_B = ((before_BV < top_p_B[:, None]) & in_k_BV).sum(dim=-1).clamp(min=1)
    n_keep_B = torch.where(top_p_B < 1, n_keep_B, k_B)
    threshold_B1 = sorted_BV.gather(1, (n_keep_B - 1)[:, None])
    return scaled_BV.masked_fill(scaled_BV < threshold_B1, -math.inf)


def sample(
    logits_BV: torch.Tensor,
    *,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    min_p_B: torch.Tensor,
    keys_B: torch.Tensor,
    steps_B: torch.Tensor,
    sampled: bool = True,
    truncate: bool = True,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row, with its log-probs. No host synchronization.

    Args:
        logits_BV: next-token logits of each row.
        temperature_B, top_k_B, top_p_B, min_p_B: per-row parameters (see SamplingParams).
        keys_B: per-row random keys (`sample_key`); steps_B: completion index of the token.
        sampled: False when every row is greedy (skips the noise).
        truncate: False when no row uses top-k or top-p (skips the sort).
        batch_invariant: fixed-order log-softmax (see tidal/models/batch_invariant.py).

    Returns:
        tokens [B] (int64), logprobs [B] under the model's distribution, sampling logprobs
        [B] under the tempered, truncated distribution (0 for greedy rows).

    A log-prob is the token's logit minus its row's logsumexp (`row_stats`, no [B, V]
    log-softmax), or in batch-invariant mode the fixed-order log-softmax's entry.
    """
    logits_BV = logits_BV.float()
    greedy_B, max_B, lse_B = row_stats(logits_BV)

    def token_logprob(x_BV: torch.Tensor, lse_B: torch.Tensor, tokens_B: torch.Tensor):
        if batch_invariant:
            return log_softmax(x_BV, True).gather(1, tokens_B[:, None])[:, 0]
        return x_BV.gather(1, tokens_B[:, None])[:, 0] - lse_B

    if not sampled:
        lp_B = token_logprob(logits_BV, lse_B, greedy_B)
        return greedy_B, lp_B, torch.zeros_like(lp_B)
    is_greedy_B = temperature_B <= 0
    temperature_B = torch.where(is_greedy_B, 1.0, temperature_B)
    scaled_BV = logits_BV / temperature_B[:, None]
    if truncate:
        scaled_BV = truncate_logits(scaled_BV, top_k_B, top_p_B)
    # min-p: p_i < min_p * p_max  <=>  s_i - s_max < log(min_p); log(0) = -inf keeps all.
    # s_max is max / temperature exactly (division by t > 0 is monotonic after rounding too,
    # and truncation keeps the top token).
    top_B1 = (max_B / temperature_B)[:, None]
    dropped_BV = (scaled_BV - top_B1) < torch.log(min_p_B)[:, None]
    scaled_BV = scaled_BV.masked_fill(dropped_BV, -math.inf)
    # Greedy rows draw without noise: the argmax of their logits, which truncation keeps.
    noise_BV = gumbel_noise(keys_B, steps_B, logits_BV.shape[-1])
    noise_BV = noise_BV.masked_fill(is_greedy_B[:, None], 0.0)
    tokens_B, _, sample_lse_B = row_stats(scaled_BV, noise_BV)
    sample_lp_B = token_logprob(scaled_BV, sample_lse_B, tokens_B)
    sample_lp_B = torch.where(is_greedy_B, 0.0, sample_lp_B)
    return tokens_B, token_logprob(logits_BV, lse_B, tokens_B), sample_lp_B


# -- sampler variants ---------------------------------------------------------------------

VARIANTS = ("greedy", "sampled", "truncated")
"""The sampler variants, each compiled and captured apart by the Generator: greedy
(temperature 0), sampled, and sampled with top-k / top-p truncation."""


def variant(sampled: bool, truncate: bool) -> str:
    """The name of the variant that `sample(..., sampled=, truncate=)` runs."""
    return "truncated" if truncate else "sampled" if sampled else "greedy"


def variant_of(params: SamplingParams) -> str:
    """The sampler variant that decodes rows of `params` (a batch with rows of several
    variants runs the most general one: truncated, then sampled)."""
    return variant(params.temperature > 0, params.truncates)
