"""torchtitan's DCP checkpoints, both ways, against torchtitan 0.2.2's own code: its Llama 3
and Qwen 3 models and its CheckpointManager write the checkpoints tidal reads (a training save
and the model-only last save), and load the ones tidal writes. Logits agree within 1e-5 in
fp32 (tidal/train/checkpoint/torchtitan.py; docs/checkpoint.md).

`make setup` installs torchtitan==0.2.2 (Makefile); without it these tests skip.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.train.test_checkpoint import VOCAB, random_data, run_config
from tidal.cli import main
from tidal.models import Transformer, get_flavor, load_hf
from tidal.models.flavors import LLAMA31_SCALING
from tidal.models.transformer import ModelArgs
from tidal.train.checkpoint import CheckpointError, model_info, save_model
from tidal.train.checkpoint.hf import dcp_to_dcp, dcp_to_hf, read_model
from tidal.train.trainer import Trainer

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip(
        "torchtitan is not installed (`make setup` installs torchtitan==0.2.2)",
        allow_module_level=True,
    )

# Imported only when installed; an import that fails then (e.g. triton missing) is an error.
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.lr_scheduler import build_lr_schedulers  # noqa: E402
from torchtitan.components.optimizer import build_optimizers  # noqa: E402
from torchtitan.config import JobConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.models.llama3 import Transformer as TitanLlama  # noqa: E402
from torchtitan.models.llama3 import TransformerModelArgs  # noqa: E402
from torchtitan.models.llama3.model.args import RoPEScalingArgs  # noqa: E402
from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs  # noqa: E402

TOL = 1e-5
QUIET = {"log": lambda _: None}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -- torchtitan's side ----------------------------------------------------------------------


def titan_llama_args(scaling: float = 8.0) -> TransformerModelArgs:
    """torchtitan's Llama 3 of tidal's `tiny` shape (SwiGLU width 192 = multiple_of 64 of
    2/3 * 4 * 64); torchtitan always applies Llama 3.1 RoPE scaling, factor 8 by default (1
    leaves the frequencies as tidal's unscaled `tiny`)."""
    return TransformerModelArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=VOCAB,
        multiple_of=64,
        rope_theta=10_000,
        rope_scaling_args=RoPEScalingArgs(scaling_factor=scaling),
        max_seq_len=64,
    )


def tidal_llama_args(scaling: float = 8.0) -> ModelArgs:
    args = get_flavor("tiny", vocab_size=VOCAB)
    assert scaling in (1.0, 8.0)
    return dataclasses.replace(args, rope_scaling=LLAMA31_SCALING if scaling == 8.0 else None)


TITAN_QWEN3 = Qwen3ModelArgs(
    dim=256,
    n_layers=4,
    n_heads=8,
    n_kv_heads=4,
    head_dim=48,
    hidden_dim=768,
    vocab_size=4096,
    norm_eps=1e-6,
    rope_theta=10_000,
    qk_norm=True,
    enable_weight_tying=True,
    max_seq_len=64,
)
"""torchtitan's Qwen 3 of tidal's `debug_qwen3` shape (tied embeddings)."""


