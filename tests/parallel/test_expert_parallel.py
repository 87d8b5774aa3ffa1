"""Expert parallelism on CPU ranks (gloo) against one process: EP 2 on 2 ranks, EP 2 x
FSDP 2 and TP 2 x EP 2 on 4 ranks train debug_moe (8 experts, top 2) for 10 steps on the
same global batches as one process; losses, gradient norms and the last step's full
gradients agree to fp32 rounding (the ranks sum the same products in other orders: rows of
an expert come from two ranks, weight gradients are summed by the reverse all-to-all and a
reduce-scatter).

Load balancing is by expert bias with the auxiliary loss left out (coefficient 0), as in
test_moe_parallel.py: each rank's aux loss is of its own tokens, and a mean of per-rank
products is not the product over the whole batch. The bias is updated from the tokens per
expert summed over the ranks, so it matches one process exactly. The learning rate is 1e-3,
not test_parity's 1e-2: at 1e-2 the runs drift apart enough by step 9 that a router top-k
near-tie flips, and the grad norm then differs by 3e-3, for plain FSDP 2 as much as for EP
(measured); at 1e-3 the losses stayed within 5e-7 and the grad norms within 4e-6 over the
10 steps (measured, EP 2).

TP 2 x EP 2 (measured): losses within 5e-7, grad norms within 6e-6 over the 10 steps. It
needed Qwen 3's q/k norms' gradients summed over tp (tp_plan_block's qk_norm; debug_moe has
qk_norm): without that the step-0 norm gradients were off by their own magnitude.

Also: the layout checks (one line before any work) and the dry run's EP report.
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel._launch import run_ranks

from .test_parity import make_config

STEPS = 10
COMMON = [
    "--model.flavor",
    "debug_moe",
    "--model.moe_load_balance",
    "bias",
    "--training.moe_aux_loss_coef",
    "0",
    "--training.steps",
    str(STEPS),
    "--optimizer.lr",
    "1e-3",
]


def ep_run(rank, world, cfg):
    from torch.distributed.tensor import DTensor

    from tidal.models.moe import moe_layers
    from tidal.parallel.launch import DistInfo
    from tidal.train.trainer import Trainer

    info = DistInfo.from_env() if world > 1 else None
    trainer = Trainer(cfg, dist_info=info, log=lambda *a: None)
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.clear()
        for name, p in trainer.model.named_parameters():
            g = p.grad
            grads[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
        return step(*args, **kwargs)

    trainer.optimizer.step = capture  # type: ignore[method-assign]
    try:
        out = []
        for _ in range(STEPS):
            trainer.step += 1
            batches, n_tokens, _ = trainer.next_batches()
            result = trainer.train_step(batches, n_tokens)
            out.append((float(result.loss), float(result.grad_norm)))
        bias = torch.stack([m.expert_bias for m in moe_layers(trainer.model)]).cpu()
        return out, grads, bias
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_corpus, cache_dir):
    tmp = tmp_path_factory.mktemp("ep_ref")
    torch.set_num_threads(1)
    cfg = make_config(tmp, text_corpus, cache_dir, *COMMON, "--training.batch_size", "8")
    return ep_run(0, 1, cfg)


@pytest.mark.parametrize(
    ("world", "extra"),
    [
        (2, ["--parallelism.ep", "2"]),  # EP 2: experts split, everything else FSDP 2
        (4, ["--parallelism.ep", "2"]),  # EP 2 x FSDP 2: experts also FSDP-sharded over 2
        # TP 2 (attention, SP) x EP 2 (of dp_shard 2): the MoE replicated over tp
        (4, ["--parallelism.ep", "2", "--parallelism.tp", "2"]),
    ],
    ids=["ep2", "ep2_fsdp2", "tp2_ep2"],
)
def test_expert_parallel_matches_one_process(
    world, extra, reference, tmp_path, text_corpus, cache_dir
):
    ref_losses, ref_grads, ref_bias = reference
    tp = int(extra[extra.index("--parallelism.tp") + 1]) if "--parallelism.tp" in extra else 1
    batch = str(8 // (world // tp))
    cfg = make_config(
        tmp_path, text_corpus, cache_dir, *COMMON, *extra, "--training.batch_size", batch
    )
    ref = torch.tensor(ref_losses)
    for losses, grads, bias in run_ranks(world, ep_run, cfg, tmp_path=tmp_path):
        torch.testing.assert_close(torch.tensor(losses), ref, atol=2e-5, rtol=1e-5)
        assert sorted(grads) == sorted(ref_grads)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-6, rtol=1e-4, msg=name)
        assert torch.equal(bias, ref_bias)


@pytest.mark.parametrize(
    ("flavor", "overrides", "world", "message"),
    [
        ("tiny", {"ep": 2}, 2, "parallelism.ep=2 needs a mixture-of-experts model; tiny is dense"),
        ("debug_moe", {"ep": 3}, 3, "parallelism.ep=3 must divide the 8 experts of debug_moe"),
        ("debug_moe", {"ep": 4}, 6, "parallelism.ep=4 must divide the world size 6"),
        ("debug_moe", {"ep": 2, "dp_shard": 1, "cp": 2}, 2, "not with parallelism.cp=2"),
        ("debug_moe", {"ep": 2, "dp_shard": 2, "dp_replicate": 2}, 4, "not with parallelism.dp_re"),
        ("debug_moe", {"ep": 2, "dp_shard": 1, "tp": 2}, 2, "must divide dp_shard = world size"),
        ("debug_moe", {"ep": 2, "dp_shard": 2}, 4, "parallel degrees multiply to 2"),
        ("debug_moe", {"ep": 2}, 4, None),  # valid: ep 2 x dp_shard_mod_ep 2
    ],
)
def test_bad_ep_fails_before_any_process_group(flavor, overrides, world, message):
    import torch.distributed as dist

    from tidal.models.flavors import get_flavor
    from tidal.parallel.config import ParallelismConfig
    from tidal.parallel.dims import check_layout

    cfg, args = ParallelismConfig(**overrides), get_flavor(flavor)

    def check():
        return check_layout(
            cfg, args, world_size=world, seq_len=32, batch_size=4, model_name=flavor
        )

    if message is None:
        dims = check()
        assert (dims.dp_shard, dims.ep, dims.dp_shard_mod_ep) == (4, 2, 2)
    else:
        with pytest.raises(ValueError) as e:
            check()
        assert message in str(e.value) and "\n" not in str(e.value)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="parallelism.ep must be >= 1, got 0"):
        ParallelismConfig(ep=0)


def test_dry_run_reports_the_ep_layout(capsys):
    from tidal.cli import main

    argv = ["train", "--config", "debug", "--model.flavor", "qwen3_moe_1b", "--dry-run", "8"]
    assert main([*argv, "--parallelism.ep", "4"]) == 0
    out = capsys.readouterr().out
    assert "ep=4 (of dp_shard)" in out, out
    assert "16 of 64 experts per rank (ep=4), FSDP-sharded over dp_shard/ep=2 ranks" in out
    # 12 layers x 64 experts x 3 x 1024 x 256 expert weights, split over the 8 ranks.
    assert "(75.5M of them routed experts)" in out, out
    assert main([*argv, "--parallelism.ep", "3"]) == 2
    # TP 2 x EP 2 (of dp_shard 4): the experts are replicated over tp, so twice as many per rank.
    assert main([*argv, "--parallelism.ep", "2", "--parallelism.tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "tp=2, ep=2 (of dp_shard)" in out, out
    assert "attention TP-sharded over tp=2, the MoE (router, experts, shared experts)" in out
    assert "(151.0M of them routed experts)" in out, out


CKPT_MOE = [
    "--model.flavor",
    "debug_moe",
    "--model.moe_load_balance",
    "bias",
    "--training.moe_aux_loss_coef",
    "0",
    "--checkpoint.interval",
    "2",
    "--training.steps",
    "4",
]


def test_ep_checkpoint_loads_into_fsdp_and_one_process(tmp_path):
    """2 ranks with EP 2 train 4 steps, saving at steps 2 and 4; the step-2 checkpoint (experts
    as DTensor shards over ep and the rest over FSDP) resumes to step 4 on 2 FSDP-only ranks
    and in one process: their steps 3 and 4 match the EP run's (fp32 rounding)."""
    import shutil

    from tests.parallel.test_checkpoint_parallel import _train_runs
    from tests.train.test_checkpoint import random_data, run_config, step_records
    from tidal.train.trainer import Trainer

    outs = {name: tmp_path / name for name in ("ep2", "fsdp2", "one_process")}
    ep2 = [*CKPT_MOE, "--parallelism.ep", "2"]
    run_ranks(2, _train_runs, [(str(outs["ep2"]), ep2, 2, None)], tmp_path=tmp_path)
    saved = sorted(p.name for p in (outs["ep2"] / "checkpoint").iterdir())
    assert saved == ["step-2", "step-4"], saved
    for name in ("fsdp2", "one_process"):
        src = outs["ep2"] / "checkpoint" / "step-2"
        shutil.copytree(src, outs[name] / "checkpoint" / "step-2")
    fsdp = [*CKPT_MOE, "--parallelism.dp_shard", "2"]
    run_ranks(2, _train_runs, [(str(outs["fsdp2"]), fsdp, 2, None)], tmp_path=tmp_path)
    torch.set_num_threads(1)
    trainer = Trainer(
        run_config(outs["one_process"], *CKPT_MOE, steps=4),
        data=random_data(),
        log=lambda *a: None,
    )
    trainer.train()
    trainer.close()
    ref = step_records(outs["ep2"])
    for name in ("fsdp2", "one_process"):
        got = step_records(outs[name])
        assert sorted(got) == [3, 4], (name, got)
        want = torch.tensor([ref[s] for s in (3, 4)], dtype=torch.float64)
        have = torch.tensor([got[s] for s in (3, 4)], dtype=torch.float64)
        torch.testing.assert_close(have, want, atol=2e-5, rtol=0, msg=name)


