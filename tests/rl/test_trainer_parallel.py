"""The trainer's step with the GRPO-family loss, and `Trainer.logprobs`, on several CPU ranks
(gloo) against one process: FSDP2 (each rank its share of the rollout), TP=2 (vocabulary-
sharded logits: the distributed log-sum-exp), PP=2 (the extras reach the loss through the
schedule), and CP=2 (log-probs of whole sequences; the injected loss is refused).

The reference is the hand-written step of tests/rl/_trainer.py on the seed weights; fp32
throughout, so values agree to rounding (sums in another order), not bitwise."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.parallel._launch import run_ranks
from tests.rl._trainer import (
    concat,
    random_rollout,
    reference_step,
    seed_model,
)
from tidal.generate import completion_logprobs
from tidal.rl.loss import LossConfig
from tidal.rl.trainer_inputs import rollout_batches
from tidal.train.loss import IGNORE_INDEX

N, MICRO, SEQ = 8, 4, 24
CFG = LossConfig(kl_coef=0.1, tis_cap=2.0, clip_low=0.1, clip_high=0.1)


def inputs():
    """A rollout, advantages, and old/reference log-probs near the seed model's own."""
    rollout = random_rollout(3, n=N)
    g = torch.Generator().manual_seed(7)
    adv = torch.randn(N, generator=g)
    samples = [
        SimpleNamespace(
            prompt_ids=rollout.prompt_ids[i, : rollout.prompt_lens[i]].tolist(),
            completion_ids=rollout.completion_ids[i][rollout.completion_mask[i]].tolist(),
        )
        for i in range(N)
    ]
    with torch.no_grad():
        own = completion_logprobs(seed_model(), samples)
    lp_NC = torch.zeros(rollout.completion_ids.shape)
    for i, lp in enumerate(own):
        lp_NC[i, : len(lp)] = lp
    noise = 0.3 * torch.randn(lp_NC.shape, generator=g)
    mask = rollout.completion_mask
    old = torch.where(mask, lp_NC + noise, 0.0)
    ref = torch.where(mask, lp_NC - noise.abs(), 0.0)
    return rollout, adv, old, ref


def batches_for(dp_rank: int, dp_world: int):
    rollout, adv, old, ref = inputs()
    return rollout_batches(
        rollout,
        adv,
        micro_batch_size=MICRO,
        seq_len=SEQ,
        old_logprobs=old,
        ref_logprobs=ref,
        dp_rank=dp_rank,
        dp_world=dp_world,
    )


def _step(rank, world, out_dir, overrides, dp_world):
    from tests.rl._trainer import capture_grads, no_data, rl_config
    from tidal.parallel.launch import DistInfo
    from tidal.rl.trainer_inputs import PolicyLoss
    from tidal.train.trainer import Trainer

    cfg = rl_config(out_dir, *overrides)
    trainer = Trainer(cfg, data=no_data(), dist_info=DistInfo.from_env(), log=lambda *a: None)
    try:
        dp_rank = trainer.path.mesh["dp"].get_local_rank()
        batches = batches_for(dp_rank, dp_world)
        logprobs = [trainer.logprobs(b) for b in batches]
        if trainer.dims.cp > 1:
            with pytest.raises(ValueError, match="does not run under context parallelism"):
                trainer.train_step(batches, 1, loss=PolicyLoss(CFG))
            return dp_rank, logprobs, None
        grads = capture_grads(trainer)
        n_tokens = sum(b.target_count() for b in batches)
        result = trainer.train_step(batches, n_tokens, loss=PolicyLoss(CFG))
        metrics = {k: float(v) for k, v in result.metrics.items()}
        return dp_rank, logprobs, (float(result.loss), metrics, dict(grads))
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def reference():
    model = seed_model()
    loss, metrics, grads = reference_step(model, concat(batches_for(0, 1)), CFG)
    return float(loss), {k: float(v) for k, v in metrics.items()}, grads


LAYOUTS = {
    "fsdp2": (["--parallelism.dp_shard", "2"], 2),
    "tp2": (["--parallelism.tp", "2", "--parallelism.dp_shard", "1"], 1),
    "pp2_1f1b": (
        [
            "--parallelism.pp",
            "2",
            "--parallelism.dp_shard",
            "1",
            "--parallelism.pp_schedule",
            "1F1B",
            "--parallelism.pp_microbatches",
            "2",
        ],
        1,
    ),
    # ZBV: the last stage lives on pipeline rank 0, two stages per rank.
    "pp2_zbv": (
        [
            "--parallelism.pp",
            "2",
            "--parallelism.dp_shard",
            "1",
            "--parallelism.pp_schedule",
            "ZBVZeroBubble",
            "--parallelism.pp_microbatches",
            "2",
        ],
        1,
    ),
    "cp2": (["--parallelism.cp", "2", "--parallelism.dp_shard", "1"], 1),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grpo_step_and_logprobs_match_one_process(layout, reference, tmp_path):
    overrides, dp_world = LAYOUTS[layout]
    results = run_ranks(2, _step, tmp_path / "out", overrides, dp_world, tmp_path=tmp_path)
    model = seed_model()
    ref_loss, ref_metrics, ref_grads = reference
    for rank, (dp_rank, logprobs, step) in enumerate(results):
        for b, lp in zip(batches_for(dp_rank, dp_world), logprobs, strict=True):
            with torch.no_grad():
                want = reference_logprobs(model, b)
            torch.testing.assert_close(lp, want, atol=1e-5, rtol=1e-5, msg=f"rank {rank}")
        if step is None:  # CP: refused, checked in the child
            continue
        loss, metrics, grads = step
        assert loss == pytest.approx(ref_loss, abs=1e-5), rank
        assert set(metrics) == set(ref_metrics)
        for k, v in ref_metrics.items():
            assert metrics[k] == pytest.approx(v, abs=1e-5), (rank, k)
        assert 0 < metrics["clip_frac"] < 1 and metrics["kl"] > 0
        if layout.startswith("pp"):  # each rank holds its stages' parameters
            assert grads and set(grads) < set(ref_grads)
        else:
            assert set(grads) == set(ref_grads)
        for k, g in grads.items():
            torch.testing.assert_close(g, ref_grads[k], atol=1e-5, rtol=1e-4, msg=f"{rank} {k}")
    if layout.startswith("pp"):
        assert set(results[0][2][2]) | set(results[1][2][2]) == set(ref_grads)


def reference_logprobs(model, batch):
    logp = F.log_softmax(model(batch.input_ids).float(), -1)
    lp = logp.gather(2, batch.labels.clamp(min=0)[..., None])[..., 0]
    return torch.where(batch.labels != IGNORE_INDEX, lp, 0.0)
