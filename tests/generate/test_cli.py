"""`tidal generate` end to end on CPU (tiny model, a BPE trained on the test corpus)."""

import json

import pytest

from tidal.cli import main


@pytest.fixture
def base(text_corpus, cache_dir):
    return [
        "--config",
        "debug",
        "--model.flavor",
        "tiny",
        "--data.dataset",
        "jsonl",
        "--data.path",
        str(text_corpus),
        "--data.vocab_size",
        "384",
        "--data.cache_dir",
        str(cache_dir),
        "--device",
        "cpu",
    ]


def run(capsys, argv):
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_samples(capsys, base):
    argv = [
        *base,
        "--prompt",
        "The list",
        "--prompt",
        "A",
        "--n",
        "2",
        "--temperature",
        "0.8",
        "--top-k",
        "20",
        "--top-p",
        "0.95",
        "--max-new-tokens",
        "6",
        "--seed",
        "4",
        "--json",
    ]
    code, out, _ = run(capsys, argv)
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    for r in rows:
        assert set(r) >= {"prompt_ids", "completion_ids", "text", "logprobs", "finish_reason"}
        assert r["prompt_ids"][0] == 0  # BOS, as the trainer packs documents
        assert 1 <= len(r["completion_ids"]) == len(r["logprobs"]) <= 6
        assert r["finish_reason"] in ("stop", "length")
    assert run(capsys, argv)[1] == out  # seeded: the same samples again


def test_prompts_file_greedy_and_text_output(capsys, base, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "The list"}\n\n{"prompt": "Return"}\n')
    code, out, _ = run(
        capsys,
        [
            *base,
            "--prompts",
            str(path),
            "--temperature",
            "0",
            "--max-new-tokens",
            "5",
            "--batch-invariant",
        ],
    )
    assert code == 0
    heads = [line for line in out.splitlines() if line.startswith("--- prompt")]
    assert len(heads) == 2 and "The list" in out and "Return" in out


@pytest.mark.filterwarnings("ignore:DataConfig.vocab_size")
def test_chat_template(capsys, base, tmp_path, text_corpus, cache_dir):
    from tidal.train.data import DataConfig, build_tokenizer

    cfg = DataConfig(
        dataset="jsonl", path=str(text_corpus), vocab_size=384, cache_dir=str(cache_dir)
    )
    folder = tmp_path / "tok"
    folder.mkdir()
    build_tokenizer(cfg, log=lambda line: None).save(folder / "tokenizer.json")
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    argv = [
        *base,
        "--data.tokenizer",
        str(folder / "tokenizer.json"),
        "--chat",
        "--prompt",
        "hi",
        "--temperature",
        "0",
        "--max-new-tokens",
        "3",
        "--json",
    ]
    code, out, err = run(capsys, argv)
    assert code == 0, err
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert row["prompt_ids"][0] == 0  # the rendered "<|bos|>" became the BOS id, not text

    code, _, err = run(capsys, [*base, "--chat", "--prompt", "hi"])
    assert code == 2 and "--chat needs a tokenizer with a chat template" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "no prompts"),
        (["--prompt", "a", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["--prompt", "a", "--temperature", "-1"], "temperature must be finite and >= 0"),
        (["--prompt", "a", "--max-new-tokens", "600"], "new tokens fit"),
        (["--prompts", "missing.jsonl"], "--prompts file not found"),
        (["--prompt", "a", "--stop", ""], "non-empty strings"),
    ],
)
def test_bad_arguments(capsys, base, extra, message):
    code, _, err = run(capsys, [*base, *extra])
    assert code == 2 and message in err, err


# -- --checkpoint and --hf ------------------------------------------------------------------


