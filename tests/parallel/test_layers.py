"""Gradient parity of sharded layers against the unsharded module, context-parallel flex
forward parity, and layout validation that fails before any process-group work."""

from __future__ import annotations

import pytest
import torch

from tests.parallel._launch import run_ranks
from tidal.models import Transformer, get_flavor
from tidal.parallel.config import ActivationCheckpointConfig, ParallelismConfig
from tidal.parallel.dims import ParallelDims


def _model(attention="sdpa", **kw):
    m = Transformer(get_flavor("tiny", attention=attention, **kw))
    m.init_weights(seed=3)
    _random_biases(m)
    return m


def _random_biases(model):
    """Non-zero q/k/v biases (init_weights zeroes them), the same values in every layout."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if name.endswith(".bias"):
                full = torch.empty(p.shape).normal_(
                    0.0, 0.5, generator=torch.Generator().manual_seed(i)
                )
                if isinstance(p, DTensor):  # each rank keeps its shard of the same values
                    full = distribute_tensor(full, p.device_mesh, p.placements)
                p.copy_(full)


def _grads(rank, world, layout, model_kw):
    """Backward of one batch through the unsharded model and through `layout`; returns the
    max abs difference of every parameter's gradient (sharded grads made whole)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from tidal.parallel.parallelize import parallelize
    from tidal.train.loss import cross_entropy_sum

    dist.init_process_group("gloo")
    try:
        dims = ParallelDims(world_size=world, **layout)
        mesh = dims.build_mesh("cpu")
        tokens = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
        ref = _model(**model_kw)
        loss = cross_entropy_sum(ref(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()

        with torch.device("meta"):
            sharded = Transformer(get_flavor("tiny", **model_kw))
        cfg = ParallelismConfig(**layout)
        parallelize(
            sharded, mesh, dims, cfg, ActivationCheckpointConfig(), compile=False, param_dtype=None
        )
        sharded.to_empty(device="cpu")
        sharded.init_weights(seed=3)
        _random_biases(sharded)
        dp = dims.dp_shard
        local = tokens[rank % dp :: dp] if dp > 1 else tokens  # FSDP: disjoint rows per rank
        logits = sharded(local[:, :-1])
        if dims.tp > 1:
            with loss_parallel():
                out = torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), local[:, 1:].flatten(), reduction="sum"
                )
                out.backward()
        else:
            # FSDP averages gradients over its ranks: scale the local sum back up.
            (cross_entropy_sum(logits, local[:, 1:]) * dp).backward()
        diffs = {}
        for (name, p_ref), p in zip(ref.named_parameters(), sharded.parameters(), strict=True):
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            diffs[name] = float((g - p_ref.grad).abs().max())
        return diffs
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "layout, model_kw",
    [
        ({"tp": 2, "dp_shard": 1}, {}),
        ({"dp_shard": 2}, {}),
        ({"tp": 2, "dp_shard": 1}, {"qkv_bias": True}),  # Qwen 2: biases sharded with q/k/v
        # Qwen 3: per-head q/k norms on head-sharded inputs, weight gradients summed over tp
        ({"tp": 2, "dp_shard": 1}, {"qk_norm": True}),
    ],
    ids=["tp2", "fsdp2", "tp2_qkv_bias", "tp2_qk_norm"],
)
def test_sharded_gradients_match_unsharded(layout, model_kw, tmp_path):
    for diffs in run_ranks(2, _grads, layout, model_kw, tmp_path=tmp_path):
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < 1e-5, f"{worst}: {diffs[worst]}"
        assert len(diffs) == len(list(_model(**model_kw).parameters()))


def _cp_flex_forward(rank, world):
    """The max abs difference of CP's logits from the unsharded model's, and the messages of
    the FutureWarnings raised meanwhile (a deprecated torch call warns on every gather)."""
    import warnings

    import torch.distributed as dist

    from tidal.parallel.context import ContextParallel

    dist.init_process_group("gloo")
    try:
        mesh = ParallelDims(world_size=world, cp=world, dp_shard=1).build_mesh("cpu")
        model = _model("flex").eval()
        tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
        doc_ids = torch.tensor(
            [[0] * 12 + [1] * 20, [0] * 5 + [1] * 9 + [2] * 18], dtype=torch.int32
        )
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FutureWarning)
            full = model(tokens, document_ids=doc_ids)
            cp = ContextParallel(mesh["cp"], load_balance=True)
            local, local_docs, positions = cp.shard(tokens, doc_ids)
            out = model(
                local,
                positions=positions,
                attention=cp.attention_for(positions, local_docs, "flex"),
            )
        future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        return float((out - full[:, positions]).abs().max()), future
    finally:
        dist.destroy_process_group()


