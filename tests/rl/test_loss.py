"""The GRPO-family loss against a plain float64 loop over sequences and tokens, in value and
gradient; advantages and dynamic sampling; edge cases and config validation."""

import itertools
import math
import warnings

import pytest
import torch

from tidal.rl.loss import (
    LOG_RATIO_CLAMP,
    LossConfig,
    dapo,
    dr_grpo,
    group_advantages,
    grpo,
    gspo,
    policy_loss,
)

# -- the reference: obviously correct, slow ------------------------------------------------


def reference_loss(new, old, adv, mask, cfg, ref=None, gen=None, num_tokens=None, num_seqs=None):
    """The loss by loops over sequences and tokens, on 0-dim float64 tensors."""
    B, T = new.shape
    clamp = LOG_RATIO_CLAMP
    seq_sums, seq_lens = [], []
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        if not toks:
            continue
        seq_lr = sum(new[i, t] - old[i, t] for t in toks) / len(toks)
        seq_lw = sum(old[i, t] - gen[i, t] for t in toks) / len(toks) if gen is not None else 0
        total = 0
        for t in toks:
            lr = seq_lr if cfg.ratio == "sequence" else new[i, t] - old[i, t]
            r = torch.exp(torch.clamp(lr, -clamp, clamp))
            a = adv[i]
            term = -min(r * a, torch.clamp(r, 1 - cfg.clip_low, 1 + cfg.clip_high) * a)
            if cfg.tis_cap is not None:
                lw = seq_lw if cfg.ratio == "sequence" else old[i, t] - gen[i, t]
                term = term * min(math.exp(float(lw)), cfg.tis_cap)
            if cfg.kl_coef > 0:
                d = torch.clamp(ref[i, t] - new[i, t], -clamp, clamp)
                term = term + cfg.kl_coef * (torch.exp(d) - d - 1)
            total = total + term
        seq_sums.append(total)
        seq_lens.append(len(toks))
    if cfg.aggregation == "token-mean":
        return sum(seq_sums) / (num_tokens if num_tokens is not None else max(sum(seq_lens), 1))
    if cfg.aggregation == "seq-mean-token-mean":
        per_seq = [s / n for s, n in zip(seq_sums, seq_lens, strict=True)]
        return sum(per_seq) / (num_seqs if num_seqs is not None else max(len(per_seq), 1))
    return sum(seq_sums) / cfg.normalizer


def random_batch(seed, B=8, T=12, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    new = old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)  # across the clips
    ref = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    gen = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)  # some over the cap
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lens = torch.randint(0, T + 1, (B,), generator=g)
    lens[0], lens[1] = 0, 1  # an all-masked row and a one-token completion
    # Rows 2 and 3 move far up (A > 0) and down (A < 0): sequence ratios clip on both sides.
    new[2:4] += torch.tensor([[0.6], [-0.6]], dtype=torch.float64)
    adv[2:4] = torch.tensor([1.0, -1.0], dtype=torch.float64) * (0.5 + adv[2:4].abs())
    lens[2:4] = lens[2:4].clamp(min=4)
    gen[4] -= 0.8  # the generator found row 4 much less likely: capped in both TIS modes
    lens[4] = lens[4].clamp(min=1)
    mask = torch.arange(T)[None, :] < lens[:, None]
    return new, old, ref, gen, adv, mask


VARIANTS = [
    LossConfig(
        aggregation=agg,
        ratio=ratio,
        kl_coef=kl,
        tis_cap=tis,
        normalizer=40.0 if agg == "constant" else None,
        clip_low=0.2 if ratio == "token" else 0.1,
        clip_high=0.28 if ratio == "token" else 0.15,
    )
    for agg, ratio, kl, tis in itertools.product(
        ["token-mean", "seq-mean-token-mean", "constant"],
        ["token", "sequence"],
        [0.0, 0.1],
        [None, 1.5],
    )
]


def _id(cfg):
    return f"{cfg.aggregation}-{cfg.ratio}-kl{cfg.kl_coef}-tis{cfg.tis_cap}"


