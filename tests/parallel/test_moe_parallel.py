"""A mixture-of-experts model under FSDP2 on 2 CPU ranks (gloo) against one process: the
stacked experts shard like any parameter, the tokens per expert are summed over the ranks,
so the aux-loss-free expert bias (updated from them after each step) stays the same on every
rank and equals the one-process bias; losses and gradient norms agree to fp32 rounding.

The auxiliary loss is left out here (coefficient 0): each rank's aux loss is of its own
tokens, and a mean of per-rank products is not the product over the whole batch."""

from __future__ import annotations

import torch

from tests.parallel._launch import run_ranks

from .test_parity import make_config

STEPS = 4


def moe_run(rank, world, cfg):
    from tidal.models.moe import moe_layers
    from tidal.parallel.launch import DistInfo
    from tidal.train.trainer import Trainer

    info = DistInfo.from_env() if world > 1 else None
    trainer = Trainer(cfg, dist_info=info, log=lambda *a: None)
    try:
        out = []
        for _ in range(STEPS):
            trainer.step += 1
            batches, n_tokens, _ = trainer.next_batches()
            result = trainer.train_step(batches, n_tokens)
            out.append((float(result.loss), float(result.grad_norm)))
        bias = torch.stack([m.expert_bias for m in moe_layers(trainer.model)]).cpu()
        return out, bias, trainer.path.moe_counts.cpu()
    finally:
        trainer.close()


def test_fsdp2_moe_matches_one_process(tmp_path, text_corpus, cache_dir):
    common = [
        "--model.flavor",
        "debug_moe",
        "--model.moe_load_balance",
        "bias",
        "--training.moe_aux_loss_coef",
        "0",
    ]
    ref_cfg = make_config(
        tmp_path / "ref", text_corpus, cache_dir, *common, "--training.batch_size", "8"
    )
    ref_losses, ref_bias, ref_counts = moe_run(0, 1, ref_cfg)
    cfg = make_config(
        tmp_path / "fsdp",
        text_corpus,
        cache_dir,
        *common,
        "--parallelism.dp_shard",
        "2",
        "--training.batch_size",
        "4",
    )
    ref = torch.tensor(ref_losses)
    assert ref_bias.abs().sum() > 0 and int(ref_counts.sum()) == 8 * 32 * 2 * 4
    for losses, bias, counts in run_ranks(2, moe_run, cfg, tmp_path=tmp_path):
        torch.testing.assert_close(torch.tensor(losses), ref, atol=2e-5, rtol=1e-5)
        assert torch.equal(counts, ref_counts)  # the whole step's tokens on every rank
        assert torch.equal(bias, ref_bias)