def test_context_parallel_flex_forward_matches(tmp_path):
    # Flex attention has no CPU backward: on CPU, CP with flex is checked forward only.
    for diff, future_warnings in run_ranks(2, _cp_flex_forward, tmp_path=tmp_path):
        assert diff < 1e-5
        assert future_warnings == []  # the gather uses the supported (not deprecated) API


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        ({"tp": 3}, 4, "world size 4 is not divisible by"),
        ({"dp_shard": 3}, 4, "multiply to 3"),
        ({"tp": 8, "dp_shard": 1}, 8, "must divide the query heads (4)"),
        ({"pp": 8, "dp_shard": 1}, 8, "pipeline degree 8 exceeds the 4 layers"),
        ({"cp": 2, "tp": 2, "dp_shard": 1, "seq_len": 36}, 4, "seq_len=36 must be divisible by 8"),
        ({"pp": 2, "dp_shard": 1, "pp_microbatches": 1}, 2, "needs at least pp=2 micro-batches"),
        ({"pp": 2, "dp_shard": 1, "pp_microbatches": 3}, 2, "divisible by the 3 pipeline"),
        (
            {"pp": 2, "dp_shard": 1, "pp_schedule": "Interleaved1F1B", "pp_stages_per_rank": 1},
            2,
            "needs pp_stages_per_rank >= 2",
        ),
        (
            {"pp": 2, "dp_shard": 1, "pp_schedule": "ZBVZeroBubble", "pp_stages_per_rank": 3},
            2,
            "ZBVZeroBubble places exactly 2 stages on each pipeline rank",
        ),
        ({"pp": 2, "dp_shard": 1, "pp_split": "9"}, 2, "pp_split='9' must list 1"),
        (
            {
                "pp": 2,
                "dp_shard": 1,
                "pp_split": "tok_embeddings,layers.0;layers.2,layers.1,norm,output",
            },
            2,
            "must list layers.0 .. layers.3 once each",
        ),
        (
            {
                "pp": 2,
                "dp_shard": 1,
                "pp_split": "layers.0,layers.1;tok_embeddings,layers.2,layers.3,norm,output",
            },
            2,
            "tok_embeddings must be on the first stage",
        ),
        ({"pp": 2, "cp": 2, "dp_shard": 1}, 4, "pipeline and context parallel together"),
        ({"pp": 2, "dp_shard": 1, "attention": "flex"}, 2, "set --model.attention sdpa"),
        (
            {"tp": 2, "dp_shard": 1, "tie_embeddings": True},
            2,
            "tensor parallel needs untied embeddings",
        ),
        (
            {"pp": 2, "dp_shard": 1, "tie_embeddings": True},
            2,
            "pipeline parallel needs untied embeddings",
        ),
        ({"cp": 2, "dp_shard": 1}, 2, None),  # valid
    ],
)
def test_invalid_layouts_fail_before_any_process_group(overrides, world, message):
    import torch.distributed as dist

    from tidal.parallel.dims import check_layout

    overrides = dict(overrides)
    seq_len = overrides.pop("seq_len", 32)
    model = {k: overrides.pop(k) for k in ("attention", "tie_embeddings") if k in overrides}
    cfg, args = ParallelismConfig(**overrides), get_flavor("tiny", **model)

    def check():
        return check_layout(
            cfg, args, world_size=world, seq_len=seq_len, batch_size=4, model_name="tiny"
        )

    if message is None:
        assert check().degrees == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 1}
    else:
        with pytest.raises(ValueError) as e:
            check()
        assert message in str(e.value)
    assert not dist.is_initialized()


def test_trainer_checks_the_layout_with_the_flavor_name():
    from tidal.parallel.launch import DistInfo
    from tidal.train.config_parse import apply_overrides
    from tidal.train.configs import get_config
    from tidal.train.trainer import Trainer

    cfg = apply_overrides(get_config("debug"), ["--parallelism.tp", "3"])
    with pytest.raises(ValueError, match="world size 1 is not divisible by"):
        Trainer(cfg)
    cfg = apply_overrides(
        get_config("debug"), ["--model.flavor", "qwen3_0_6b", "--parallelism.tp", "2"]
    )
    with pytest.raises(ValueError, match="model.flavor 'qwen3_0_6b' ties them"):
        Trainer(cfg, dist_info=DistInfo(world_size=2))


def test_dry_run_large_layout(capsys):
    from tidal.cli import main

    code = main(
        [
            "train",
            "--config",
            "llama3_8b",
            "--dry-run",
            "64",
            "--parallelism.tp",
            "8",
            "--parallelism.pp",
            "2",
            "--parallelism.pp_microbatches",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "pp rank 1 (stages [1]): 125.5M parameters per rank" in out
    assert main(["train", "--config", "llama3_8b", "--dry-run", "64", "--parallelism.tp", "3"]) == 2


@pytest.mark.parametrize(
    "mode, selective", [("full", "op"), ("selective", "op"), ("selective", "2")]
)
def test_activation_checkpointing_changes_no_numbers(mode, selective):
    from tidal.parallel.parallelize import apply_ac
    from tidal.train.loss import cross_entropy_sum

    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    ref, ac = _model(), _model()
    apply_ac(ac, ActivationCheckpointConfig(mode=mode, selective=selective))
    wrapped = sum("_checkpoint_wrapped_module" in n for n, _ in ac.named_parameters())
    assert wrapped > 0
    for m in (ref, ac):
        cross_entropy_sum(m(tokens[:, :-1]), tokens[:, 1:]).backward()
    for (n, p), q in zip(ref.named_parameters(), ac.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n