def _seeded_tiny(seed: int):
    import torch

    from tidal.models import Transformer, get_flavor

    with torch.device("meta"):
        model = Transformer(get_flavor("tiny"))
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def _greedy(model, prompts, tokenizer, n_new, stop_ids=None):
    """What the Generator itself gives on `model`: completion ids per prompt."""
    from tidal.generate import Generator, GeneratorConfig, SamplingParams

    gen = Generator(model, tokenizer=tokenizer, config=GeneratorConfig(max_batch=4))
    params = SamplingParams(temperature=0.0, max_new_tokens=n_new, stop_token_ids=stop_ids)
    return [g[0].completion_ids for g in gen.generate(prompts, params)]


@pytest.fixture
def bpe(text_corpus, cache_dir):
    from tidal.train.data import DataConfig, build_tokenizer

    cfg = DataConfig(
        dataset="jsonl", path=str(text_corpus), vocab_size=384, cache_dir=str(cache_dir)
    )
    return build_tokenizer(cfg, log=lambda line: None)


def test_checkpoint_of_a_run(capsys, base, bpe, tmp_path):
    """--checkpoint: a model-only DCP checkpoint (its tidal.json names the architecture, so the
    config's model.flavor does not matter) or a run's folder of them (the newest)."""
    from tidal.models import get_flavor
    from tidal.train.checkpoint import model_info, save_model

    model = _seeded_tiny(7)
    info = {"model": model_info(get_flavor("tiny"), "tiny")}
    save_model(model.state_dict(), tmp_path / "ckpt", 3, info=info)
    prompts = ["The list", "A"]
    want = _greedy(model, [[bpe.bos_id, *bpe.encode(p)] for p in prompts], bpe, 6)
    argv = [
        *base[:2],
        *base[4:],
        "--prompt",
        prompts[0],
        "--prompt",
        prompts[1],
        "--temperature",
        "0",
        "--max-new-tokens",
        "6",
        "--json",
    ]
    for path in (tmp_path / "ckpt", tmp_path / "ckpt" / "step-3"):
        code, out, err = run(capsys, [*argv, "--checkpoint", str(path)])
        assert code == 0, err
        rows = [json.loads(line) for line in out.splitlines()]
        assert [r["completion_ids"] for r in rows] == want
    _, seed_init, _ = run(capsys, [*base, *argv[len(base) - 2 :]])
    assert seed_init != out  # the checkpoint's weights, not the seed init

    code, _, err = run(capsys, [*argv, "--checkpoint", str(tmp_path / "nothere")])
    assert code == 2 and "does not exist" in err
    with pytest.raises(SystemExit):  # argparse: one source at a time
        run(capsys, [*argv, "--checkpoint", str(tmp_path / "ckpt"), "--hf", "x"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_hf_folder(capsys, base, bpe, tmp_path):
    """--hf: a folder save_hf wrote, its tokenizer.json beside the weights; prompts encoded as
    transformers does (no BOS added: this tokenizer's template adds none), stops at
    config.json's eos_token_id."""
    from tidal.models import load_hf, save_hf

    folder = tmp_path / "hf"
    save_hf(_seeded_tiny(11), folder)
    argv = [
        "--device",
        "cpu",
        "--prompt",
        "The list",
        "--temperature",
        "0",
        "--max-new-tokens",
        "6",
        "--json",
        "--hf",
        str(folder),
    ]
    code, _, err = run(capsys, argv)
    assert code == 2 and "tokenizer.json" in err and "--data.tokenizer" in err
    bpe.save(folder / "tokenizer.json")
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = 5
    (folder / "config.json").write_text(json.dumps(config))
    code, out, err = run(capsys, argv)
    assert code == 0, err
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert row["prompt_ids"] == bpe.encode("The list")
    assert row["completion_ids"] == _greedy(load_hf(folder), [row["prompt_ids"]], bpe, 6, (5,))[0]

    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "bos_token": "<|eos|>"})
    )
    code, out, err = run(capsys, [*argv, "--chat"])
    assert code == 0, err
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert row["prompt_ids"] == [bpe.eos_id, *bpe.encode("The list")]  # the config's bos_token