def _shared_expert_grads(rank, world, layout):
    """One backward of debug_moe with a shared expert (2 layers) in one process and under
    `layout` (TP 2 x EP 2, FSDP over dp_shard); returns the max abs difference of every parameter's
    gradient (sharded ones made whole)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from tidal.models import Transformer, get_flavor
    from tidal.models.moe import MoEArgs
    from tidal.parallel.config import ActivationCheckpointConfig, ParallelismConfig
    from tidal.parallel.dims import ParallelDims
    from tidal.parallel.parallelize import parallelize
    from tidal.train.loss import cross_entropy_sum

    dist.init_process_group("gloo")
    try:
        moe = MoEArgs(n_experts=8, top_k=2, ffn_dim=64, n_shared_experts=1)
        args = get_flavor("debug_moe", n_layers=2, moe=moe)
        tokens = torch.randint(0, 4096, (4, 33), generator=torch.Generator().manual_seed(0))
        ref = Transformer(args)
        ref.init_weights(seed=3)
        cross_entropy_sum(ref(tokens[:, :-1]), tokens[:, 1:]).backward()

        dims = ParallelDims(world_size=world, **layout)
        with torch.device("meta"):
            sharded = Transformer(args)
        parallelize(
            sharded,
            dims.build_mesh("cpu"),
            dims,
            ParallelismConfig(**layout),
            ActivationCheckpointConfig(),
            compile=False,
            param_dtype=None,
        )
        sharded.to_empty(device="cpu")
        sharded.init_weights(seed=3)
        dp_rank = rank // dims.tp  # mesh (dp_shard_mod_ep, ep, cp, tp): TP peers adjacent
        local = tokens[dp_rank :: dims.dp_shard]
        with loss_parallel():
            out = torch.nn.functional.cross_entropy(
                sharded(local[:, :-1]).flatten(0, 1), local[:, 1:].flatten(), reduction="sum"
            )
            # Gradients end up averaged over the data-parallel ranks: scale the sum back up.
            (out * dims.dp_shard).backward()
        diffs = {}
        for (name, p_ref), p in zip(ref.named_parameters(), sharded.parameters(), strict=True):
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            diffs[name] = float((g - p_ref.grad).abs().max())
        return diffs
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "layout",
    [
        {"dp_shard": 2, "tp": 2, "ep": 2},  # 4 ranks: experts whole per EP rank
        {"dp_shard": 4, "tp": 2, "ep": 2},  # 8 ranks: experts also FSDP-sharded over 2
    ],
    ids=["tp2_ep2", "tp2_ep2_fsdp2"],
)
def test_tp_ep_shared_expert_gradients_match_one_process(layout, tmp_path):
    """TP 2 x EP 2 with a shared expert: the router's, shared expert's and experts' gradients
    (replicated over tp, not summed there) equal one process's, as do attention's."""
    world = layout["dp_shard"] * layout["tp"]
    for diffs in run_ranks(world, _shared_expert_grads, layout, tmp_path=tmp_path):
        assert any("shared_experts" in name for name in diffs)
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < 1e-5, f"{worst}: {diffs[worst]}"


def test_moe_with_tp_needs_ep(tmp_path):
    """An MoE model with tp > 1 runs only beside expert parallel (one line, no process group);
    TP 2 x EP 2 passes the same check."""
    from tidal.models.flavors import get_flavor
    from tidal.train.config_parse import apply_overrides
    from tidal.train.configs import get_config
    from tidal.train.job import check_job

    base = ["--job.output_dir", str(tmp_path), "--model.flavor", "debug_moe"]
    for extra, message in [
        (["--parallelism.tp", "2"], "not with parallelism.tp=2 / parallelism.pp=1 without"),
        (["--parallelism.tp", "2", "--parallelism.ep", "2"], None),
    ]:
        cfg = apply_overrides(get_config("debug"), [*base, *extra])
        args = get_flavor("debug_moe")

        def check(cfg=cfg, args=args):
            return check_job(cfg, args, world_size=4, device=torch.device("cpu"), data=False)

        if message is None:
            dims = check()
            assert (dims.tp, dims.ep, dims.dp_shard) == (2, 2, 2)
        else:
            with pytest.raises(ValueError, match=message):
                check()
