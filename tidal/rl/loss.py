"""The GRPO family of policy-gradient losses, over per-token log-probs.

Shapes: B sequences (completions) in the micro-batch, T completion positions (right-padded,
`mask_BT` true on completion tokens); N samples in a rollout batch.

Per sequence i, with advantage A_i, and per completion token t:

    ratio     r_it = exp(logp_new - logp_old)                      ("token", PPO/GRPO/DAPO)
                   = exp(mean_t' (logp_new - logp_old))  for all t   ("sequence", GSPO)
    surrogate  pg_it = -min(r_it A_i, clip(r_it, 1 - clip_low, 1 + clip_high) A_i)
    TIS        w_it = min(exp(logp_old - logp_gen), tis_cap)        (detached; 1 without it)
    or mask    w_it = 1 if mask_low <= exp(logp_old - logp_gen) <= mask_high, else 0
    KL (k3)    kl_it = exp(logp_ref - logp_new) - (logp_ref - logp_new) - 1
    loss = aggregate(w * pg) + kl_coef * aggregate(kl)

and `aggregate` one of: "token-mean" (sum over all tokens / their number: DAPO),
"seq-mean-token-mean" (mean over sequences of each one's token mean: GRPO, GSPO) or
"constant" (sum over all tokens / a fixed normalizer: Dr. GRPO). With logp_old = logp_new
detached (one update per batch, on-policy) every ratio is 1 and the gradient is
-A_i * grad logp_it: nanochat's REINFORCE with group-relative advantages.

Advantages (`group_advantages`): A_i = r_i - mean(group), divided by the group's sample
standard deviation (+1e-6) when `std_normalize`. Dynamic sampling (`drop_equal_groups`) drops
groups whose rewards are all equal: their advantages are all zero, so they only dilute the
normalizer (and add KL).

Where this departs from the papers, and why:

- GRPO (Shao et al., 2024, DeepSeekMath): no KL term by default (kl_coef=0, as DAPO and
  Dr. GRPO found it unneeded for verifiable rewards; the `grpo()` preset sets the paper's
  0.04). When on, it is the paper's k3 estimator, added per token inside the same
  aggregation as the surrogate. The standard deviation is the unbiased sample one (as in TRL
  and verl); a group of one has none, and asking for it is an error.
- DAPO (Yu et al., 2025): clip-higher, token-mean and dynamic sampling as in the paper, but
  dynamic sampling here only drops groups and counts them; it does not sample more prompts
  to refill the batch (that is the loop's business). No overlong reward shaping (a reward
  transform, not a loss).
- Dr. GRPO (Liu et al., 2025): the constant normalizer is the config's `normalizer` (the
  paper: the generation budget; for a batch, set it to sequences x max new tokens) and
  advantages are not divided by the standard deviation in its preset.
- GSPO (Zheng et al., 2025): the sequence ratio is the length-normalized one (geometric mean
  of token ratios over the completion). With "seq-mean-token-mean" this is the paper's
  objective; with another aggregation each token carries its sequence's term. The paper's
  clip ranges are about 1e-4 times PPO's: set them (the `gspo()` preset does).
- Truncated importance sampling (Yao et al., 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"): when the generator's log-probs differ from the
  trainer's at the same weights (other kernels, other precision), the PPO ratio is taken
  against the trainer's recomputed old log-probs and each token's surrogate is weighted by
  min(pi_old_trainer / pi_gen, tis_cap), as in the paper. With the "sequence" ratio the
  weight is sequence-level too: min(exp(mean_t (logp_old - logp_gen)), tis_cap).
- Masking (the alternative correction, `mask_low` / `mask_high`, as in IcePop and
  MiniMax-M1's token masking): instead of down-weighting, a token whose importance ratio
  pi_old_trainer / pi_gen falls outside [mask_low, mask_high] gets weight 0 (no gradient);
  it still counts in the token-mean normalizer, so masking never inflates other tokens'
  weight. With the "sequence" ratio the test is on the sequence's mean log-ratio.
- Log-ratios (new - old, ref - new) are clamped to [-20, 20] before exp, as verl does, so a
  diverged token gives a large finite loss instead of inf (its gradient there is zero).

The trainer calls `policy_loss` once per micro-batch with per-token log-probs (never
logits: it can compute them through its chunked, memory-lean cross entropy). To normalize
over a whole step of several micro-batches (and data-parallel ranks), pass the step's totals
as `num_tokens` / `num_sequences` and sum the micro-batch losses; by default each call
normalizes by its own counts.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "constant"]
RatioLevel = Literal["token", "sequence"]

STD_EPS = 1e-6
"""Added to a group's standard deviation before dividing by it."""
LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp."""


@dataclass(kw_only=True, frozen=True, slots=True)
class LossConfig:
    """Which member of the GRPO family, and its coefficients.

    The defaults are DAPO's choices without KL: clip-higher (0.2, 0.28), token-mean, std
    normalization, dynamic sampling. Presets: `grpo()`, `dapo()`, `dr_grpo(normalizer)`,
    `gspo()`.

    Example::

        LossConfig(clip_low=0.2, clip_high=0.28, aggregation="token-mean", tis_cap=2.0)
    """

    clip_low: float = 0.2
    """Ratios below 1 - clip_low are clipped (where the advantage is negative)."""
    clip_high: float = 0.28
    """Ratios above 1 + clip_high are clipped (where the advantage is positive); DAPO's
    clip-higher sets it above clip_low so unlikely tokens can gain probability."""
    ratio: RatioLevel = "token"
    """"token": a ratio per token (PPO, GRPO, DAPO); "sequence": one length-normalized ratio
    per sequence (GSPO)."""
    aggregation: Aggregation = "token-mean"
    """"token-mean" (DAPO), "seq-mean-token-mean" (GRPO, GSPO) or "constant" (Dr. GRPO:
    the token sum divided by `normalizer`)."""
    normalizer: float | None = None
    """The constant divisor of "constant" aggregation (e.g. sequences per step x max new
    tokens); required there, ignored (with a warning) otherwise."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to a frozen reference model; 0 is off (then
    `ref_logprobs` are not needed)."""
    tis_cap: float | None = None
    """Truncated importance sampling: weight each token by min(exp(logp_old - logp_gen),
    tis_cap), with `gen_logprobs` the generator's. None is off."""
    mask_low: float | None = None
    """The other correction (exclusive with tis_cap): mask tokens whose importance ratio
    exp(logp_old - logp_gen) is below this (in (0, 1]); set with mask_high. None is off."""
    mask_high: float | None = None
    """Mask tokens whose importance ratio is above this (>= 1); set with mask_low."""
    std_normalize: bool = True
    """Divide advantages by their group's standard deviation (GRPO, DAPO; not Dr. GRPO)."""
    drop_equal_groups: bool = True
    """Dynamic sampling: drop groups whose rewards are all equal (DAPO)."""
    routing_replay: bool = False
    """Mixture-of-experts policies: routing replay (R3). The generators record the experts
    every MoE layer routed each token to, the records travel with the rollout, and the
    trainer's forward routes every token to those experts, weighted by its own router's
    probabilities there (the gradient still trains the router). The trainer then computes
    the generator's routing whatever its own rounding or expert bias would choose
    (docs/rl.md, "Routing replay"). A dense model is refused."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"LossConfig.clip_low must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0.0:
            raise ValueError(f"LossConfig.clip_high must be >= 0, got {self.clip_high}")
        if self.ratio not in ("token", "sequence"):
            raise ValueError(f"LossConfig.ratio must be 'token' or 'sequence', got {self.ratio!r}")
        choices = ("token-mean", "seq-mean-token-mean", "constant")
        if self.aggregation not in choices:
            raise ValueError(
                f"LossConfig.aggregation must be one of {choices}, got {self.aggregation!r}"
            )
        if self.aggregation == "constant":
            if self.normalizer is None or not self.normalizer > 0:
                raise ValueError(
                    "LossConfig.normalizer must be a positive number with aggregation="
                    f"'constant', got {self.normalizer!r}"
                )
        elif self.normalizer is not None:
            warnings.warn(
                f"LossConfig.normalizer is ignored with aggregation={self.aggregation!r}",
                stacklevel=3,
            )
        if not self.kl_coef >= 0.0:
            raise ValueError(f"LossConfig.kl_coef must be >= 0, got {self.kl_coef}")
        if self.tis_cap is not None and not self.tis_cap >= 1.0:
            raise ValueError(f"LossConfig.tis_cap must be None or >= 1, got {self.tis_cap}")
        if (self.mask_low is None) != (self.mask_high is None):
            raise ValueError(
                "LossConfig.mask_low and mask_high are set together (the band of importance "
                f"ratios kept), got mask_low={self.mask_low}, mask_high={self.mask_high}"
            )
        if self.mask_low is not None:
            assert self.mask_high is not None
            if not 0.0 < self.mask_low <= 1.0 or not self.mask_high >= 1.0:
                raise ValueError(
                    "LossConfig.mask_low must be in (0, 1] and mask_high >= 1, got "
                    f"mask_low={self.mask_low}, mask_high={self.mask_high}"
                )
            if self.tis_cap is not None:
                raise ValueError(
                    "LossConfig.tis_cap and mask_low/mask_high are two corrections of the same "
                    "thing; set one (tis_cap: truncated IS, mask_*: masking)"
                )

    @property
    def corrects(self) -> bool:
        """An importance-sampling correction (tis_cap or the mask band) is on: the loss needs
        the generator's log-probs, and the PPO ratio is taken against the trainer's own."""
        return self.tis_cap is not None or self.mask_low is not None


def grpo() -> LossConfig:
    """GRPO as in DeepSeekMath: symmetric clip 0.2, per-sequence token means, KL 0.04."""
    return LossConfig(
        clip_low=0.2,
        clip_high=0.2,
        aggregation="seq-mean-token-mean",
        kl_coef=0.04,
        drop_equal_groups=False,
    )


def dapo() -> LossConfig:
    """DAPO: clip-higher (0.2, 0.28), token-mean, dynamic sampling, no KL."""
    return LossConfig(
        clip_low=0.2, clip_high=0.28, aggregation="token-mean", drop_equal_groups=True
    )


def dr_grpo(normalizer: float) -> LossConfig:
    """Dr. GRPO: token sums over a constant `normalizer`, no std normalization, no KL."""
    return LossConfig(
        clip_low=0.2,
        clip_high=0.2,
        aggregation="constant",
        normalizer=normalizer,
        std_normalize=False,
        drop_equal_groups=False,
    )


def gspo() -> LossConfig:
    """GSPO: sequence-level ratio, clip (3e-4, 4e-4), per-sequence means, no KL."""
    return LossConfig(
        clip_low=3e-4,
        clip_high=4e-4,
        ratio="sequence",
        aggregation="seq-mean-token-mean",
        drop_equal_groups=False,
    )


# -- advantages ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Advantages:
    """Per-sample advantages of a rollout batch and the dynamic-sampling verdict."""

    advantages: torch.Tensor
    """[N] float32; 0 for dropped samples."""
    keep: torch.Tensor
    """[N] bool: false for samples of dropped groups."""
    groups: int
    """Groups in the batch."""
    dropped_groups: int
    """Groups dropped because all their rewards were equal."""


def group_advantages(
    rewards_N: torch.Tensor, group_ids_N: torch.Tensor, cfg: LossConfig
) -> Advantages:
    """Group-relative advantages: reward minus the group mean, over the group's standard
    deviation if `cfg.std_normalize`; groups of equal rewards dropped if
    `cfg.drop_equal_groups`. Groups may have different sizes and any integer ids.

    Raises:
        ValueError: shapes differ or are not 1-D; std normalization with a group of one.

    Example::

        adv = group_advantages(batch.rewards, batch.group_ids, cfg)
        rows = adv.keep.nonzero()[:, 0]          # train on these
    """
    if rewards_N.dim() != 1 or rewards_N.shape != group_ids_N.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D of one length, got {tuple(rewards_N.shape)} "
            f"and {tuple(group_ids_N.shape)}"
        )
    if group_ids_N.dtype.is_floating_point or group_ids_N.dtype == torch.bool:
        raise ValueError(f"group_ids must be integers, got {group_ids_N.dtype}")
    dtype = torch.promote_types(rewards_N.dtype, torch.float32)
    r = rewards_N.detach().to(dtype)
    _, g_N = torch.unique(group_ids_N, return_inverse=True)
    G = int(g_N.max()) + 1 if g_N.numel() else 0
    count_G = torch.zeros(G, dtype=dtype, device=r.device).index_add_(0, g_N, torch.ones_like(r))
    mean_G = torch.zeros_like(count_G).index_add_(0, g_N, r) / count_G
    adv = r - mean_G[g_N]
    if cfg.std_normalize:
        if G and int(count_G.min()) < 2:
            lone = group_ids_N[(count_G[g_N] < 2)][0].item()
            raise ValueError(
                f"std normalization needs groups of at least 2 samples; group {lone} has 1 "
                "(use LossConfig(std_normalize=False) or sample more per prompt)"
            )
        var_G = torch.zeros_like(count_G).index_add_(0, g_N, adv**2) / (count_G - 1)
        adv = adv / (var_G.sqrt() + STD_EPS)[g_N]
    max_G = torch.full_like(count_G, -math.inf).scatter_reduce_(0, g_N, r, "amax")
    min_G = torch.full_like(count_G, math.inf).scatter_reduce_(0, g_N, r, "amin")
    equal_G = max_G == min_G
    keep = ~equal_G[g_N] if cfg.drop_equal_groups else torch.ones_like(r, dtype=torch.bool)
    dropped = int(equal_G.sum()) if cfg.drop_equal_groups else 0
    return Advantages(
        advantages=torch.where(keep, adv, 0.0).float(), keep=keep, groups=G, dropped_groups=dropped
    )


# -- the loss -----------------------------------------------------------------------------


def _check(name: str, x: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    if x is not None and tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")


def policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    *,
    ref_logprobs: torch.Tensor | None = None,
    gen_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy-gradient loss of one micro-batch, and detached metrics.

    Args:
        new_logprobs: [B, T] log-probs of the completion tokens under the policy being
            trained (requires grad).
        old_logprobs: [B, T] log-probs under the policy that sampled them: the generator's,
            or the trainer's recomputation at the sampling weights (then pass the
            generator's as `gen_logprobs` for TIS). Detached here.
        advantages: [B] one per sequence (`group_advantages(...).advantages`).
        mask: [B, T] true (nonzero) on completion tokens. Values elsewhere in the other
            tensors are ignored, NaN and inf included.
        cfg: the loss variant.
        ref_logprobs: [B, T] under the frozen reference model; needed when cfg.kl_coef > 0.
        gen_logprobs: [B, T] the generator's; needed when cfg.tis_cap or the mask band is
            set.
        entropy: [B, T] per-token entropies of the policy, for the metric only; without
            them the metric is the sampled tokens' mean -logp_new (an estimate of it).
        num_tokens: the normalizer of "token-mean" (default: this call's masked tokens).
        num_sequences: the normalizer of "seq-mean-token-mean" (default: this call's
            sequences with at least one token).

    Returns:
        (loss, metrics): a 0-dim tensor in fp32 (fp64 for fp64 inputs) to backpropagate, and
        0-dim detached tensors (no host sync): "loss", "pg_loss", "kl" (masked token mean
        of k3; with ref_logprobs), "clip_frac", "clip_low_frac", "clip_high_frac" (masked
        tokens whose gradient the clip removes), "ratio_mean", "ratio_max", "ratio_min",
        "tis_weight_mean" and "tis_capped_frac" (with TIS), "is_masked_frac" (with the mask
        band), "entropy", "num_tokens".

    Raises:
        ValueError: a shape mismatch, or a tensor the config needs is missing.

    Example::

        loss, metrics = policy_loss(new_lp, batch_lp, adv[rows], mask, LossConfig())
        loss.backward()
    """
    if new_logprobs.dim() != 2:
        raise ValueError(f"new_logprobs must be [B, T], got shape {tuple(new_logprobs.shape)}")
    B, T = new_logprobs.shape
    for name, x in (
        ("old_logprobs", old_logprobs),
        ("mask", mask),
        ("ref_logprobs", ref_logprobs),
        ("gen_logprobs", gen_logprobs),
        ("entropy", entropy),
    ):
        _check(name, x, (B, T))
    _check("advantages", advantages, (B,))
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"LossConfig.kl_coef={cfg.kl_coef} needs ref_logprobs")
    if cfg.corrects and gen_logprobs is None:
        what = f"tis_cap={cfg.tis_cap}" if cfg.tis_cap is not None else "mask_low/mask_high"
        raise ValueError(f"LossConfig.{what} needs gen_logprobs (the generator's)")
    if cfg.kl_coef == 0 and ref_logprobs is not None:
        warnings.warn("ref_logprobs is ignored with LossConfig.kl_coef=0", stacklevel=2)
    if not cfg.corrects and gen_logprobs is not None:
        warnings.warn(
            "gen_logprobs is ignored with LossConfig.tis_cap=None (and no mask band)", stacklevel=2
        )

    dtype = torch.promote_types(new_logprobs.dtype, torch.float32)
    m_BT = mask != 0
    mf_BT = m_BT.to(dtype)
    n_B = mf_BT.sum(1)  # tokens per sequence
    tokens = mf_BT.sum()
    denom = tokens.clamp(min=1)  # of the metrics' token means

    def masked(x: torch.Tensor) -> torch.Tensor:  # padding values (even NaN) never reach math
        return torch.where(m_BT, x.to(dtype), 0.0)

    def seq_mean(x_BT: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B], 0 for empty rows
        return (x_BT * mf_BT).sum(1) / n_B.clamp(min=1)

    def per_sequence(x_BT: torch.Tensor) -> torch.Tensor:  # each token gets its row's mean
        return seq_mean(x_BT)[:, None].expand(B, T)

    new_BT, old_BT = masked(new_logprobs), masked(old_logprobs.detach())

    log_ratio_BT = new_BT - old_BT
    if cfg.ratio == "sequence":
        log_ratio_BT = per_sequence(log_ratio_BT)
    ratio_BT = log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    adv_B1 = advantages.detach().to(dtype)[:, None]
    surr_BT = ratio_BT * adv_B1
    clipped_BT = ratio_BT.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv_B1
    pg_BT = -torch.minimum(surr_BT, clipped_BT)

    metrics: dict[str, torch.Tensor] = {}
    if cfg.tis_cap is not None:
        assert gen_logprobs is not None
        lw_BT = old_BT - masked(gen_logprobs.detach())
        if cfg.ratio == "sequence":
            lw_BT = per_sequence(lw_BT)
        w_BT = lw_BT.clamp(max=math.log(cfg.tis_cap)).exp()
        pg_BT = pg_BT * w_BT
        metrics["tis_weight_mean"] = (w_BT * mf_BT).sum() / denom
        metrics["tis_capped_frac"] = ((lw_BT >= math.log(cfg.tis_cap)) & m_BT).sum() / denom
    elif cfg.mask_low is not None:
        assert gen_logprobs is not None and cfg.mask_high is not None
        lw_BT = old_BT - masked(gen_logprobs.detach())
        if cfg.ratio == "sequence":
            lw_BT = per_sequence(lw_BT)
        inside_BT = (lw_BT >= math.log(cfg.mask_low)) & (lw_BT <= math.log(cfg.mask_high))
        pg_BT = pg_BT * inside_BT.to(dtype)
        metrics["is_masked_frac"] = (~inside_BT & m_BT).sum() / denom

    def aggregate(x_BT: torch.Tensor) -> torch.Tensor:
        x_BT = x_BT * mf_BT
        if cfg.aggregation == "token-mean":
            return x_BT.sum() / (denom if num_tokens is None else num_tokens)
        if cfg.aggregation == "seq-mean-token-mean":
            rows = (n_B > 0).sum().clamp(min=1) if num_sequences is None else num_sequences
            return seq_mean(x_BT).sum() / rows
        assert cfg.normalizer is not None
        return x_BT.sum() / cfg.normalizer

    pg_loss = aggregate(pg_BT)
    loss = pg_loss
    if ref_logprobs is not None and cfg.kl_coef > 0:
        d_BT = (masked(ref_logprobs.detach()) - new_BT).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl_BT = d_BT.exp() - d_BT - 1
        loss = pg_loss + cfg.kl_coef * aggregate(kl_BT)
        metrics["kl"] = (kl_BT * mf_BT).sum() / denom

    with torch.no_grad():
        low_BT = (ratio_BT < 1 - cfg.clip_low) & (adv_B1 < 0) & m_BT
        high_BT = (ratio_BT > 1 + cfg.clip_high) & (adv_B1 > 0) & m_BT
        ent_BT = masked(entropy) if entropy is not None else -new_BT
        metrics |= {
            "loss": loss.detach(),
            "pg_loss": pg_loss.detach(),
            "clip_low_frac": low_BT.sum() / denom,
            "clip_high_frac": high_BT.sum() / denom,
            "clip_frac": (low_BT | high_BT).sum() / denom,
            "ratio_mean": (ratio_BT * mf_BT).sum() / denom,
            "ratio_max": torch.where(m_BT, ratio_BT, 0.0).amax() if B * T else tokens,
            "ratio_min": torch.where(m_BT, ratio_BT, torch.inf).amin() if B * T else tokens,
            "entropy": (ent_BT * mf_BT).sum() / denom,
            "num_tokens": tokens,
        }
    return loss, {k: v.detach() for k, v in metrics.items()}
