"""benchmarks/train_throughput.py on a mixture of experts: tidal's side on CPU (debug_moe, tiny
shapes: a measured run and the --profile-moe breakdown), and torchtitan's Qwen 3 MoE flavor
built from tidal's qwen3_moe_1b at the same shape (fields, parameters, FLOPs per token)."""

from __future__ import annotations

import importlib.util
import math
import tempfile
from pathlib import Path

import pytest

from tidal.models.moe import MOE_SPANS, moe_layers

BENCH = Path(__file__).parents[2] / "benchmarks"
TINY = ["--device", "cpu", "--flavor", "debug_moe", "--batch", "2", "--seq", "32"]
TINY += ["--steps", "2", "--warmup", "1", "--log-every", "1", "--modes", "eager"]
TINY += ["--profile-steps", "1"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


@pytest.fixture
def bench(monkeypatch, tmp_path):
    """train_throughput as a module, its siblings importable, its run folders in tmp_path."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return _load("train_throughput")


def test_tidal_moe_run_and_profile_breakdown_on_cpu(bench):
    from moe_profile import CATEGORIES, profile_steps, table

    args = bench.parse_args(TINY)
    result = bench.run_tidal(args, "eager")
    assert result["tokens_per_s"] > 0 and math.isfinite(result["final_loss"])
    assert result["moe_load_max"] >= 1.0  # the busiest expert's load over the mean
    assert result["mfu"] is None  # no peak FLOP/s on CPU

    trainer, _, _ = bench.build_trainer(args, "eager")
    try:
        # torchtitan has no auxiliary loss: the benchmark balances by the expert bias
        assert all(m.expert_bias is not None for m in moe_layers(trainer.model))
        times = profile_steps(trainer, warmup=1, steps=1)
    finally:
        trainer.close()
    assert list(times) == list(CATEGORIES)
    for part in ("router", "dispatch/combine", "expert GEMMs", "expert SwiGLU", "attention"):
        assert times[part] > 0, (part, times)
    assert times["shared experts"] == 0  # debug_moe has none
    text = table(times, 1, "cpu")
    assert "CPU operator time" in text and all(c in text for c in CATEGORIES)
    assert "= MoE layers" in text


def test_aux_loss_override_and_flag_handling(bench):
    args = bench.parse_args(TINY + ["--set", "model.moe_load_balance=aux_loss"])
    assert bench.moe_load_balance(args) == "aux_loss"
    assert bench.moe_load_balance(bench.parse_args(TINY)) == "bias"
    argv = ["--flavor", "qwen3_moe_1b", "--torchtitan", "x", "--torchtitan-timeout", "9"]
    assert bench.worker_args(argv + ["--profile-moe"]) == [
        "--flavor",
        "qwen3_moe_1b",
        "--profile-moe",
    ]
    with pytest.raises(SystemExit):  # float8 is compared for dense flavors only
        bench.parse_args(["--flavor", "qwen3_moe_1b", "--torchtitan", "x", "--float8", "rowwise"])


def test_profile_categories_follow_the_moe_ranges():
    m = _load("moe_profile")
    assert set(m.SPAN_CATEGORY) == set(MOE_SPANS)  # every range of MoE.forward is classified
    assert m.category("aten::_grouped_mm", "moe.experts", []) == "expert GEMMs"
    assert m.category("aten::mm", "moe.experts", []) == "expert GEMMs"
    assert m.category("aten::silu", "moe.experts", []) == "expert SwiGLU"
    assert m.category("aten::copy_", "moe.experts", ["aten::_to_copy"]) == "expert casts"
    assert m.category("aten::index_copy", "moe.experts", []) == "dispatch/combine"  # padding
    assert m.category("nccl:all_to_all", "moe.experts", []) == "dispatch/combine"
    bwd = "autograd::engine::evaluate_function: GroupedMmBackward0"
    assert m.category("aten::clone", "moe.experts", ["aten::contiguous", bwd]) == "expert GEMMs"
    assert m.category("aten::topk", "moe.router", []) == "router"
    assert m.category("aten::index_copy", "moe.combine", []) == "dispatch/combine"
    assert m.category("aten::mm", None, ["aten::linear"]) == "other"
    flash = "aten::_scaled_dot_product_flash_attention"
    assert m.category("aten::empty", None, [flash]) == "attention"
    assert m.category("aten::_foreach_mul_", None, ["Optimizer.step#AdamW.step"]) == "optimizer"


@pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None, reason="needs torchtitan (0.2.2) importable"
)
@pytest.mark.parametrize("flavor", ["qwen3_moe_1b", "debug_moe"])
def test_torchtitan_flavor_has_tidal_shapes(flavor):
    t = _load("torchtitan_moe")
    rows = t.field_rows(flavor)
    assert all(same for *_, same in rows), [r for r in rows if not r[3]]
    c = t.counts(flavor, seq_len=4096)
    assert c["tidal_params"] == c["torchtitan_params"] == c["torchtitan_params_reported"]
    assert c["tidal_active"] == c["torchtitan_active"] < c["tidal_params"]
    assert c["tidal_flops_per_token"] == c["torchtitan_flops_per_token"]
    if flavor == "qwen3_moe_1b":
        assert c["tidal_params"] == 978_874_368 and c["tidal_active"] == 450_392_064
    text = t.compare(flavor, 4096)
    assert "!=" not in text and "behaviours that differ" in text
    # tidal's auxiliary loss has no torchtitan counterpart: shown as a difference
    aux = {name: same for name, _, _, same in t.field_rows(flavor, "aux_loss")}
    assert aux["auxiliary loss"] is False and aux["expert-bias rate (None: off)"] is True


@pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None, reason="needs torchtitan (0.2.2) importable"
)
def test_torchtitan_launcher_registers_tidal_flavors():
    from torchtitan.models.qwen3 import qwen3_args
    from torchtitan.protocols.train_spec import get_train_spec

    t = _load("torchtitan_moe")
    names = t.register()
    try:
        assert "tidal_qwen3_moe_1b" in names
        assert get_train_spec("qwen3").model_args["tidal_qwen3_moe_1b"].moe_args.top_k == 8
    finally:
        for name in names:
            qwen3_args.pop(name, None)
