"""Float8 training (`quantize.float8`, tidal/train/float8.py) on CPU through torchao's emulated
path: which layers are converted, training against the unquantized model, FSDP's float8
all-gather and tensor parallel on gloo, and the errors. CUDA-only checks are marked `gpu`."""

from __future__ import annotations

import importlib.util
import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.parallel._launch import run_ranks
from tidal.models import Transformer, get_flavor
from tidal.train.config import QuantizeConfig
from tidal.train.config_parse import apply_overrides
from tidal.train.configs import get_config
from tidal.train.data import DataBundle, PackedLoader
from tidal.train.float8 import check_float8, convert, selected_linears

needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None,
    reason="needs torchao (pip install torchao==0.18.0; `make setup` installs it)",
)

STEPS = 12
VOCAB = 512


def meta_model(**overrides) -> Transformer:
    with torch.device("meta"):
        return Transformer(get_flavor("tiny", **overrides))


def markov_tokens(n: int, successors: int = 4) -> np.ndarray:
    """A learnable stream (as benchmarks/multi_gpu.py's): each token has 4 fixed successors."""
    rng = np.random.default_rng(0)
    table = rng.integers(0, VOCAB, (VOCAB, successors))
    choice = rng.integers(0, successors, n)
    out = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        out[i] = table[out[i - 1], choice[i]]
    return out


