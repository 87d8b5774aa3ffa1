"""What the RL loop hands the trainer's step: rollouts as trainer `Batch`es, the GRPO-family
loss as a `TokenLoss`, and the policy update itself (`train_on_rollout`: one optimizer step
on a rollout; `set_step_lr`: the step's learning rate).

Shapes: N samples, P the longest prompt, C the longest completion, L = P + C; B rows and T
positions of a trainer batch (T = L - 1, or a fixed `seq_len`).

A rollout row is laid out as the trainer's next-token batches are: `input_ids` are the prompt
followed by the completion, minus the last token; `labels[t]` is the token after position t,
kept (not IGNORE_INDEX) only where that token is a completion token. Completion token k of a
row with prompt length p is therefore label position p - 1 + k, and every per-token input
(old, generator and reference log-probs, the mask) is placed there; its log-prob under the
trainer is `Trainer.logprobs(batch)[row, p - 1 + k]`.

Lifecycle (in the trainer process, every rank): the loop gets a `RolloutBatch` from the store,
computes `group_advantages`, builds this rank's batches with `rollout_batches(...,
dp_rank=, dp_world=)` (every rank the same rollout: each takes its share of the rows, and all
get the same number of batches of one shape), optionally fills `extras["ref_logprobs"]` with a
reference model's (`Trainer.logprobs` under its weights), and calls
`trainer.train_step(batches, n_tokens, loss=PolicyLoss(cfg))`; with a correction (TIS or the
mask band) `PolicyLoss(cfg, old_is_current=True)` takes the PPO ratio against the step's own
forward.

Example (one process; `trainer` built with `DataBundle(train=None)`, `rollout` and its
advantages from the generator and tidal.rl.loss)::

    adv = group_advantages(rollout.rewards, rollout.group_ids, cfg)
    batches = rollout_batches(rollout, adv, micro_batch_size=8)
    n_tokens = sum(b.target_count() for b in batches)
    result = trainer.train_step([b.to(trainer.device) for b in batches], n_tokens,
                                loss=PolicyLoss(cfg))
    print({k: float(v) for k, v in result.metrics.items()})
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tidal.rl.config import RLConfig
from tidal.rl.loss import Advantages, LossConfig, policy_loss
from tidal.rl.rollout import RolloutBatch
from tidal.train.data import Batch
from tidal.train.loss import IGNORE_INDEX, StepNorms

_TOKEN_MEANS = (
    "kl",
    "clip_frac",
    "clip_low_frac",
    "clip_high_frac",
    "ratio_mean",
    "entropy",
    "tis_weight_mean",
    "tis_capped_frac",
    "is_masked_frac",
    "logprob_diff_mean",
)
"""policy_loss metrics that are means over the micro-batch's tokens."""