@pytest.mark.parametrize("cfg", VARIANTS, ids=_id)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_in_value_and_gradient(cfg, seed):
    new, old, ref, gen, adv, mask = random_batch(seed)
    kw = {
        "ref_logprobs": ref if cfg.kl_coef else None,
        "gen_logprobs": gen if cfg.tis_cap else None,
    }
    x = new.clone().requires_grad_()
    loss, metrics = policy_loss(x, old, adv, mask, cfg, **kw)
    (grad,) = torch.autograd.grad(loss, x)

    x_ref = new.clone().requires_grad_()
    expected = reference_loss(x_ref, old, adv, mask, cfg, ref=ref, gen=gen)
    (grad_ref,) = torch.autograd.grad(expected, x_ref)

    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-12)
    assert (grad[~mask] == 0).all()
    # The batch exercises both clips (and the cap): their branches are checked.
    assert metrics["clip_low_frac"] > 0 and metrics["clip_high_frac"] > 0
    assert metrics["clip_frac"] < 0.7 and grad.abs().sum() > 0
    if cfg.tis_cap:
        assert 0 < metrics["tis_capped_frac"] < 1
    assert all(not v.requires_grad for v in metrics.values())
    assert metrics["loss"] == loss.detach()


@pytest.mark.parametrize("cfg", VARIANTS[::3], ids=_id)
def test_micro_batches_with_step_normalizers_sum_to_the_full_batch(cfg):
    # Gradient accumulation: per-micro-batch losses with the step's counts add up exactly.
    new, old, ref, gen, adv, mask = random_batch(3)
    kw = {
        "ref_logprobs": ref if cfg.kl_coef else None,
        "gen_logprobs": gen if cfg.tis_cap else None,
    }
    full, _ = policy_loss(new, old, adv, mask, cfg, **kw)
    num_tokens, num_seqs = mask.sum(), (mask.sum(1) > 0).sum()
    parts = []
    for rows in (slice(0, 3), slice(3, 8)):
        part_kw = {k: v[rows] if v is not None else None for k, v in kw.items()}
        loss, _ = policy_loss(
            new[rows],
            old[rows],
            adv[rows],
            mask[rows],
            cfg,
            num_tokens=num_tokens,
            num_sequences=num_seqs,
            **part_kw,
        )
        parts.append(loss)
    torch.testing.assert_close(sum(parts), full, rtol=1e-12, atol=1e-12)


def test_on_policy_gradient_is_reinforce():
    # old == new detached: every ratio is 1, d loss / d logp = -A / tokens (nanochat's loss).
    new, _, _, _, adv, mask = random_batch(4)
    x = new.clone().requires_grad_()
    loss, metrics = policy_loss(x, new, adv, mask, LossConfig())
    loss.backward()
    expected = torch.where(mask, -adv[:, None] / mask.sum(), 0.0)
    torch.testing.assert_close(x.grad, expected)
    assert metrics["clip_frac"] == 0 and metrics["ratio_mean"] == 1


def test_sequence_ratio_equals_token_ratio_when_tokens_agree():
    # GSPO's ratio is the geometric mean of token ratios: equal token ratios give PPO's.
    _, old, _, _, adv, mask = random_batch(5)
    shift = 0.3 * torch.randn(old.shape[0], 1, dtype=torch.float64)
    new = old + shift  # one log-ratio per row
    a, _ = policy_loss(
        new, old, adv, mask, LossConfig(ratio="sequence", aggregation="seq-mean-token-mean")
    )
    b, _ = policy_loss(
        new, old, adv, mask, LossConfig(ratio="token", aggregation="seq-mean-token-mean")
    )
    torch.testing.assert_close(a, b)


def test_one_token_completions_make_aggregations_agree():
    new, old, _, _, adv, _ = random_batch(6)
    mask = torch.zeros_like(new, dtype=torch.bool)
    mask[:, 0] = True
    losses = [
        policy_loss(
            new,
            old,
            adv,
            mask,
            LossConfig(
                aggregation=agg, normalizer=float(new.shape[0]) if agg == "constant" else None
            ),
        )[0]
        for agg in ("token-mean", "seq-mean-token-mean", "constant")
    ]
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(losses[0], losses[2])


