"""Sync-mode parity on CPU in fp32: in batch-invariant mode the trainer recomputes the
log-probs the Generator reported, bit for bit, both when scoring (`Trainer.logprobs`) and in
the training step's own forward, so every importance ratio is exactly 1.0."""

import torch

from tests.rl._trainer import no_data, rl_config
from tidal.generate import Generator, GeneratorConfig, SamplingParams
from tidal.rl.loss import LossConfig, group_advantages
from tidal.rl.rollout import RolloutBatch
from tidal.rl.tasks.base import Grade
from tidal.rl.trainer_inputs import PolicyLoss, rollout_batches
from tidal.train.trainer import Trainer

PROMPTS = [[0, 5, 7, 9], list(range(2, 30)), [0, 4], [0] + [9] * 11]


class Recording:
    """A TokenLoss that keeps what the step passed it, then defers to the GRPO loss."""

    def __init__(self, loss):
        self.loss, self.wants_entropy, self.seen = loss, loss.wants_entropy, []

    def __call__(self, logprobs, batch, norms, entropy):
        self.seen.append(
            (logprobs.detach().clone(), batch.extras["old_logprobs"], batch.extras["mask"])
        )
        return self.loss(logprobs, batch, norms, entropy)


def test_trainer_logprobs_are_the_generators_bits_and_ratios_are_one(tmp_path):
    cfg = rl_config(
        tmp_path,
        "--model.flavor",
        "debug",
        "--training.batch_invariant",
        "true",
        "--training.seq_len",
        "64",
    )
    trainer = Trainer(cfg, data=no_data(), log=lambda *a: None)
    try:
        # The generator runs the trainer's own module: the weights of version v, in sync mode.
        gen = Generator(
            trainer.model,
            config=GeneratorConfig(
                max_batch=5, max_seq_len=64, check_every=3, batch_invariant=True
            ),
        )
        params = [
            SamplingParams(n=3, temperature=1.0, max_new_tokens=14, seed=i)
            for i in range(len(PROMPTS))
        ]
        samples = [s for g in gen.generate(PROMPTS, params) for s in g]
        grades = [
            Grade(reward=float(i % 2), answer=None, format_ok=True) for i in range(len(samples))
        ]
        rollout = RolloutBatch.from_samples(samples, grades, task="test")
        loss_cfg = LossConfig(drop_equal_groups=False)
        adv = group_advantages(rollout.rewards, rollout.group_ids, loss_cfg)
        # Trainer batches group the rows differently from the generator's decode batches.
        batches = rollout_batches(rollout, adv, micro_batch_size=4, seq_len=48)
        for b in batches:
            lp, mask = trainer.logprobs(b), b.extras["mask"]
            assert torch.equal(lp[mask], b.extras["gen_logprobs"][mask])  # the generator's
        assert int(rollout.completion_mask.sum()) > 100

        loss = Recording(PolicyLoss(loss_cfg))
        result = trainer.train_step(batches, sum(b.target_count() for b in batches), loss=loss)
        assert len(loss.seen) == len(batches)
        for new, old, mask in loss.seen:  # old = the generator's log-probs (sync mode)
            assert torch.equal(new[mask], old[mask])
        m = result.metrics
        assert float(m["ratio_max"]) == 1.0 and float(m["clip_frac"]) == 0.0
        # ratio_mean: exact ones weighted by each micro-batch's share of the tokens.
        assert abs(float(m["ratio_mean"]) - 1.0) < 1e-6
        assert float(result.grad_norm) > 0
    finally:
        trainer.close()