def make_config(tmp_path, *extra):
    return apply_overrides(
        get_config("debug"),
        [
            "--job.output_dir",
            str(tmp_path / "out"),
            "--job.device",
            "cpu",
            "--model.flavor",
            "tiny",
            "--training.steps",
            str(STEPS),
            "--training.batch_size",
            "8",
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


def data_for(global_batch: int = 8):
    tokens = markov_tokens((STEPS + 2) * global_batch * 32 + 1)

    def data(dp_rank: int, dp_world: int) -> DataBundle:
        loader = PackedLoader(
            tokens,
            np.array([0]),
            seq_len=32,
            batch_size=global_batch // dp_world,
            seed=0,
            dp_rank=dp_rank,
            dp_world=dp_world,
        )
        tok = SimpleNamespace(vocab_size=VOCAB, bos_id=0, eos_id=1)
        return DataBundle(tokenizer=tok, train=loader, val=None)

    return data


def train_losses(rank, world, cfg):
    from tidal.parallel.launch import DistInfo
    from tidal.train.trainer import Trainer

    trainer = Trainer(cfg, data=data_for(), dist_info=DistInfo.from_env(), log=lambda *a: None)
    try:
        losses = []
        for _ in range(STEPS):
            trainer.step += 1
            batches, n_tokens, _ = trainer.next_batches()
            losses.append(float(trainer.train_step(batches, n_tokens).loss))
        layers = trainer.model.layers["0"]
        kinds = {
            "wq": type(layers.attention.wq).__name__,
            "wk": type(layers.attention.wk).__name__,
            "weight": type(getattr(layers.attention.wq.weight, "_local_tensor", None)).__name__,
            "float8": trainer.float8.describe() if trainer.float8 else None,
        }
        return losses, kinds
    finally:
        trainer.close()


# -- config and layer selection --------------------------------------------------------------


def test_config_refuses_unknown_recipe_and_rowwise_all_gather(tmp_path):
    with pytest.raises(ValueError, match="quantize.float8: 'fp8' is not one of none, tensorwise"):
        make_config(tmp_path, "--quantize.float8", "fp8")
    with pytest.raises(ValueError, match="quantize.float8 must be one of none, tensorwise"):
        QuantizeConfig(float8="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="float8_fsdp_all_gather=true needs quantize.float8="):
        make_config(
            tmp_path, "--quantize.float8", "rowwise", "--quantize.float8_fsdp_all_gather", "true"
        )
    with pytest.raises(ValueError, match="float8_min_dim must be >= 0"):
        QuantizeConfig(float8="tensorwise", float8_min_dim=-1)
    cfg = make_config(tmp_path, "--quantize.float8", "rowwise")
    assert cfg.quantize.float8 == "rowwise" and cfg.quantize.float8_fsdp_all_gather is None


@needs_torchao
def test_filter_picks_layers_by_size_divisibility_name_and_output():
    # tiny: dim 64, 4 heads of 16 (wq, wo 64x64), 2 KV heads (wk, wv 64 -> 32), FFN 192,
    # vocab 512 (output 64 -> 512).
    model = meta_model()
    cfg = QuantizeConfig(float8="tensorwise")
    block = {
        "attention.wq",
        "attention.wo",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    }
    want = {f"layers.{i}.{n}" for i in range(4) for n in block}
    assert set(selected_linears(model, cfg)) == want  # wk, wv (32 < 64) and output left out

    cfg = QuantizeConfig(float8="tensorwise", float8_min_dim=16, float8_output=True)
    got = set(selected_linears(model, cfg))
    assert "output" in got and "layers.3.attention.wk" in got and len(got) == 4 * 7 + 1

    # An FFN of 200 (not a multiple of 16) keeps w1, w2, w3 in high precision whatever the size.
    odd = meta_model(ffn_dim=200)
    got = set(selected_linears(odd, QuantizeConfig(float8="rowwise", float8_min_dim=0)))
    assert not any("feed_forward" in n for n in got) and "layers.0.attention.wq" in got

    cfg = QuantizeConfig(float8="tensorwise", float8_skip="layers.1, layers.2.feed_forward")
    got = set(selected_linears(model, cfg))
    assert not any(n.startswith("layers.1.") for n in got)
    assert "layers.2.attention.wq" in got and "layers.2.feed_forward.w1" not in got
    assert "layers.0.feed_forward.w1" in got


@needs_torchao
def test_convert_swaps_modules_and_keeps_state_dict_keys():
    from torchao.float8.float8_linear import Float8Linear

    model = meta_model()
    keys = list(model.state_dict())
    cfg = QuantizeConfig(float8="tensorwise")
    state = convert(model, cfg, device=torch.device("cpu"), fsdp=False)
    assert state is not None and state.emulate and not state.fsdp_all_gather
    assert state.converted == [selected_linears(meta_model(), cfg)]
    assert isinstance(model.layers["2"].feed_forward.w2, Float8Linear)
    assert not isinstance(model.layers["2"].attention.wk, Float8Linear)
    assert not isinstance(model.output, Float8Linear)
    assert list(model.state_dict()) == keys  # checkpoints and HF export see the same names
    with pytest.raises(ValueError, match="already holds Float8Linear"):
        convert(model, cfg, device=torch.device("cpu"), fsdp=False)
    assert convert(meta_model(), QuantizeConfig(), device=torch.device("cpu"), fsdp=False) is None

    notes: list[str] = []
    none = convert(
        meta_model(),
        QuantizeConfig(float8="rowwise", float8_min_dim=4096),
        device=torch.device("cpu"),
        fsdp=True,
        log=notes.append,
    )
    assert none is not None and none.converted == [[]] and "nothing converted" in notes[0]
    cfg = QuantizeConfig(float8="tensorwise", float8_fsdp_all_gather=True)
    state = convert(meta_model(), cfg, device=torch.device("cpu"), fsdp=False, log=notes.append)
    assert state is not None and not state.fsdp_all_gather
    assert "float8_fsdp_all_gather is ignored" in notes[-1]


@needs_torchao
def test_float8_tp_plan_swaps_styles_of_float8_layers_only():
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from tidal.parallel.parallelize import float8_tp_plan, tp_plan_block

    model = meta_model()  # wk, wv stay high precision at the default min dim
    convert(model, QuantizeConfig(float8="tensorwise"), device=torch.device("cpu"), fsdp=False)
    plan = float8_tp_plan(model.layers["0"], tp_plan_block())
    assert type(plan["attention.wq"]) is Float8ColwiseParallel
    assert type(plan["attention.wk"]) is ColwiseParallel
    assert type(plan["attention.wo"]) is Float8RowwiseParallel
    assert type(plan["feed_forward.w1"]) is Float8ColwiseParallel
    # attention's input also feeds wk and wv (plain): it stays a plain PrepareModuleInput.
    assert type(plan["attention"]) is PrepareModuleInput
    assert type(plan["feed_forward"]) is PrepareFloat8ModuleInput
    assert plan["attention.wo"].output_layouts == tp_plan_block()["attention.wo"].output_layouts


@needs_torchao
@pytest.mark.parametrize("min_dim", [16, 64], ids=["all_float8", "kv_in_high_precision"])
def test_float8_tp_styles_apply_and_run_on_a_fake_process_group(min_dim):
    """torchao's float8 TP styles (CUDA only in training: gloo has no float8 dtype) applied to
    a real mesh of 2 fake ranks, then forward and backward: the plan's names, layouts and
    submodule references hold (values are meaningless: fake collectives move no data)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tidal.parallel.parallelize import apply_tp

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = meta_model()
        cfg = QuantizeConfig(float8="tensorwise", float8_min_dim=min_dim)
        convert(model, cfg, device=torch.device("cpu"), fsdp=False)
        apply_tp(model, init_device_mesh("cpu", (2,)), loss_parallel=False, float8=True)
        model.to_empty(device="cpu")
        model.init_weights()
        logits = model(torch.randint(0, VOCAB, (2, 32)))
        logits.float().sum().backward()
        assert logits.shape == (2, 32, VOCAB)
        wq = model.layers["0"].attention.wq.weight
        assert wq.grad is not None and wq.grad.to_local().shape == (32, 64)  # heads split
    finally:
        dist.destroy_process_group()


# -- training ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """train_losses on one process, by float8 recipe ("" for none): each trained once for the
    module (the tensorwise run is the reference of several tests)."""
    runs: dict[str, tuple] = {}

    def losses(recipe: str = "") -> tuple:
        if recipe not in runs:
            extra = ["--quantize.float8", recipe] if recipe else []
            folder = tmp_path_factory.mktemp(f"one_process_{recipe or 'ref'}")
            runs[recipe] = train_losses(0, 1, make_config(folder, *extra))
        return runs[recipe]

    return losses


@needs_torchao
def test_emulated_float8_trains_close_to_the_unquantized_model(one_process):
    ref, _ = one_process()
    for recipe in ("tensorwise", "rowwise"):
        got, kinds = one_process(recipe)
        assert kinds["wq"] == "Float8Linear" and kinds["wk"] == "Linear"
        assert all(math.isfinite(x) for x in got)
        assert got[-1] < got[0] - 0.3, (recipe, got)  # it learns
        gap = max(abs(a - b) / b for a, b in zip(got, ref, strict=True))
        assert gap < 0.02, (recipe, gap, got, ref)  # within 2% of fp32 at every step
        assert got != ref  # the casts ran: float8 rounding changes the numbers


@pytest.mark.slow
@needs_torchao
def test_compiled_float8_matches_eager_float8_on_cpu(tmp_path):
    """Conversion before compile: the float8 casts are traced into each block's graph and
    the losses are eager float8's (inductor reorders sums; about 90 s on 2 cores)."""
    eager, _ = train_losses(0, 1, make_config(tmp_path / "e", "--quantize.float8", "tensorwise"))
    compiled, kinds = train_losses(
        0,
        1,
        make_config(
            tmp_path / "c", "--quantize.float8", "tensorwise", "--training.compile", "true"
        ),
    )
    assert kinds["wq"] == "Float8Linear"
    np.testing.assert_allclose(compiled, eager, rtol=2e-3)


@needs_torchao
@pytest.mark.parametrize(
    "layout",
    [
        ["--parallelism.dp_shard", "2", "--training.batch_size", "4"],
        ["--parallelism.tp", "2", "--parallelism.dp_shard", "1"],
    ],
    ids=["fsdp2_float8_all_gather", "tp2"],
)
def test_float8_on_two_ranks_matches_one_process(tmp_path, layout, one_process):
    ref, _ = one_process("tensorwise")
    cfg = make_config(tmp_path / "par", "--quantize.float8", "tensorwise", *layout)
    (losses, kinds), _ = run_ranks(2, train_losses, cfg, tmp_path=tmp_path)
    if layout[0] == "--parallelism.dp_shard":
        assert kinds["weight"] == "WeightWithDynamicFloat8CastTensor"  # float8 all-gather
        assert "FSDP all-gather in float8" in kinds["float8"]
    assert kinds["wq"] == "Float8Linear"
    # Sharded sums round in another order, and a float8 cast can flip one rounding step.
    np.testing.assert_allclose(losses, ref, rtol=2e-3)


def train_run(rank, world, cfg):
    """Trainer.train() as a job runs it: (the step it started from, the last loss)."""
    from tidal.parallel.launch import DistInfo
    from tidal.train.trainer import Trainer

    trainer = Trainer(cfg, data=data_for(), dist_info=DistInfo.from_env(), log=lambda *a: None)
    try:
        start = trainer.step
        return start, trainer.train()["loss"]
    finally:
        trainer.close()


LOAD_WITHOUT_TORCHAO = """
import sys
sys.modules["torchao"] = None  # the reader of a checkpoint need not have torchao
import torch, torch.distributed.checkpoint as dcp
path = sys.argv[1]
md = dcp.FileSystemReader(path).read_metadata()
sd = {k: torch.empty(m.size, dtype=m.properties.dtype)
      for k, m in md.state_dict_metadata.items()
      if hasattr(m, "size") and (k.endswith("weight") or ".exp_avg" in k)}
dcp.load(sd, checkpoint_id=path, no_dist=True)
assert all(type(v) is torch.Tensor and torch.isfinite(v).all() for v in sd.values())
print("loaded", len(sd))
"""


@needs_torchao
def test_fsdp_float8_checkpoints_are_plain_and_resume(tmp_path):
    """Under FSDP's float8 all-gather the weights (and AdamW states made like them) are
    torchao tensor subclasses; checkpoints hold them as plain fp32 tensors, which a process
    without torchao reads, and a float8 run resumes from them."""
    import subprocess

    ckpt = [
        "--quantize.float8",
        "tensorwise",
        "--parallelism.dp_shard",
        "2",
        "--training.batch_size",
        "4",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "3",
        "--metrics.log_every",
        "3",
    ]
    first = run_ranks(
        2, train_run, make_config(tmp_path, *ckpt, "--training.steps", "3"), tmp_path=tmp_path
    )
    step3 = tmp_path / "out" / "checkpoint" / "step-3"
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_TORCHAO, str(step3)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-3000:]
    resumed = run_ranks(
        2, train_run, make_config(tmp_path, *ckpt, "--training.steps", "6"), tmp_path=tmp_path
    )
    assert first[0][0] == 0 and resumed[0][0] == 3  # resumed at step 3
    assert math.isfinite(resumed[0][1]) and resumed[0][1] < first[0][1]


# -- errors -----------------------------------------------------------------------------------


def test_missing_torchao_stops_the_job_naming_the_install(tmp_path, monkeypatch):
    from tidal.train.trainer import Trainer

    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao...` raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    cfg = make_config(tmp_path, "--quantize.float8", "tensorwise")
    with pytest.raises(ImportError, match=r"needs torchao.*pip install torchao==0\.18\.0"):
        Trainer(cfg, data=data_for())
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    Trainer(make_config(tmp_path / "off"), data=data_for()).close()  # float8 off: no torchao


@needs_torchao
def test_old_gpus_and_batch_invariant_are_refused(monkeypatch):
    cfg = QuantizeConfig(float8="tensorwise")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability 8\.9 or newer.*A100 is 8\.0"):
        check_float8(cfg, torch.device("cuda", 0), batch_invariant=False)
    with pytest.raises(ValueError, match="batch_invariant"):
        check_float8(cfg, torch.device("cpu"), batch_invariant=True)
    check_float8(QuantizeConfig(), torch.device("cuda", 0), batch_invariant=True)  # off: no check


# -- CUDA ---------------------------------------------------------------------------------------


def _float8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@needs_torchao
@pytest.mark.skipif(not _float8_gpu(), reason="needs a GPU with float8 (compute capability 8.9+)")
def test_compiled_float8_on_gpu_tracks_bf16(tmp_path):
    base = [
        "--job.device",
        "cuda",
        "--training.mixed_precision",
        "bf16",
        "--training.compile",
        "true",
        "--quantize.float8_min_dim",
        "16",
    ]
    ref, _ = train_losses(0, 1, make_config(tmp_path / "bf16", *base))
    for recipe in ("tensorwise", "rowwise"):
        got, kinds = train_losses(
            0, 1, make_config(tmp_path / recipe, *base, "--quantize.float8", recipe)
        )
        assert kinds["wq"] == "Float8Linear" and "emulated" not in kinds["float8"]
        assert all(math.isfinite(x) for x in got)
        assert max(abs(a - b) / b for a, b in zip(got, ref, strict=True)) < 0.03, (got, ref)


@pytest.mark.gpu
@needs_torchao
@pytest.mark.skipif(
    not _float8_gpu() or torch.cuda.device_count() < 2, reason="needs 2 GPUs with float8"
)
@pytest.mark.parametrize(
    "layout",
    [
        ["--parallelism.tp", "2", "--parallelism.dp_shard", "1"],
        ["--parallelism.dp_shard", "2", "--training.batch_size", "4"],
    ],
    ids=["tp2_float8_styles", "fsdp2_float8_all_gather"],
)
def test_float8_on_two_gpus_matches_one(tmp_path, layout):
    """NCCL moves float8: TP's float8 styles all-gather float8 activations, FSDP float8
    weights; losses match one GPU's float8 run."""
    base = [
        "--job.device",
        "cuda",
        "--training.mixed_precision",
        "bf16",
        "--quantize.float8",
        "tensorwise",
        "--quantize.float8_min_dim",
        "16",
    ]
    ref, _ = train_losses(0, 1, make_config(tmp_path / "one", *base))
    (losses, kinds), _ = run_ranks(
        2, train_losses, make_config(tmp_path / "two", *base, *layout), tmp_path=tmp_path
    )
    assert kinds["wq"] == "Float8Linear"
    np.testing.assert_allclose(losses, ref, rtol=2e-2)
