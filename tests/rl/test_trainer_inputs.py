"""Rollouts into trainer batches, and the trainer's step with the GRPO-family loss against a
hand-written reference step (one process, fp32 CPU)."""

import pytest
import torch

from tests.rl._trainer import (
    capture_grads,
    concat,
    no_data,
    random_rollout,
    reference_step,
    rl_config,
    seed_model,
)
from tidal.rl.loss import LossConfig, group_advantages
from tidal.rl.trainer_inputs import PolicyLoss, rollout_batches
from tidal.train.loss import IGNORE_INDEX, CrossEntropy
from tidal.train.trainer import Trainer


def test_rollout_rows_become_next_token_batches():
    rollout = random_rollout(n=5)
    adv = torch.arange(5.0)
    batches = rollout_batches(rollout, adv, micro_batch_size=2)
    assert len(batches) == 3 and all(b.input_ids.shape == (2, 20) for b in batches)
    b = concat(batches)
    ids = rollout.token_ids()
    for i in range(5):
        p, c = int(rollout.prompt_lens[i]), int(rollout.completion_mask[i].sum())
        assert torch.equal(b.input_ids[i, : p + c - 1], ids[i, : p + c - 1])
        want = torch.full((20,), IGNORE_INDEX)
        want[p - 1 : p - 1 + c] = rollout.completion_ids[i, :c]
        assert torch.equal(b.labels[i], want), i
        assert torch.equal(b.extras["mask"][i], want != IGNORE_INDEX)
        lp = b.extras["gen_logprobs"][i]
        assert torch.equal(lp[p - 1 : p - 1 + c], rollout.logprobs[i, :c])
        assert (lp[: p - 1] == 0).all() and (lp[p - 1 + c :] == 0).all()
        assert torch.equal(b.extras["old_logprobs"][i], lp)  # default: the generator's
    assert torch.equal(b.extras["advantages"], torch.tensor([0.0, 1, 2, 3, 4, 0]))
    assert (b.labels[5] == IGNORE_INDEX).all() and not b.extras["mask"][5].any()  # padding
    assert sum(x.target_count() for x in batches) == int(rollout.completion_mask.sum())
    # A fixed width, and the data-parallel shares: disjoint rows, as many batches each.
    shares = [
        rollout_batches(rollout, adv, micro_batch_size=2, seq_len=24, dp_rank=r, dp_world=2)
        for r in (0, 1)
    ]
    assert [len(s) for s in shares] == [2, 2] and shares[0][0].labels.shape == (2, 24)
    assert torch.equal(concat(shares[1]).extras["advantages"], torch.tensor([1.0, 3, 0, 0]))


def test_dropped_groups_are_left_out_and_bad_input_is_named():
    rollout = random_rollout(n=6)
    rollout.rewards[:] = torch.tensor([1.0, 1, 1, 0, 1, 0])  # group 0 all equal: dropped
    adv = group_advantages(rollout.rewards, rollout.group_ids, LossConfig())
    batches = rollout_batches(rollout, adv, micro_batch_size=4)
    assert len(batches) == 1 and batches[0].extras["mask"][3].sum() == 0  # rows 3..5 + pad
    assert torch.equal(batches[0].extras["advantages"][:3], adv.advantages[3:])
    with pytest.raises(ValueError, match=r"ref_logprobs must have the rollout's shape"):
        rollout_batches(rollout, adv, micro_batch_size=2, ref_logprobs=torch.zeros(6, 3))
    with pytest.raises(ValueError, match="seq_len=5 is shorter"):
        rollout_batches(rollout, adv, micro_batch_size=2, seq_len=5)
    with pytest.raises(KeyError, match="PolicyLoss needs batch extras"):
        PolicyLoss(LossConfig(kl_coef=0.1))(torch.zeros(4, 20), batches[0], None, None)


CONFIGS = {
    "token-mean, KL, TIS": LossConfig(kl_coef=0.1, tis_cap=2.0),
    "seq-mean-token-mean": LossConfig(aggregation="seq-mean-token-mean", clip_high=0.2),
    "GSPO": LossConfig(
        ratio="sequence", aggregation="seq-mean-token-mean", clip_low=0.02, clip_high=0.02
    ),
}