@pytest.mark.parametrize("cfg", VARIANTS[::5], ids=_id)
def test_all_masked_and_garbage_padding(cfg):
    new, old, ref, gen, adv, mask = random_batch(7)
    kw = {
        "ref_logprobs": ref if cfg.kl_coef else None,
        "gen_logprobs": gen if cfg.tis_cap else None,
    }
    # Padding holds NaN and inf (a forward over pad tokens, -inf log-probs): never read.
    poisoned = [t.masked_fill(~mask, v) for t, v in ((new, math.nan), (old, -math.inf))]
    x = poisoned[0].clone().requires_grad_()
    loss, metrics = policy_loss(x, poisoned[1], adv, mask, cfg, **kw)
    clean, _ = policy_loss(new, old, adv, mask, cfg, **kw)
    loss.backward()
    torch.testing.assert_close(loss, clean)
    assert torch.isfinite(x.grad).all() and (x.grad[~mask] == 0).all()
    assert all(torch.isfinite(v) for v in metrics.values())

    empty = torch.zeros_like(mask)
    x = new.clone().requires_grad_()
    loss, metrics = policy_loss(x, old, adv, empty, cfg, **kw)
    loss.backward()
    assert loss == 0 and (x.grad == 0).all() and metrics["num_tokens"] == 0


def test_clip_fractions_and_metrics():
    old = torch.zeros(2, 3)
    new = torch.log(torch.tensor([[1.5, 1.0, 0.5], [1.5, 1.0, 0.5]]))
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 3, dtype=torch.bool)
    _, m = policy_loss(new, old, adv, mask, LossConfig(clip_low=0.2, clip_high=0.28))
    # row 0 (A > 0): ratio 1.5 clipped high; row 1 (A < 0): ratio 0.5 clipped low.
    assert m["clip_high_frac"] == pytest.approx(1 / 6) and m["clip_low_frac"] == pytest.approx(
        1 / 6
    )
    assert m["clip_frac"] == pytest.approx(2 / 6)
    assert m["ratio_max"] == pytest.approx(1.5) and m["ratio_mean"] == pytest.approx(1.0)
    assert m["entropy"] == pytest.approx(float(-new.mean()))  # the -logp estimate
    _, m = policy_loss(new, old, adv, mask, LossConfig(), entropy=torch.full((2, 3), 2.0))
    assert m["entropy"] == pytest.approx(2.0)


def test_tis_weights_are_capped_ratios_of_trainer_to_generator():
    old = torch.zeros(1, 3)
    gen = torch.log(torch.tensor([[0.5, 1.0, 0.1]]))  # weights 2, 1, 10 -> capped at 3
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.ones(1)
    x = old.clone().requires_grad_()
    _, m = policy_loss(x, old, adv, mask, LossConfig(tis_cap=3.0), gen_logprobs=gen)
    assert m["tis_weight_mean"] == pytest.approx((2 + 1 + 3) / 3)
    assert m["tis_capped_frac"] == pytest.approx(1 / 3)


