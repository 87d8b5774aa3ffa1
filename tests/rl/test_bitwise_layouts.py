"""Sync RL in batch-invariant mode across trainer/generator layouts: every PPO ratio exactly
1.0 over 3 steps (the trainer's recomputed log-probs bitwise the generator's), through
`tidal rl` on CPU with gloo. FSDP2 on 2 trainer ranks against one generator process is
tests/rl/test_loop.py::test_batch_invariant_ratios_are_exactly_one_through_the_loop; the
layouts' log-probs themselves are compared in tests/parallel/test_bitwise_layouts.py."""

from __future__ import annotations

import pytest

from tests.rl._cli import NO_PLOT, records, run_rl


@pytest.mark.parametrize("generator_tp", ["1", "2"], ids=["tp2_vs_tp1", "tp2_vs_tp2"])
def test_tp_trainer_ratios_are_exactly_one(generator_tp, tmp_path):
    """A trainer with TP 2 (sequence parallel, replicated logits) and a generator with TP 1
    or TP 2 (no sequence parallel). About 30 s each on the shared 2-core machine."""
    out = tmp_path / "run"
    r = run_rl(
        out,
        "--rl.steps",
        "3",
        "--generator.batch_invariant",
        "true",
        "--generator.tp",
        generator_tp,
        *NO_PLOT,
        "--nproc",
        "2",
        "--parallelism.tp",
        "2",
        "--parallelism.dp_shard",
        "1",
        "--parallelism.loss_parallel",
        "false",
    )
    assert r.returncode == 0, r.stdout
    assert "world 2 (tp=2)" in r.stdout
    steps, _ = records(out)
    assert len(steps) == 3
    for s in steps:
        assert s["ratio_max"] == 1.0 and s["ratio_min"] == 1.0, s
    assert steps[-1]["reward_mean"] != steps[0]["reward_mean"]  # the policy did change


@pytest.mark.parametrize("loss_parallel", [True, False])
def test_tp_batch_invariance_needs_replicated_logits(loss_parallel, tmp_path):
    """A vocabulary-sharded log-softmax (loss parallel) sums its shards in another order than
    one process: refused with TP in batch-invariant mode; replicated logits are accepted."""
    import torch

    from tidal.models import get_flavor
    from tidal.train.config_parse import apply_overrides
    from tidal.train.configs import get_config
    from tidal.train.job import check_job

    cfg = apply_overrides(
        get_config("debug"),
        ["--job.output_dir", str(tmp_path), "--model.flavor", "tiny", "--training.batch_invariant",
         "true", "--parallelism.tp", "2", "--parallelism.dp_shard", "1",
         "--parallelism.loss_parallel", str(loss_parallel).lower()],
    )  # fmt: skip
    check = lambda: check_job(  # noqa: E731
        cfg, get_flavor("tiny"), world_size=2, device=torch.device("cpu"), data=False
    )
    if loss_parallel:
        with pytest.raises(ValueError, match="parallelism.tp=2 with parallelism.loss_parallel"):
            check()
    else:
        assert check().tp == 2