def rl_batches(trainer, seed: int):
    """Micro-batches of a random rollout with old log-probs near the trainer's own (so some
    ratios clip and some do not) and reference log-probs for KL."""
    rollout = random_rollout(seed, n=6)
    adv = torch.randn(6, generator=torch.Generator().manual_seed(seed))
    batches = rollout_batches(rollout, adv, micro_batch_size=2, seq_len=24)
    g = torch.Generator().manual_seed(seed + 1)
    for b in batches:
        lp = trainer.logprobs(b)
        noise = 0.4 * torch.randn(lp.shape, generator=g)
        b.extras["old_logprobs"] = torch.where(b.extras["mask"], lp + noise, 0.0)
        b.extras["ref_logprobs"] = torch.where(b.extras["mask"], lp - noise.abs(), 0.0)
    return batches


def test_grpo_step_equals_a_hand_written_reference(tmp_path):
    trainer = Trainer(rl_config(tmp_path), data=no_data(), log=lambda *a: None)
    grads = capture_grads(trainer)
    model = seed_model()
    try:
        for seed, (name, cfg) in enumerate(CONFIGS.items()):
            model.load_state_dict(trainer.model.state_dict())  # the trainer's current weights
            batches = rl_batches(trainer, seed)
            ref_loss, ref_metrics, ref_grads = reference_step(model, concat(batches), cfg)
            n_tokens = sum(b.target_count() for b in batches)
            result = trainer.train_step(batches, n_tokens, loss=PolicyLoss(cfg))
            torch.testing.assert_close(result.loss, ref_loss, msg=name)
            assert set(result.metrics) == set(ref_metrics), name
            for k, v in ref_metrics.items():
                torch.testing.assert_close(result.metrics[k], v.float(), msg=f"{name}: {k}")
            assert 0 < float(result.metrics["clip_frac"]) < 1, name  # both sides exercised
            for k, g in ref_grads.items():
                torch.testing.assert_close(grads[k], g, atol=1e-6, rtol=1e-5, msg=f"{name}: {k}")
    finally:
        trainer.close()


def test_old_logprobs_from_the_step_forward_equal_a_recomputation(tmp_path):
    """PolicyLoss(old_is_current=True) takes the PPO ratio against the step's own forward:
    with one optimizer step per batch that is what a recomputation pass gives. Same loss and
    gradients as the batches carrying `Trainer.logprobs` as old log-probs; every ratio is 1."""
    cfg = LossConfig(tis_cap=2.0)
    runs = []
    for current in (False, True):
        trainer = Trainer(rl_config(tmp_path / str(current)), data=no_data(), log=lambda *a: None)
        grads = capture_grads(trainer)
        batches = rl_batches(trainer, 3)
        for b in batches:
            if current:
                del b.extras["old_logprobs"]  # not needed
            else:
                b.extras["old_logprobs"] = trainer.logprobs(b)
        n_tokens = sum(b.target_count() for b in batches)
        result = trainer.train_step(batches, n_tokens, loss=PolicyLoss(cfg, old_is_current=current))
        runs.append((result, dict(grads)))
        trainer.close()
    (recomputed, grads_a), (current, grads_b) = runs
    torch.testing.assert_close(current.loss, recomputed.loss)
    assert float(current.metrics["ratio_min"]) == float(current.metrics["ratio_max"]) == 1.0
    for k in ("tis_weight_mean", "tis_capped_frac"):
        torch.testing.assert_close(current.metrics[k], recomputed.metrics[k], msg=k)
    for k, g in grads_a.items():
        torch.testing.assert_close(grads_b[k], g, atol=1e-6, rtol=1e-5, msg=k)


def test_injected_cross_entropy_equals_the_default_loss(tmp_path):
    """The TokenLoss path (per-token log-probs, then the loss) against the fused default."""
    results = []
    for loss in (None, CrossEntropy()):
        trainer = Trainer(rl_config(tmp_path / str(loss)), data=no_data(), log=lambda *a: None)
        grads = capture_grads(trainer)
        batches = rl_batches(trainer, 0)
        result = trainer.train_step(batches, sum(b.target_count() for b in batches), loss=loss)
        results.append((result.loss, dict(grads)))
        trainer.close()
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a)
    for k in grads_a:
        torch.testing.assert_close(grads_b[k], grads_a[k], atol=1e-6, rtol=1e-5, msg=k)


def test_trainer_without_data_refuses_the_loop(tmp_path):
    trainer = Trainer(rl_config(tmp_path), data=no_data(), log=lambda *a: None)
    try:
        with pytest.raises(ValueError, match="has no training data"):
            trainer.next_batches()
        with pytest.raises(ValueError, match="needs training data"):
            trainer.train()
        lp = trainer.logprobs(rl_batches(trainer, 0)[0])
        assert lp.shape == (2, 24) and not lp.requires_grad and trainer.model.training
    finally:
        trainer.close()
