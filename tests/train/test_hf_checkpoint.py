"""Hugging Face folders and DCP checkpoints in one process: `tidal convert` both ways (byte
round trips, errors, no partial destination), a run started from Hugging Face weights
(`checkpoint.initial_load_hf`) and the export of its last save (`checkpoint.last_save_in_hf`).

The runs train the `tiny` flavor (vocabulary 64) on the random tokens of test_checkpoint.py;
the multi-rank loads are in tests/parallel/test_hf_parallel.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.train.test_checkpoint import (
    VOCAB,
    interrupt_after,
    random_data,
    records,
    run_config,
    step_records,
)
from tidal.cli import main
from tidal.models import Transformer, get_flavor, load_hf, save_hf
from tidal.train.checkpoint import save_model
from tidal.train.checkpoint.hf import dcp_to_hf, hf_to_dcp, read_in_chunks, read_model
from tidal.train.checkpoint.plan import model_info
from tidal.train.trainer import Trainer

MODELS = Path(__file__).parents[1] / "models" / "data"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_model(seed: int = 5, vocab: int = VOCAB) -> Transformer:
    with torch.device("meta"):
        model = Transformer(get_flavor("tiny", vocab_size=vocab))
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer.json of VOCAB tokens, a tokenizer_config.json and a template."""
    import tokenizers

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab |= {f"w{i}": i for i in range(3, VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory) -> Path:
    """A tiny Llama as save_hf writes it (seeded, not the seed init of any run), with a
    tokenizer."""
    folder = tmp_path_factory.mktemp("hf_tiny") / "model"
    save_hf(tiny_model(), folder)
    write_tokenizer(folder)
    return folder


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("model*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
    return out


def assert_bytes_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


# -- tidal convert ---------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["tiny_llama", "tiny_qwen3", "tidal_sharded"])
def test_hf_dcp_hf_is_byte_identical(source, tmp_path, hf_tiny):
    if source == "tidal_sharded":
        src = tmp_path / "src"
        save_hf(load_hf(hf_tiny), src, max_shard_size=100_000)
        assert len(list(src.glob("*.safetensors"))) > 1
    else:
        src = MODELS / source  # written by transformers
    assert main(["convert", "hf-to-dcp", str(src), str(tmp_path / "dcp")]) == 0
    assert {".metadata", "COMPLETE", "tidal.json"} <= {p.name for p in (tmp_path / "dcp").iterdir()}
    shard = ["--max-shard-size", "100000"] if source == "tidal_sharded" else []
    assert (
        main(["convert", "dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "back"), *shard]) == 0
    )
    assert_bytes_equal(tensors(src), tensors(tmp_path / "back"))
    # config.json is the one HF -> tidal -> HF writes (token ids kept through tidal.json).
    save_hf(load_hf(src), tmp_path / "direct", max_shard_size=100_000 if shard else 5 * 10**9)
    assert (tmp_path / "back" / "config.json").read_text() == (
        tmp_path / "direct" / "config.json"
    ).read_text()
    if source == "tidal_sharded":
        assert (tmp_path / "back" / "config.json").read_bytes() == (
            src / "config.json"
        ).read_bytes()
        index = "model.safetensors.index.json"
        assert (tmp_path / "back" / index).read_text() == (src / index).read_text()
    leftovers = [p.name for p in tmp_path.iterdir() if "partial" in p.name]
    assert leftovers == []


def test_dtype_flavor_and_tokenizer(tmp_path, hf_tiny, capsys):
    dcp = hf_to_dcp(hf_tiny, tmp_path / "dcp", flavor="tiny", dtype=torch.bfloat16)
    info = json.loads((dcp / "tidal.json").read_text())
    assert info["model"]["flavor"] == "tiny" and info["model"]["args"]["vocab_size"] == VOCAB
    assert "--model.flavor tiny --model.vocab_size 64" in capsys.readouterr().out
    args, sd, _ = read_model(dcp, progress=False)
    assert args == get_flavor("tiny", vocab_size=VOCAB) and all(
        t.dtype == torch.bfloat16 for t in sd.values()
    )
    out = dcp_to_hf(dcp, tmp_path / "hf", dtype=torch.float32, tokenizer=hf_tiny)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    want = {k: v.to(torch.bfloat16).float() for k, v in tensors(hf_tiny).items()}
    assert_bytes_equal(want, tensors(out))


def test_a_trainer_checkpoint_converts_to_the_trained_model(tmp_path):
    trainer = Trainer(
        run_config(tmp_path / "run", steps=4), data=random_data(), log=lambda *a: None
    )
    trainer.train()
    model = trainer.model
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids)
    trainer.close()
    # A full training save (optimizer, data, RNG): only the model is read.
    folder = dcp_to_hf(tmp_path / "run" / "checkpoint", tmp_path / "hf")
    with torch.no_grad():
        assert torch.equal(load_hf(folder)(ids), want)


def test_dcp_without_tidal_json_needs_a_model_and_a_layout(tmp_path, capsys):
    sd = tiny_model(vocab=512).state_dict()
    path = save_model(
        sd, tmp_path / "ckpt", 3, info={"model": model_info(get_flavor("tiny"), "tiny")}
    )
    for name in ("tidal.json", "COMPLETE"):  # as another tool writes it: DCP files alone
        (path / name).unlink()
    code = main(["convert", "dcp-to-hf", str(path), str(tmp_path / "a"), "--layout", "tidal"])
    assert code == 2 and not (tmp_path / "a").exists()
    capsys.readouterr()
    # Without tidal.json the q/k order is unknown (torchtitan's Llama differs): one line.
    code = main(["convert", "dcp-to-hf", str(path), str(tmp_path / "a"), "--flavor", "tiny"])
    err = capsys.readouterr().err
    assert (
        code == 2 and err.count("\n") == 1 and "pass --layout torchtitan or --layout tidal" in err
    )
    tidal = ["--layout", "tidal"]
    code = main(
        ["convert", "dcp-to-hf", str(path), str(tmp_path / "b"), "--flavor", "tiny", *tidal]
    )
    assert code == 0
    code = main(
        [
            "convert",
            "dcp-to-hf",
            str(path),
            str(tmp_path / "c"),
            *tidal,
            "--config",
            "debug",
            "--model.flavor",
            "tiny",
        ]
    )
    assert code == 0
    assert_bytes_equal(tensors(tmp_path / "b"), tensors(tmp_path / "c"))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "does not exist"),
        ("no_config", "has no config.json"),
        ("truncated_safetensors", "truncated"),
        ("wrong_flavor", "is not model.flavor 'debug'"),
        ("unknown_flavor", "--flavor 'nope' is unknown"),
        ("destination_exists", "already exists"),
        ("dcp_truncated", "the file is truncated or corrupt"),
        ("dcp_corrupt_metadata", "unreadable"),
        ("dcp_incomplete", "incomplete"),
        ("dcp_other_model", "holds another model than the one named"),
        ("dcp_not_a_checkpoint", "is not a checkpoint"),
    ],
)
def test_convert_errors_leave_no_destination(case, message, tmp_path, hf_tiny, capsys):
    src = tmp_path / "src"
    if case.startswith("dcp"):
        hf_to_dcp(hf_tiny, src)
        capsys.readouterr()
        direction, extra = "dcp-to-hf", []
        if case == "dcp_truncated":
            _truncate(src / "__0_0.distcp")
        elif case == "dcp_corrupt_metadata":
            (src / ".metadata").write_bytes(b"not a pickle at all")
            (src / "COMPLETE").unlink()  # the size check would catch it first
            (src / "tidal.json").unlink()
            extra = ["--flavor", "tiny", "--layout", "tidal"]
        elif case == "dcp_incomplete":
            (src / "COMPLETE").unlink()
        elif case == "dcp_other_model":
            extra = ["--flavor", "debug"]
        elif case == "dcp_not_a_checkpoint":
            src = tmp_path / "empty"
            src.mkdir()
    else:
        direction, extra = "hf-to-dcp", []
        if case != "missing":
            save_hf(load_hf(hf_tiny), src)
        if case == "no_config":
            (src / "config.json").unlink()
        elif case == "truncated_safetensors":
            _truncate(src / "model.safetensors")
        elif case == "wrong_flavor":
            extra = ["--flavor", "debug"]
        elif case == "unknown_flavor":
            extra = ["--flavor", "nope"]
    dst = tmp_path / "dst"
    if case == "destination_exists":
        dst.mkdir()
        (dst / "keep.txt").write_text("mine")
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(["convert", direction, str(src), str(dst), *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("tidal convert: error: ") and message in err, err
    assert err.count("\n") == 1  # one line, no traceback
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing new, no .partial
    if case == "destination_exists":
        assert (dst / "keep.txt").read_text() == "mine"


def test_a_failure_while_writing_leaves_nothing(tmp_path, hf_tiny, monkeypatch):
    import tidal.models.hf

    def fail(*a, **kw):
        raise OSError("disk full")

    dcp = hf_to_dcp(hf_tiny, tmp_path / "dcp")
    monkeypatch.setattr(tidal.models.hf, "save_hf_state_dict", fail)
    with pytest.raises(OSError, match="disk full"):
        dcp_to_hf(dcp, tmp_path / "hf")
    monkeypatch.setattr(tidal.train.checkpoint.hf, "save_model", fail)
    with pytest.raises(OSError, match="disk full"):
        hf_to_dcp(hf_tiny, tmp_path / "dcp2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp"]


# -- the trainer -----------------------------------------------------------------------------


def train(out: Path, *extra: str, steps: int = 6, stop_at: int | None = None) -> Trainer:
    trainer = Trainer(run_config(out, *extra, steps=steps), data=random_data(), log=lambda *a: None)
    if stop_at is not None:
        interrupt_after(trainer, stop_at)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


def losses(out: Path) -> list[tuple[float, float, float]]:
    rec = step_records(out)
    return [rec[s] for s in sorted(rec)]


def test_a_differing_vocab_size_is_ignored_with_a_warning(tmp_path, hf_tiny):
    cfg = run_config(
        tmp_path, "--checkpoint.initial_load_hf", str(hf_tiny), "--model.vocab_size", "128"
    )
    from tidal.train.trainer import model_args_for

    with pytest.warns(UserWarning, match=r"model.vocab_size=128 is ignored"):
        assert model_args_for(cfg).vocab_size == VOCAB


def test_config_resolves_the_tokenizer_and_checks_fields(hf_tiny):
    from tidal.train.config_parse import apply_overrides
    from tidal.train.configs import get_config

    cfg = apply_overrides(get_config("debug"), ["--checkpoint.initial_load_hf", str(hf_tiny)])
    assert cfg.data.tokenizer == str(hf_tiny / "tokenizer.json")
    cfg = apply_overrides(
        get_config("debug"),
        ["--checkpoint.initial_load_hf", str(hf_tiny), "--data.tokenizer", "/x/tokenizer.json"],
    )
    assert cfg.data.tokenizer == "/x/tokenizer.json"
    for extra, message in [
        (["--checkpoint.initial_load_path", "x"], "are both set"),
        (["--checkpoint.last_save_in_hf"], "needs --checkpoint.enable true"),
        (
            ["--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.last_save_in_hf"],
            "a load-only run saves nothing",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            apply_overrides(
                get_config("debug"), ["--checkpoint.initial_load_hf", str(hf_tiny), *extra]
            )
    # Without enable, an initial_load_path would be silently dropped (a missing one too).
    with pytest.raises(ValueError, match="initial_load_path needs --checkpoint.enable true"):
        apply_overrides(get_config("debug"), ["--checkpoint.initial_load_path", "/no/such"])


def test_initial_load_hf_equals_the_converted_checkpoint(tmp_path, hf_tiny):
    """The same weights through the Hugging Face folder and through its DCP conversion give
    bitwise the same run; the seed init gives another."""
    train(tmp_path / "hf", "--checkpoint.initial_load_hf", str(hf_tiny))
    dcp = hf_to_dcp(hf_tiny, tmp_path / "dcp", log=lambda _: None)
    train(tmp_path / "dcp_run", "--checkpoint.initial_load_path", str(dcp))
    train(tmp_path / "seed")
    assert losses(tmp_path / "hf") == losses(tmp_path / "dcp_run")
    assert losses(tmp_path / "hf")[0][0] != losses(tmp_path / "seed")[0][0]
    # The first loss is the loaded model's on the first batch.
    batch = next(iter(random_data().train))
    with torch.no_grad():
        logits = load_hf(hf_tiny)(batch.input_ids)
        want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten())
    assert losses(tmp_path / "hf")[0][0] == pytest.approx(want.item(), abs=1e-6)


def test_a_run_from_hf_weights_resumes_exactly(tmp_path, hf_tiny):
    hf = ["--checkpoint.initial_load_hf", str(hf_tiny)]
    train(tmp_path / "straight", *hf)
    lines: list[str] = []
    train(tmp_path / "run", *hf, stop_at=3)
    trainer = Trainer(
        run_config(tmp_path / "run", *hf, steps=6),
        data=random_data(),
        log=lambda *a: lines.append(" ".join(map(str, a))),
    )
    trainer.train()
    trainer.close()
    assert any("resuming from" in line for line in lines)
    assert any("checkpoint.initial_load_hf are not loaded" in line for line in lines)
    ref, got = step_records(tmp_path / "straight"), step_records(tmp_path / "run")
    assert [got[s] for s in range(4, 7)] == [ref[s] for s in range(4, 7)]
    assert [r for r in records(tmp_path / "run") if "event" in r] == [
        {"event": "resume", "step": 3}
    ]


def test_last_save_in_hf(tmp_path, hf_tiny):
    out = tmp_path / "run"
    trainer = Trainer(
        run_config(
            out,
            "--checkpoint.initial_load_hf",
            str(hf_tiny),
            "--checkpoint.last_save_in_hf",
            steps=4,
        ),
        data=random_data(),
        log=lambda *a: None,
    )
    trainer.train()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trainer.model(ids)
    trainer.close()
    export = out / "checkpoint" / "step-4-hf"
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["step-4", "step-4-hf"]
    assert sorted(p.name for p in export.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (export / "tokenizer.json").read_bytes() == (hf_tiny / "tokenizer.json").read_bytes()
    with torch.no_grad():
        assert torch.equal(load_hf(export)(ids), want)
    assert json.loads((export / "config.json").read_text()) == json.loads(
        (hf_tiny / "config.json").read_text()
    )
    assert set(tensors(export)) == set(tensors(hf_tiny))  # what transformers' loader reads

    # A run of a named flavor, in bf16, with the trained BPE's tokenizer object.
    class Tok:
        def save(self, path):
            Path(path).write_text("{}")

    data = random_data()
    data.tokenizer.save = Tok().save
    out = tmp_path / "bf16"
    trainer = Trainer(
        run_config(
            out, "--checkpoint.last_save_in_hf", "--checkpoint.export_dtype", "bfloat16", steps=2
        ),
        data=data,
        log=lambda *a: None,
    )
    trainer.train()
    trainer.close()
    export = out / "checkpoint" / "step-2-hf"
    assert {t.dtype for t in tensors(export).values()} == {torch.bfloat16}
    assert (export / "tokenizer.json").read_text() == "{}"
    assert json.loads((export / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("missing", "does not exist"),
        ("truncated", "truncated"),
        ("seq_len", "exceeds the max_position_embeddings=512"),
        ("extra_tensor", "the llama model of its config.json does not"),
    ],
)
def test_initial_load_hf_errors_before_anything_is_built(
    edit, message, tmp_path, hf_tiny, monkeypatch
):
    src = tmp_path / "src"
    save_hf(load_hf(hf_tiny), src)
    extra: list[str] = []
    if edit == "missing":
        src = tmp_path / "nothere"
    elif edit == "truncated":
        _truncate(src / "model.safetensors")
    elif edit == "seq_len":
        extra = ["--training.seq_len", "1024"]
    elif edit == "extra_tensor":
        from safetensors.torch import save_file

        sd = tensors(src) | {"model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}
        save_file(sd, str(src / "model.safetensors"))
    built = []
    monkeypatch.setattr(Transformer, "init_weights", lambda *a, **k: built.append(1))
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        cfg = run_config(tmp_path / "run", "--checkpoint.initial_load_hf", str(src), *extra)
        Trainer(cfg, data=random_data(), log=lambda *a: None)
    assert built == []


def test_the_doc_example_runs():
    """docs/checkpoint.md's Python blocks, as written."""
    import re

    doc = Path(__file__).parents[2] / "docs" / "checkpoint.md"
    blocks = re.findall(r"^```python\n(.*?)^```$", doc.read_text(), re.DOTALL | re.MULTILINE)
    assert blocks
    for i, code in enumerate(blocks):
        exec(compile(code, f"{doc}:block{i}", "exec"), {"__name__": "docs_checkpoint"})


def test_conversion_progress_counts_up_once():
    sd = {f"t{i}": torch.zeros(100 if i < 9 else 3) for i in range(10)}  # 400 B each, then 12
    lines: list[str] = []
    read_in_chunks(sd, lambda chunk: None, Path("src"), lines.append, chunk_bytes=1000)
    percents = [int(line.split("%")[0].split()[-1]) for line in lines[:-1]]
    assert percents == sorted(set(percents)) and percents[-1] < 100, lines
    assert lines[-1].startswith("read 10 tensors (0.0 MB) from src in"), lines