def test_kl_metric_is_k3_mean():
    new = torch.zeros(1, 2)
    ref = torch.tensor([[0.5, -0.5]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, m = policy_loss(new, new, torch.zeros(1), mask, LossConfig(kl_coef=0.1), ref_logprobs=ref)
    k3 = [math.exp(d) - d - 1 for d in (0.5, -0.5)]
    assert m["kl"] == pytest.approx(sum(k3) / 2)


def test_bf16_inputs_compute_in_fp32():
    new, old, _, _, adv, mask = random_batch(8)
    x = new.to(torch.bfloat16).requires_grad_()
    loss, _ = policy_loss(x, old.to(torch.bfloat16), adv.float(), mask, LossConfig())
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_inputs_the_config_needs_and_shapes():
    new, old, ref, gen, adv, mask = random_batch(9)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(new, old, adv, mask, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="needs gen_logprobs"):
        policy_loss(new, old, adv, mask, LossConfig(tis_cap=2.0))
    with pytest.raises(ValueError, match="advantages must have shape"):
        policy_loss(new, old, adv[:-1], mask, LossConfig())
    with pytest.raises(ValueError, match="mask must have shape"):
        policy_loss(new, old, adv, mask[:, :-1], LossConfig())
    with pytest.warns(UserWarning, match="ref_logprobs is ignored"):
        policy_loss(new, old, adv, mask, LossConfig(), ref_logprobs=ref)
    with pytest.warns(UserWarning, match="gen_logprobs is ignored"):
        policy_loss(new, old, adv, mask, LossConfig(), gen_logprobs=gen)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"ratio": "seq"}, "ratio"),
        ({"aggregation": "mean"}, "aggregation"),
        ({"aggregation": "constant"}, "normalizer"),
        ({"aggregation": "constant", "normalizer": 0.0}, "normalizer"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"tis_cap": 0.5}, "tis_cap"),
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kw)


def test_presets_and_ignored_normalizer_warns():
    assert grpo().aggregation == "seq-mean-token-mean" and grpo().kl_coef == 0.04
    assert dapo().clip_high > dapo().clip_low and dapo().drop_equal_groups
    assert dr_grpo(4096.0).normalizer == 4096.0 and not dr_grpo(1.0).std_normalize
    assert gspo().ratio == "sequence"
    with pytest.warns(UserWarning, match="normalizer is ignored"):
        LossConfig(normalizer=10.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LossConfig()


# -- advantages ----------------------------------------------------------------------------


def reference_advantages(rewards, groups, std):
    out = []
    for r, g in zip(rewards, groups, strict=True):
        members = [x for x, h in zip(rewards, groups, strict=True) if h == g]
        mean = sum(members) / len(members)
        a = r - mean
        if std:
            sd = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
            a = a / (sd + 1e-6)
        out.append(a)
    return out


@pytest.mark.parametrize("std", [False, True])
def test_group_advantages_match_reference(std):
    g = torch.Generator().manual_seed(0)
    groups = [7, 7, 7, 3, 3, 100, 100, 100, 100, 7]  # any ids, any order, varied sizes
    rewards = torch.rand(len(groups), generator=g).tolist()
    cfg = LossConfig(std_normalize=std, drop_equal_groups=False)
    out = group_advantages(torch.tensor(rewards), torch.tensor(groups), cfg)
    expected = reference_advantages(rewards, groups, std)
    torch.testing.assert_close(out.advantages, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert out.advantages.dtype == torch.float32 and out.keep.all()
    assert out.groups == 3 and out.dropped_groups == 0


def test_dynamic_sampling_drops_and_counts_equal_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    out = group_advantages(rewards, groups, LossConfig())
    assert out.keep.tolist() == [False, False, True, True, False, False, False, False]
    assert out.dropped_groups == 3 and out.groups == 4
    assert (out.advantages[~out.keep] == 0).all()
    torch.testing.assert_close(
        out.advantages[out.keep], torch.tensor([-0.5, 0.5]) / (0.5**0.5 + 1e-6)
    )
    kept = group_advantages(rewards, groups, LossConfig(drop_equal_groups=False))
    assert kept.keep.all() and kept.dropped_groups == 0
    assert (kept.advantages[:2] == 0).all()  # equal rewards: zero advantage, no NaN


def test_std_normalization_with_a_group_of_one_is_an_error():
    rewards, groups = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([4, 4, 9])
    with pytest.raises(ValueError, match="group 9 has 1"):
        group_advantages(rewards, groups, LossConfig())
    out = group_advantages(rewards, groups, LossConfig(std_normalize=False))
    assert out.advantages[2] == 0 and out.dropped_groups == 1  # a lone sample teaches nothing


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="1-D of one length"):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long), LossConfig())
    with pytest.raises(ValueError, match="integers"):
        group_advantages(torch.zeros(3), torch.zeros(3), LossConfig())
