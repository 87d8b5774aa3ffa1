"""`tidal serve`: the model and tokenizer built as `tidal generate` builds them, the message
without the serve extra, and the layering (only tidal/serve imports FastAPI and uvicorn)."""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from fastapi.testclient import TestClient

import tidal
from tidal.cli import main
from tidal.serve.app import create_app
from tidal.serve.cli import add_arguments, build_served


def test_build_from_a_config_and_serve(text_corpus, cache_dir):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args, overrides = parser.parse_known_args(
        [
            "--config", "debug", "--model.flavor", "tiny", "--data.dataset", "jsonl",
            "--data.path", str(text_corpus), "--data.vocab_size", "384",
            "--data.cache_dir", str(cache_dir), "--device", "cpu", "--max-batch", "4",
            "--max-seq-len", "256",
        ]
    )  # fmt: skip
    assert args.host == "127.0.0.1"  # loopback unless told otherwise
    served = build_served(args, overrides)
    assert served.name == "debug" and served.capacity == 256
    with TestClient(create_app(served)) as client:
        r = client.post(
            "/v1/completions",
            json={
                "model": "debug",
                "prompt": "The list",
                "max_tokens": 4,
                "return_token_ids": True,
            },
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        tok = served.engine.generator.tokenizer
        assert choice["prompt_token_ids"] == [tok.bos_id, *tok.encode("The list")]
        r = client.post(
            "/v1/chat/completions",
            json={
                "model": "debug",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 3,
            },
        )
        assert r.status_code == 200, r.text


def test_without_the_extra_one_line_names_the_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi raises ImportError
    assert main(["serve", "--config", "debug"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'tidal[serve]'" in err


def test_only_tidal_serve_imports_the_web_stack():
    root = Path(tidal.__file__).parent
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in ("fastapi", "uvicorn", "starlette", "httpx", "openai"):
                    assert rel.startswith("serve/"), f"tidal/{rel} imports {name}"
                if name.startswith("tidal.serve") and not rel.startswith("serve/"):
                    # the command line, and the environment verifiers plays through the server
                    assert rel in ("cli.py", "rl/envs/verifiers.py"), f"tidal/{rel} imports {name}"


def test_build_from_a_hugging_face_folder(text_corpus, cache_dir, tmp_path):
    """--hf: the folder's weights, tokenizer.json and chat template (one that reads `tools`:
    the template writes the tools itself), config.json's eos_token_id ending a turn."""
    import json

    import torch

    from tidal.models import Transformer, get_flavor, save_hf
    from tidal.train.data import DataConfig, build_tokenizer

    bpe = build_tokenizer(
        DataConfig(
            dataset="jsonl", path=str(text_corpus), vocab_size=384, cache_dir=str(cache_dir)
        ),
        log=lambda line: None,
    )
    with torch.device("meta"):
        model = Transformer(get_flavor("tiny"))
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    folder = tmp_path / "tiny-hf"
    save_hf(model, folder)
    bpe.save(folder / "tokenizer.json")
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = 5
    (folder / "config.json").write_text(json.dumps(config))
    template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args, overrides = parser.parse_known_args(["--hf", str(folder), "--device", "cpu"])
    served = build_served(args, overrides)
    assert served.name == "tiny-hf" and served.stop_ids == (5,)
    assert served.chat is not None and 5 in served.chat.stop_ids
    calc = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
    with TestClient(create_app(served)) as client:
        body = {"model": "tiny-hf", "prompt": "The list", "max_tokens": 3}
        r = client.post("/v1/completions", json=body | {"return_token_ids": True})
        assert r.json()["choices"][0]["prompt_token_ids"] == bpe.encode("The list")
        messages = [{"role": "user", "content": "Hi"}]
        body = {"model": "tiny-hf", "messages": messages, "tools": [calc], "max_tokens": 3}
        r = client.post("/v1/chat/completions", json=body | {"return_token_ids": True})
        assert r.status_code == 200, r.text
        prompt = bpe.decode(r.json()["prompt_token_ids"], skip_special_tokens=False)
        # BOS first, as tidal's SFT and environments encode a chat prompt.
        assert prompt == "<|bos|>TOOLS:calc;user: Hi\nassistant: "
