"""`tidal generate` end to end on CPU (tiny model, a BPE trained on the test corpus)."""

import json

import pytest

from tidal.cli import main


@pytest.fixture
def base(text_corpus, cache_dir):
    return ["--config", "debug", "--model.flavor", "tiny", "--data.dataset", "jsonl",
            "--data.path", str(text_corpus), "--data.vocab_size", "384",
            "--data.cache_dir", str(cache_dir), "--device", "cpu"]  # fmt: skip


def run(capsys, argv):
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_samples(capsys, base):
    argv = [*base, "--prompt", "The list", "--prompt", "A", "--n", "2", "--temperature", "0.8",
            "--top-k", "20", "--top-p", "0.95", "--max-new-tokens", "6", "--seed", "4",
            "--json"]  # fmt: skip
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
    code, out, _ = run(capsys, [*base, "--prompts", str(path), "--temperature", "0",
                                "--max-new-tokens", "5", "--batch-invariant"])  # fmt: skip
    assert code == 0
    heads = [line for line in out.splitlines() if line.startswith("--- prompt")]
    assert len(heads) == 2 and "The list" in out and "Return" in out


@pytest.mark.filterwarnings("ignore:DataConfig.vocab_size")
def test_chat_template(capsys, base, tmp_path, text_corpus, cache_dir):
    from tidal.train.data import DataConfig, build_tokenizer

    cfg = DataConfig(dataset="jsonl", path=str(text_corpus), vocab_size=384,
                     cache_dir=str(cache_dir))  # fmt: skip
    folder = tmp_path / "tok"
    folder.mkdir()
    build_tokenizer(cfg, log=lambda line: None).save(folder / "tokenizer.json")
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n" \
               "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    argv = [*base, "--data.tokenizer", str(folder / "tokenizer.json"), "--chat", "--prompt",
            "hi", "--temperature", "0", "--max-new-tokens", "3", "--json"]  # fmt: skip
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
