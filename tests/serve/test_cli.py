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
                    assert rel == "cli.py", f"tidal/{rel} imports {name}"
