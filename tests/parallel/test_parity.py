"""Loss parity of every parallel layout against one process, from identical initial weights.

All runs train the `tiny` flavor in fp32 on CPU with gloo, on the same global batches (the
loader gives data-parallel ranks disjoint windows whose union is the single-process batch),
with weights initialized per parameter from the same seed whatever the sharding.

Tolerances, per case (fp32 throughout): a parallel run sums the same products in another
order (split batches, sharded matmuls, reduce-scatter), so losses agree to ~1e-6 relative,
not bitwise; 2e-5 absolute over four optimizer steps leaves a margin of about 10x.
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel._launch import run_ranks
from tidal.parallel import pipeline
from tidal.train.config_parse import apply_overrides
from tidal.train.configs import get_config

STEPS = 4
ATOL = 2e-5


def make_config(tmp_path, corpus, cache_dir, *extra):
    return apply_overrides(
        get_config("debug"),
        [
            "--job.output_dir",
            str(tmp_path / "out"),
            "--job.device",
            "cpu",
            "--model.flavor",
            "tiny",
            "--model.vocab_size",
            "512",
            "--data.dataset",
            "jsonl",
            "--data.path",
            str(corpus),
            "--data.cache_dir",
            str(cache_dir),
            "--data.vocab_size",
            "512",
            "--training.steps",
            str(STEPS),
            "--training.seq_len",
            "32",
            "--training.mixed_precision",
            "fp32",
            "--lr_scheduler.warmup_steps",
            "0",
            "--optimizer.lr",
            "1e-2",
            "--metrics.val_every",
            "0",
            "--metrics.log_every",
            "1",
            "--sample.max_new_tokens",
            "0",
            *extra,
        ],
    )


def train_losses(rank, world, cfg):
    from tidal.parallel.launch import DistInfo
    from tidal.train.trainer import Trainer

    trainer = Trainer(cfg, dist_info=DistInfo.from_env(), log=lambda *a: None)
    try:
        losses = []
        for _ in range(STEPS):
            trainer.step += 1
            batches, n_tokens, _ = trainer.next_batches()
            result = trainer.train_step(batches, n_tokens)
            losses.append((float(result.loss), float(result.grad_norm)))
        return losses
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_corpus, cache_dir):
    """Single-process losses for global batch 8, with grad accumulation 1."""
    tmp = tmp_path_factory.mktemp("ref")
    cfg = make_config(tmp, text_corpus, cache_dir, "--training.batch_size", "8")
    return train_losses(0, 1, cfg)


CASES = {
    # name: (world, overrides); batch_size is per data-parallel rank (global 8).
    "fsdp2": (2, ["--parallelism.dp_shard", "2", "--training.batch_size", "4"]),
    "tp2_sp": (
        2,
        ["--parallelism.tp", "2", "--parallelism.dp_shard", "1", "--training.batch_size", "8"],
    ),
    "tp2_no_loss_parallel": (
        2,
        [
            "--parallelism.tp",
            "2",
            "--parallelism.dp_shard",
            "1",
            "--parallelism.loss_parallel",
            "false",
            "--training.batch_size",
            "8",
        ],
    ),
    "pp2_1f1b": (
        2,
        [
            "--parallelism.pp",
            "2",
            "--parallelism.dp_shard",
            "1",
            "--parallelism.pp_schedule",
            "1F1B",
            "--parallelism.pp_microbatches",
            "4",
            "--training.batch_size",
            "8",
        ],
    ),
    "pp2_gpipe": (
        2,
        [
            "--parallelism.pp",
            "2",
            "--parallelism.dp_shard",
            "1",
            "--parallelism.pp_schedule",
            "GPipe",
            "--training.batch_size",
            "8",
        ],
    ),
    "pp2_interleaved": (
        2,
        [
            "--parallelism.pp",
            "2",
            "--parallelism.dp_shard",
            "1",
            "--parallelism.pp_schedule",
            "Interleaved1F1B",
            "--parallelism.pp_microbatches",
            "4",
            "--training.batch_size",
            "8",
        ],
    ),
    "pp2_module_lists": (
        2,
        [
            "--parallelism.pp",
            "2",
            "--parallelism.dp_shard",
            "1",
            "--parallelism.pp_split",
            "tok_embeddings,layers.0;layers.1,layers.2,layers.3,norm,output",
            "--training.batch_size",
            "8",
        ],
    ),
    "pp2_zbv": (
        2,
        [
            "--parallelism.pp",
            "2",
            "--parallelism.dp_shard",
            "1",
            "--parallelism.pp_schedule",
            "ZBVZeroBubble",
            "--parallelism.pp_microbatches",
            "4",
            "--training.batch_size",
            "8",
        ],
    ),
    "hsdp_2x2": (
        4,
        [
            "--parallelism.dp_replicate",
            "2",
            "--parallelism.dp_shard",
            "2",
            "--training.batch_size",
            "2",
        ],
    ),
    "fsdp2_tp2": (
        4,
        ["--parallelism.dp_shard", "2", "--parallelism.tp", "2", "--training.batch_size", "4"],
    ),
    "fsdp2_accum2": (
        2,
        [
            "--parallelism.dp_shard",
            "2",
            "--training.batch_size",
            "2",
            "--training.grad_accum_steps",
            "2",
        ],
    ),
    "fsdp2_ac_full": (
        2,
        [
            "--parallelism.dp_shard",
            "2",
            "--training.batch_size",
            "4",
            "--activation_checkpoint.mode",
            "full",
        ],
    ),
    # Context parallel trains on CPU here: the all-gather form uses SDPA with an explicit
    # mask (no CP sharding rule needed), whose backward runs on CPU.
    "cp2_sdpa": (
        2,
        ["--parallelism.cp", "2", "--parallelism.dp_shard", "1", "--training.batch_size", "8"],
    ),
    "cp2_no_load_balance": (
        2,
        [
            "--parallelism.cp",
            "2",
            "--parallelism.dp_shard",
            "1",
            "--parallelism.cp_load_balance",
            "false",
            "--training.batch_size",
            "8",
        ],
    ),
    "fsdp2_cp2": (
        4,
        ["--parallelism.cp", "2", "--parallelism.dp_shard", "2", "--training.batch_size", "4"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_loss_parity(name, reference, tmp_path, text_corpus, cache_dir):
    world, extra = CASES[name]
    cfg = make_config(tmp_path, text_corpus, cache_dir, *extra)
    if "ZBVZeroBubble" in extra and torch_version() < pipeline.ZBV_GLOO_MIN_TORCH:
        with pytest.raises(AssertionError, match="'ZBVZeroBubble' on gloo .* needs torch >="):
            run_ranks(world, train_losses, cfg, tmp_path=tmp_path)
        return
    results = run_ranks(world, train_losses, cfg, tmp_path=tmp_path)
    ref = torch.tensor(reference)
    for rank, losses in enumerate(results):
        got = torch.tensor(losses)
        torch.testing.assert_close(
            got[:, 0],
            ref[:, 0],
            atol=ATOL,
            rtol=0,
            msg=lambda m, r=rank: f"{name} rank {r} loss: {m}",
        )
        torch.testing.assert_close(
            got[:, 1],
            ref[:, 1],
            atol=ATOL,
            rtol=1e-5,
            msg=lambda m, r=rank: f"{name} rank {r} grad norm: {m}",
        )
    assert ref[-1, 0] < ref[0, 0]  # the runs really trained


def torch_version() -> tuple[int, ...]:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def test_zbv_on_gloo_with_an_old_torch_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(pipeline.dist, "get_backend", lambda group: "gloo")
    monkeypatch.setattr(pipeline.torch, "__version__", "2.11.0+cpu")
    with pytest.raises(ValueError, match=r"'ZBVZeroBubble' on gloo \(CPU\) needs torch >= 2.13"):
        pipeline.require_zbv_support("ZBVZeroBubble", None)
    pipeline.require_zbv_support("InterleavedZeroBubble", None)  # other schedules run
    monkeypatch.setattr(pipeline.torch, "__version__", "2.13.0")
    pipeline.require_zbv_support("ZBVZeroBubble", None)


def _bitwise_losses(rank, world, cfg, reference: bool):
    """FSDP over `world` ranks, or (reference) one process accumulating the ranks' batches
    as micro-batches in rank order; no clipping, so the math is the same operation for
    operation."""
    import itertools

    import numpy as np

    from tidal.parallel.launch import DistInfo
    from tidal.train.data import DataBundle, PackedLoader
    from tidal.train.trainer import Trainer

    tokens = np.random.default_rng(0).integers(2, 512, 8 * 33 * (STEPS + 1))
    tok = type("Tok", (), {"vocab_size": 512, "bos_id": 0, "eos_id": 1})()

    def loader(r):
        return PackedLoader(
            tokens, np.array([0]), seq_len=32, batch_size=2, seed=0, dp_rank=r, dp_world=2
        )

    if reference:
        shards = [loader(r) for r in range(2)]
        train = (next(shards[i % 2]) for i in itertools.count())
        data = DataBundle(tokenizer=tok, train=train, val=None)
        trainer = Trainer(cfg, data=data, log=lambda *a: None)
    else:
        trainer = Trainer(
            cfg,
            data=lambda r, w: DataBundle(tokenizer=tok, train=loader(r), val=None),
            dist_info=DistInfo.from_env(),
            log=lambda *a: None,
        )
    try:
        out = []
        for _ in range(STEPS):
            batches, n_tokens, _ = trainer.next_batches()
            out.append(float(trainer.train_step(batches, n_tokens).loss))
        return out
    finally:
        trainer.close()


def test_fsdp_fp32_is_bitwise_equal_to_one_process(tmp_path, text_corpus, cache_dir):
    common = ["--training.max_norm", "0", "--training.batch_size", "2"]
    ref_cfg = make_config(
        tmp_path, text_corpus, cache_dir, *common, "--training.grad_accum_steps", "2"
    )
    fsdp_cfg = make_config(tmp_path, text_corpus, cache_dir, *common, "--parallelism.dp_shard", "2")
    ref = _bitwise_losses(0, 1, ref_cfg, True)
    for losses in run_ranks(2, _bitwise_losses, fsdp_cfg, False, tmp_path=tmp_path):
        assert losses == ref  # exactly: same products, same sums, powers-of-two scaling


def val_loss(rank, world, cfg):
    from tidal.parallel.launch import DistInfo
    from tidal.train.trainer import Trainer

    trainer = Trainer(cfg, dist_info=DistInfo.from_env(), log=lambda *a: None)
    try:
        return trainer.validate()
    finally:
        trainer.close()


@pytest.mark.parametrize(
    "layout",
    [["--parallelism.pp", "2", "--parallelism.pp_microbatches", "4"], ["--parallelism.tp", "2"]],
    ids=["pp2", "tp2"],
)
def test_validation_loss_matches_one_process(layout, tmp_path, text_corpus, cache_dir):
    common = ["--training.batch_size", "8", "--metrics.val_batches", "2"]
    ref = val_loss(0, 1, make_config(tmp_path, text_corpus, cache_dir, *common))
    cfg = make_config(
        tmp_path, text_corpus, cache_dir, *common, "--parallelism.dp_shard", "1", *layout
    )
    for got in run_ranks(2, val_loss, cfg, tmp_path=tmp_path):
        assert got == pytest.approx(ref, abs=1e-5)