def titan_model(args: Any, seed: int | None = 0) -> torch.nn.Module:
    """torchtitan's model, its own init, then every parameter (norms too) moved by noise so
    that a swapped or misplaced tensor changes the logits; seed None keeps the init."""
    cls = Qwen3Model if isinstance(args, Qwen3ModelArgs) else TitanLlama
    with torch.device("meta"):
        model = cls(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        torch.manual_seed(0 if seed is None else seed)  # torchtitan's init draws from it
        model.init_weights(buffer_device=torch.device("cpu"))
        if seed is not None:
            g = torch.Generator().manual_seed(seed)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def titan_manager(model: torch.nn.Module, base: Path, **checkpoint: Any) -> CheckpointManager:
    """torchtitan's CheckpointManager as its trainer builds it (one process, AdamW, the
    warmup schedule); keep_latest_k 0 needs no process group."""
    job = JobConfig()
    fields = {"enable": True, "interval": 1, "keep_latest_k": 0} | checkpoint
    for name, value in fields.items():
        setattr(job.checkpoint, name, value)
    one = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    optimizers = build_optimizers([model], job.optimizer, one)
    schedulers = build_lr_schedulers(optimizers, job.lr_scheduler, 10)
    return CheckpointManager(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={},
        checkpoint_config=job.checkpoint,
        sd_adapter=None,
        base_folder=str(base),
    )


def titan_step(model: torch.nn.Module, manager: CheckpointManager, tokens: torch.Tensor) -> None:
    model.train()
    model(tokens).float().logsumexp(-1).mean().backward()
    manager.states["optimizer"].step()
    manager.states["optimizer"].zero_grad()
    manager.states["lr_scheduler"].step()
    model.eval()


def tokens(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).float()


def tidal_model(args: ModelArgs, state_dict: dict[str, torch.Tensor]) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()  # the RoPE tables; every parameter is replaced below
    model.load_state_dict(state_dict)
    return model.eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def titan_llama_run(tmp_path_factory) -> dict[str, Any]:
    """A torchtitan Llama 3 (tiny shape, RoPE scaling 8) trained two steps by torchtitan's
    own classes: a training save at step 1 and the model-only last save at step 2, with the
    logits of its model at each save."""
    base = tmp_path_factory.mktemp("titan_llama")
    model = titan_model(titan_llama_args())
    manager = titan_manager(model, base)
    ids = tokens(VOCAB)
    titan_step(model, manager, ids)
    manager.save(1)
    at1 = logits(model, ids)
    titan_step(model, manager, ids)
    manager.save(2, last_step=True)
    at2 = logits(model, ids)
    manager.close()
    return {"folder": base / "checkpoint", "ids": ids, "logits": {1: at1, 2: at2}}


# -- torchtitan -> tidal -------------------------------------------------------------------


def test_what_torchtitan_writes(titan_llama_run):
    """A training save holds the model's keys at the top level beside torchtitan's optimizer
    and schedule entries; the last save holds the model alone. Neither has a marker."""
    from tidal.train.checkpoint import read_metadata

    folder = titan_llama_run["folder"]
    full = set(read_metadata(folder / "step-1").state_dict_metadata)
    only = set(read_metadata(folder / "step-2").state_dict_metadata)
    assert "layers.0.attention.wq.weight" in only and "output.weight" in only
    assert not any(k.startswith(("optimizer.", "lr_scheduler", "train_state")) for k in only)
    assert only < full
    assert any(k.startswith("optimizer.state.layers.0.attention.wq.weight.") for k in full)
    assert any(k.startswith("lr_scheduler.") for k in full)
    assert sorted(p.name for p in (folder / "step-2").iterdir()) == [".metadata", "__0_0.distcp"]


@pytest.mark.parametrize("step", [1, 2], ids=["training_save", "model_only_save"])
def test_llama3_from_torchtitan(step, titan_llama_run, capsys):
    run = titan_llama_run
    path = run["folder"] / f"step-{step}"
    args = tidal_llama_args()
    read, state_dict, info = read_model(path, args, layout_name="torchtitan", **QUIET)
    assert info["layout"] == "torchtitan" and read == args
    diff = max_diff(logits(tidal_model(args, state_dict), run["ids"]), run["logits"][step])
    print(f"torchtitan -> tidal, Llama 3 step {step}: max |logit diff| {diff:.2e}")
    assert diff < TOL
    # Read as tidal's order (what `dcp-to-hf --flavor` did before): another model.
    _, wrong, _ = read_model(path, args, layout_name="tidal", **QUIET)
    off = max_diff(logits(tidal_model(args, wrong), run["ids"]), run["logits"][step])
    print(f"  read as tidal's order: max |logit diff| {off:.2e}")
    assert off > 1e-2


def test_llama3_from_torchtitan_through_hugging_face(titan_llama_run, tmp_path):
    """The newest save of torchtitan's checkpoint folder, converted to a Hugging Face folder,
    gives torchtitan's logits in transformers too."""
    transformers = pytest.importorskip("transformers")
    run = titan_llama_run
    dcp_to_hf(run["folder"], tmp_path / "hf", args=tidal_llama_args(), layout_name="torchtitan")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        got = hf(run["ids"]).logits
    diff = max_diff(got, run["logits"][2])
    print(f"torchtitan -> Hugging Face (transformers), Llama 3: max |logit diff| {diff:.2e}")
    assert diff < TOL


def test_convert_cli_names_the_layout(tmp_path, capsys):
    """`tidal convert dcp-to-hf` of torchtitan's folder: refused without --layout (one line
    naming the flag), exact with it; tidal's `tiny` flavor is torchtitan's Llama with RoPE
    scaling factor 1."""
    model = titan_model(titan_llama_args(scaling=1.0), seed=3)
    manager = titan_manager(model, tmp_path / "titan")
    manager.save(5, last_step=True)
    manager.close()
    src = str(tmp_path / "titan" / "checkpoint")
    capsys.readouterr()
    assert main(["convert", "dcp-to-hf", src, str(tmp_path / "a"), "--flavor", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --layout torchtitan or --layout tidal" in err, err
    assert not (tmp_path / "a").exists()
    cmd = ["convert", "dcp-to-hf", src, str(tmp_path / "b"), "--config", "debug"]
    flags = ["--model.flavor", "tiny", "--model.vocab_size", str(VOCAB), "--layout", "torchtitan"]
    assert main([*cmd, *flags]) == 0
    out = capsys.readouterr().out
    assert "step-5: torchtitan layout (named)" in out, out
    ids = tokens(VOCAB, seed=4)
    diff = max_diff(logits(load_hf(tmp_path / "b"), ids), logits(model, ids))
    assert diff < TOL
    # dcp-to-dcp writes it in tidal's layout: tidal.json says so, and no flag is needed after.
    cmd = ["convert", "dcp-to-dcp", src, str(tmp_path / "t"), "--flavor", "tiny", "--layout"]
    assert main([*cmd, "torchtitan"]) == 2  # the vocabulary is not tiny's: named, refused
    capsys.readouterr()
    args = get_flavor("tiny", vocab_size=VOCAB)
    dcp_to_dcp(src, tmp_path / "t", args=args, layout_name="torchtitan", **QUIET)
    assert json.loads((tmp_path / "t" / "tidal.json").read_text())["layout"] == "tidal"
    _, state_dict, info = read_model(tmp_path / "t", **QUIET)
    assert info["layout"] == "tidal"
    assert max_diff(logits(tidal_model(args, state_dict), ids), logits(model, ids)) < TOL


def test_initial_load_path_from_torchtitan(tmp_path):
    """A training run starts from torchtitan's weights with --checkpoint.initial_load_layout
    torchtitan (its model only), and refuses the folder without it, naming the flag."""
    model = titan_model(titan_llama_args(scaling=1.0), seed=7)
    manager = titan_manager(model, tmp_path / "titan")
    manager.save(3, last_step=True)
    manager.close()
    src = str(tmp_path / "titan" / "checkpoint")
    start = ["--checkpoint.initial_load_path", src]
    with pytest.raises(CheckpointError, match="pass --checkpoint.initial_load_layout torchtitan"):
        Trainer(run_config(tmp_path / "a", *start), data=random_data())
    layout = ["--checkpoint.initial_load_layout", "torchtitan"]
    everything = ["--checkpoint.initial_load_model_only", "false"]
    with pytest.raises(CheckpointError, match="only its model loads"):
        Trainer(run_config(tmp_path / "b", *start, *layout, *everything), data=random_data())
    lines: list[str] = []
    trainer = Trainer(
        run_config(tmp_path / "c", *start, *layout), data=random_data(), log=lines.append
    )
    try:
        ids = tokens(VOCAB, seed=8)
        diff = max_diff(logits(trainer.model.eval(), ids), logits(model, ids))
        assert diff < TOL
    finally:
        trainer.close()
    assert any("step-3 (model only), torchtitan layout" in line for line in lines), lines


# -- tidal -> torchtitan -------------------------------------------------------------------


def tidal_seeded(args: ModelArgs, seed: int) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def titan_loads(titan_args: Any, path: Path, base: Path) -> torch.nn.Module:
    """A fresh torchtitan model loaded by torchtitan's CheckpointManager from `path`
    (`--checkpoint.initial_load_path`)."""
    model = titan_model(titan_args, seed=None)
    manager = titan_manager(model, base, initial_load_path=str(path))
    assert manager.load()
    manager.close()
    return model.eval()


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_to_torchtitan(family, tmp_path):
    if family == "llama3":
        args, titan_args = tidal_llama_args(), titan_llama_args()
    else:
        args, titan_args = get_flavor("debug_qwen3"), TITAN_QWEN3
    model = tidal_seeded(args, seed=11)
    src = save_model(model.state_dict(), tmp_path / "run", 4, info={"model": model_info(args, "x")})
    dst = dcp_to_dcp(src, tmp_path / "tt", to_layout="torchtitan", **QUIET)
    info = json.loads((dst / "tidal.json").read_text())
    assert info["layout"] == "torchtitan"
    ids = tokens(args.vocab_size, seed=12)
    titan = titan_loads(titan_args, dst, tmp_path / "titan")
    diff = max_diff(logits(titan, ids), logits(model, ids))
    print(f"tidal -> torchtitan, {family}: max |logit diff| {diff:.2e}")
    assert diff < TOL
    # tidal reads its own torchtitan-layout folder back (tidal.json says which) exactly.
    _, back, info = read_model(dst, **QUIET)
    assert info["layout"] == "torchtitan"
    for key, value in model.state_dict().items():
        assert torch.equal(back[key], value), key


def test_qwen3_from_torchtitan(tmp_path, capsys):
    """torchtitan's Qwen 3 (rotate-half RoPE, tied embeddings saved under both names) through
    `tidal convert dcp-to-hf --layout torchtitan`."""
    model = titan_model(TITAN_QWEN3, seed=13)
    manager = titan_manager(model, tmp_path / "titan")
    manager.save(2, last_step=True)
    manager.close()
    src = tmp_path / "titan" / "checkpoint"
    code = main(
        ["convert", "dcp-to-hf", str(src), str(tmp_path / "hf"), "--flavor", "debug_qwen3"]
        + ["--layout", "torchtitan"]
    )
    assert code == 0, capsys.readouterr().err
    ids = tokens(TITAN_QWEN3.vocab_size, seed=14)
    diff = max_diff(logits(load_hf(tmp_path / "hf"), ids), logits(model, ids))
    print(f"torchtitan -> tidal, Qwen 3: max |logit diff| {diff:.2e}")
    assert diff < TOL


# -- which tidal flavor a torchtitan model is ----------------------------------------------

NAMED = [
    ("llama3", "8B", "llama3_8b"),
    ("llama3", "70B", "llama3_70b"),
    ("qwen3", "0.6B", "qwen3_0_6b"),
    ("qwen3", "1.7B", "qwen3_1_7b"),
    ("qwen3", "8B", "qwen3_8b"),
]


@pytest.mark.parametrize(("family", "titan_name", "flavor"), NAMED)
def test_torchtitan_models_are_tidal_flavors(family, titan_name, flavor):
    """The `--flavor` docs/checkpoint.md names for torchtitan's models: the same tensors
    (built on the meta device) and the same RoPE frequencies."""
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.model import precompute_freqs_cis
    from torchtitan.models.qwen3 import qwen3_args

    from tidal.models.transformer import rope_frequencies

    titan_args = (llama3_args if family == "llama3" else qwen3_args)[titan_name]
    args = get_flavor(flavor)
    with torch.device("meta"):
        cls = TitanLlama if family == "llama3" else Qwen3Model
        theirs = {k: tuple(v.shape) for k, v in cls(titan_args).state_dict().items()}
        ours = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    if args.tie_embeddings:
        assert theirs.pop("output.weight") == theirs["tok_embeddings.weight"]
    assert theirs == ours
    assert titan_args.rope_theta == args.rope_theta and titan_args.norm_eps == args.norm_eps
    if family == "llama3":  # torchtitan's Llama always scales (Llama 3.1, factor 8 default)
        angles = precompute_freqs_cis(
            args.k, 2, titan_args.rope_theta, titan_args.rope_scaling_args
        )
        torch.testing.assert_close(angles[1].angle(), rope_frequencies(args), rtol=1e-6, atol=0)


def test_generate_reads_torchtitan_with_layout(tmp_path, capsys):
    """`tidal generate --checkpoint` of torchtitan's folder: refused without --layout (the
    flag named), read in torchtitan's layout with it (the run then stops at the next check:
    this test model's 64-token vocabulary is smaller than the config's tokenizer)."""
    model = titan_model(titan_llama_args(scaling=1.0), seed=3)
    manager = titan_manager(model, tmp_path / "titan")
    manager.save(5, last_step=True)
    manager.close()
    src = str(tmp_path / "titan" / "checkpoint")
    cmd = ["generate", "--config", "sft_addition", "--checkpoint", src]
    cmd += ["--prompt", "1+1", "--model.flavor", "tiny", "--model.vocab_size", str(VOCAB)]
    capsys.readouterr()
    assert main(cmd) == 2
    assert "pass --layout torchtitan or --layout tidal" in capsys.readouterr().err
    assert main([*cmd, "--layout", "torchtitan"]) == 2
    err = capsys.readouterr().err
    assert "layout" not in err and "embeds only 64" in err, err