def rollout_batches(
    rollout: RolloutBatch,
    advantages: Advantages | torch.Tensor,
    *,
    micro_batch_size: int,
    seq_len: int | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    dp_rank: int = 0,
    dp_world: int = 1,
    routing_replay: bool = False,
) -> list[Batch]:
    """This data-parallel rank's trainer batches of a rollout, on the host.

    Args:
        rollout: the graded samples.
        advantages: `group_advantages(...)` (rows of dropped groups are left out, so they
            neither count in the normalizers nor cost compute), or a [N] tensor for every row.
        micro_batch_size: rows per batch; the last batch is padded with empty rows (all
            labels IGNORE_INDEX, advantage 0), so every batch has one shape.
        seq_len: T of every batch (pipeline parallel needs one shape for all steps); None:
            the longest prompt + completion of the rollout, minus one.
        old_logprobs: [N, C] in the rollout's completion layout, the log-probs of the policy
            that sampled (the PPO ratio's denominator); None: the generator's
            (`rollout.logprobs`).
        ref_logprobs: [N, C] under a frozen reference model, for a KL term; None: no extra.
        dp_rank, dp_world: this rank's share: rows dp_rank, dp_rank + dp_world, ...; every
            rank gets ceil(ceil(N / dp_world) / micro_batch_size) batches.
        routing_replay: add the rollout's routing records as "routed_experts" (the trainer's
            forward replays them; `loss.routing_replay`).

    Returns:
        Batches with `extras`: "advantages" [B] fp32, "old_logprobs", "gen_logprobs" (the
        generator's) and, if given, "ref_logprobs" [B, T] fp32, and "mask" [B, T] bool (true
        on the completion tokens trained on, `rollout.train_mask`: labels != IGNORE_INDEX);
        with `routing_replay`, "routed_experts" [B, MoE layers, T, top_k] (the experts of
        input position t; positions past a row's tokens get experts 0..top_k-1).
        Empty when no row is kept.

    Raises:
        ValueError: a shape that does not match the rollout, a prompt of length 0, a
            sequence longer than `seq_len`, bad sizes or ranks, or `routing_replay` for a
            rollout without routing records.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if dp_world < 1 or not 0 <= dp_rank < dp_world:
        raise ValueError(f"need 0 <= dp_rank < dp_world, got dp_rank={dp_rank}, {dp_world=}")
    N, C = rollout.completion_ids.shape
    per_token = {
        "old_logprobs": rollout.logprobs if old_logprobs is None else old_logprobs,
        "gen_logprobs": rollout.logprobs,
    }
    if ref_logprobs is not None:
        per_token["ref_logprobs"] = ref_logprobs
    for name, x in per_token.items():
        if tuple(x.shape) != (N, C):
            raise ValueError(f"{name} must have the rollout's shape {(N, C)}, got {tuple(x.shape)}")
    if isinstance(advantages, Advantages):
        keep, adv_N = advantages.keep, advantages.advantages
    else:
        keep, adv_N = torch.ones(N, dtype=torch.bool), advantages
    if tuple(adv_N.shape) != (N,):
        raise ValueError(f"advantages must have shape {(N,)}, got {tuple(adv_N.shape)}")
    if N and int(rollout.prompt_lens.min()) < 1:
        raise ValueError(
            "every prompt needs at least one token (the first completion token's context)"
        )

    ids_NL = rollout.token_ids()
    L = ids_NL.shape[1]
    T = L - 1 if seq_len is None else seq_len
    if T < L - 1:
        raise ValueError(
            f"seq_len={seq_len} is shorter than the rollout's longest sequence, {L - 1} positions"
        )
    ids_NL = torch.cat([ids_NL, ids_NL.new_full((N, T + 1 - L), rollout.pad_id)], 1)
    # Completion token k of row i is label position prompt_len - 1 + k: (row, position) of
    # every trained completion token (a multi-turn trajectory's observations are inputs
    # only), in the completion layout's order.
    mask_NC = rollout.train_mask
    row_M = torch.arange(N)[:, None].expand(N, C)[mask_NC]
    pos_M = (rollout.prompt_lens[:, None] - 1 + torch.arange(C))[mask_NC]
    mask_NT = torch.zeros(N, T, dtype=torch.bool)
    mask_NT[row_M, pos_M] = True

    def to_positions(x_NC: torch.Tensor) -> torch.Tensor:
        out_NT = torch.zeros(N, T)
        out_NT[row_M, pos_M] = x_NC[mask_NC].float()
        return out_NT

    extras_N = {name: to_positions(x) for name, x in per_token.items()}
    extras_N["advantages"] = adv_N.float()
    extras_N["mask"] = mask_NT
    if routing_replay:
        extras_N["routed_experts"] = _experts_at_positions(rollout, T)
    labels_NT = torch.where(mask_NT, ids_NL[:, 1:], IGNORE_INDEX)

    kept = keep.nonzero()[:, 0]
    mine = kept[dp_rank::dp_world]
    share = -(-len(kept) // dp_world)  # every rank's row count, padded
    n_batches = -(-share // micro_batch_size)
    rows = n_batches * micro_batch_size

    def take(x: torch.Tensor, fill) -> torch.Tensor:
        out = x.new_full((rows, *x.shape[1:]), fill)
        out[: len(mine)] = x[mine]
        return out

    input_ids = take(ids_NL[:, :-1], rollout.pad_id)
    labels = take(labels_NT, IGNORE_INDEX)
    extras = {k: take(v, False if v.dtype == torch.bool else 0) for k, v in extras_N.items()}
    batch = Batch(
        input_ids=input_ids,
        labels=labels,
        document_ids=torch.zeros(rows, T, dtype=torch.int32),
        extras=extras,
    )
    return [batch.row_slice(s, s + micro_batch_size) for s in range(0, rows, micro_batch_size)]


def _experts_at_positions(rollout: RolloutBatch, T: int) -> torch.Tensor:
    """[N, L, T, K] the routing records of every input position (the prompt's tokens, then
    the completion's but the last), experts 0..K-1 past each row's tokens."""
    pe, ce = rollout.prompt_experts, rollout.completion_experts
    if pe is None or ce is None:
        raise ValueError(
            "loss.routing_replay needs the experts the generator routed to, and the rollout "
            "has none: its generator ran without GeneratorConfig.record_routing"
        )
    N, L, _, K = pe.shape
    out = torch.arange(K, dtype=pe.dtype).expand(N, L, T, K).clone()
    comp_lens = rollout.completion_mask.sum(1)
    for i in range(N):
        p, c = int(rollout.prompt_lens[i]), int(comp_lens[i])
        fed = max(c - 1, 0)
        out[i, :, :p] = pe[i, :, :p]
        out[i, :, p : p + fed] = ce[i, :, :fed]
    return out


def check_routed_experts(rollout: RolloutBatch, moe: Any) -> None:
    """The rollout's routing records fit a model whose MoE layers are `moe` = (layers,
    experts, top_k) (`tidal.models.moe.moe_shape`; None: a dense model).

    Raises:
        ValueError: a dense model, no records, or records of another number of layers or
            top-k, or naming experts the model does not have (one line, before any work)."""
    if moe is None:
        raise ValueError(
            "loss.routing_replay needs a mixture-of-experts model; the policy is dense"
        )
    pe = rollout.prompt_experts
    if pe is None or rollout.completion_experts is None:
        raise ValueError(
            "loss.routing_replay needs the experts the generator routed to, and the rollout "
            "has none: its generator ran without GeneratorConfig.record_routing"
        )
    L, E, K = moe
    if pe.shape[1] != L or pe.shape[3] != K:
        raise ValueError(
            f"the rollout's routed experts are [samples, {pe.shape[1]} layers, tokens, top_k "
            f"{pe.shape[3]}]; the model has {L} MoE layers with top_k {K}"
        )
    top = max(int(pe.max()), int(rollout.completion_experts.max())) if pe.numel() else 0
    if top >= E:
        raise ValueError(f"the rollout's routed experts name expert {top}; the model has {E}")


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    """`policy_loss` (tidal/rl/loss.py) as the trainer's injected `TokenLoss`, normalized over
    the whole step: "token-mean" by the step's tokens, "seq-mean-token-mean" by its sequences
    (`StepNorms`), over every micro-batch and data-parallel rank.

    Reads the batch's extras "advantages", "old_logprobs", "mask" (default: labels !=
    IGNORE_INDEX), "ref_logprobs" (when `cfg.kl_coef` > 0) and "gen_logprobs" (when
    `cfg.tis_cap` or the mask band is set), as `rollout_batches` builds them.

    Metrics (`StepResult.metrics`, reduced over the step): policy_loss's, as step values:
    "loss", "pg_loss", "num_tokens" (sums), "ratio_max" (max), "ratio_min" (min) and the
    token means ("kl", "clip_frac", "clip_low_frac", "clip_high_frac", "ratio_mean",
    "entropy", with TIS "tis_weight_mean", "tis_capped_frac", with the mask band
    "is_masked_frac") over all the step's tokens; with the batch's "gen_logprobs", the gap
    between this forward's log-probs and the generator's over the tokens trained on,
    "logprob_diff_max" (max |trainer - generator|) and "logprob_diff_mean" (its token mean).

    Example::

        result = trainer.train_step(batches, n_tokens, loss=PolicyLoss(dapo()))
        print(float(result.metrics["clip_frac"]), float(result.metrics["entropy"]))
    """

    cfg: LossConfig
    old_is_current: bool = False
    """Take the old log-probs (the PPO ratio's denominator) from this forward, detached,
    instead of the batch's "old_logprobs": the trainer's own policy at the step's weights.
    The RL loop makes one optimizer step per rollout batch, so they are exactly what a
    separate recomputation pass would give, without that pass (and without its rounding
    differences from the training forward)."""
    wants_entropy: bool = True
    """Compute the policy's per-token entropy for the "entropy" metric (one more pass over
    each chunk's logits); False reports the sampled tokens' mean -logp instead."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        batch: Batch,
        norms: StepNorms,
        entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x = batch.extras
        need = ["advantages"] + ([] if self.old_is_current else ["old_logprobs"])
        need += ["ref_logprobs"] if self.cfg.kl_coef > 0 else []
        need += ["gen_logprobs"] if self.cfg.corrects else []
        missing = [k for k in need if k not in x]
        if missing:
            raise KeyError(
                f"PolicyLoss needs batch extras {missing} (the batch has {sorted(x)}); "
                "rollout_batches builds them"
            )
        mask = x["mask"] if "mask" in x else batch.labels != IGNORE_INDEX
        loss, m = policy_loss(
            logprobs,
            logprobs.detach() if self.old_is_current else x["old_logprobs"],
            x["advantages"],
            mask,
            self.cfg,
            ref_logprobs=x["ref_logprobs"] if self.cfg.kl_coef > 0 else None,
            gen_logprobs=x["gen_logprobs"] if self.cfg.corrects else None,
            entropy=entropy,
            num_tokens=norms.tokens,
            num_sequences=norms.sequences,
        )
        if "gen_logprobs" in x:  # the log-prob gap, generator vs trainer
            m_BT = mask != 0
            gap_BT = torch.where(m_BT, (logprobs.detach() - x["gen_logprobs"]).abs(), 0.0)
            m["logprob_diff_max"] = gap_BT.amax() if gap_BT.numel() else gap_BT.sum()
            m["logprob_diff_mean"] = gap_BT.sum() / m_BT.sum().clamp(min=1)
        share = m["num_tokens"] / norms.tokens  # this micro-batch's part of the step's tokens
        return loss, {k: v * share if k in _TOKEN_MEANS else v for k, v in m.items()}


def set_step_lr(trainer: Any, cfg: RLConfig, step: int) -> float:
    """Set and return the learning rate of optimizer step `step`: `optimizer.lr` under the
    `lr_scheduler` (warmup, stable, decay) over the run's steps, counted from the step the
    schedule started at (`trainer.checkpoint.lr_start`)."""
    from tidal.train.optim import set_lr, wsd_multiplier

    lr_start = trainer.checkpoint.lr_start
    lr = cfg.optimizer.lr * wsd_multiplier(
        step - lr_start, cfg.rl.steps - lr_start, cfg.lr_scheduler
    )
    set_lr(trainer.optimizer, lr)
    return lr


def train_on_rollout(
    trainer: Any,
    rollout: RolloutBatch,
    advantages: Advantages,
    loss: PolicyLoss,
    *,
    micro_batch_size: int,
    seq_len: int | None = None,
    dp_rank: int = 0,
    dp_world: int = 1,
    reference: list[torch.Tensor] | None = None,
) -> tuple[dict[str, float], int, int]:
    """One optimizer step of `trainer` (a tidal.train Trainer, every rank) on a rollout
    (nothing when dynamic sampling dropped every group). `reference`: the frozen weights of
    the KL term (tidal.rl.build.reference_weights), scored in the trainer's own layout.

    Returns the loss metrics, the real token positions trained on (every kept sample's
    prompt and completion, minus its last token, over all ranks) and the positions the
    trainer ran, padding included."""
    replay = loss.cfg.routing_replay
    if replay:
        from tidal.models.moe import MoEArgs

        moe: MoEArgs | None = trainer.args.moe
        shape = None if moe is None else (trainer.args.n_layers, moe.n_experts, moe.top_k)
        check_routed_experts(rollout, shape)
    batches = rollout_batches(
        rollout,
        advantages,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        dp_rank=dp_rank,
        dp_world=dp_world,
        routing_replay=replay,
    )
    if not batches:
        return {}, 0, 0
    batches = [b.to(trainer.device) for b in batches]
    if reference is not None:  # the KL term's frozen reference, in the same layout

        def score_reference() -> None:
            for b in batches:
                b.extras["ref_logprobs"] = trainer.logprobs(b)

        _with_weights(trainer, reference, score_reference)
    n_tokens = sum(b.target_count() for b in batches)
    result = trainer.train_step(batches, n_tokens, loss=loss)
    metrics = {k: float(v) for k, v in result.metrics.items()}
    lens = rollout.prompt_lens + rollout.completion_mask.sum(1)
    real = int((lens - 1).clamp(min=0)[advantages.keep].sum())
    return metrics, real, int(result.tokens)


@torch.no_grad()
def _with_weights(trainer: Any, weights: list[torch.Tensor], fn: Callable[[], Any]) -> None:
    """Run `fn` with the trainer's parameters swapped for `weights` (same layout), then put
    the trainer's own back.

    The swap writes the (sharded) parameters; FSDP2 modules that keep their gathered
    parameters after a forward (the root and the last block, by default) are resharded on
    both sides of it, or the next forward would reuse a copy gathered from the other
    weights (the KL reference pass read the policy's weights, and the training step the
    reference's)."""
    own = [p.detach().clone() for p in trainer.params]
    _reshard(trainer)
    for p, w in zip(trainer.params, weights, strict=True):
        p.copy_(w)
    try:
        fn()
    finally:
        _reshard(trainer)
        for p, w in zip(trainer.params, own, strict=True):
            p.copy_(w)


def _reshard(trainer: Any) -> None:
    """Free the gathered parameters of every FSDP2 module of the trainer (a no-op without
    FSDP or when already resharded)."""
    from torch.distributed.fsdp import FSDPModule

    for module in trainer.modules:
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
