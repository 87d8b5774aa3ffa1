"""Fixtures of the server tests: a tiny seed-initialized model with a chat BPE (ChatML
specials), its Engine and Served model, and a real uvicorn server on a loopback port."""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tidal.generate import Generator, GeneratorConfig
from tidal.models import Transformer, get_flavor
from tidal.serve.api import Served
from tidal.serve.chat import ChatFormat
from tidal.serve.engine import Engine
from tidal.train.data import DataConfig, build_tokenizer
from tidal.train.data.chat import build_encoder

# Without the serve extra (FastAPI, uvicorn) and the test set-up's clients there is nothing
# to test here (`make setup-test` installs them).
_NEEDS = ("fastapi", "uvicorn", "httpx", "openai")
collect_ignore_glob = [] if all(importlib.util.find_spec(m) for m in _NEEDS) else ["test_*.py"]

MODEL = "tiny-chat"
CONTEXT = 768


@pytest.fixture(autouse=True)
def one_thread():
    """Many tiny ops on a shared 2-core machine: one torch thread (as tests/generate do)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    """A byte-level BPE with the ChatML specials, trained on generated addition chats."""
    cfg = DataConfig(
        dataset="arithmetic",
        path="add:1-2",
        format="chat",
        tokenizer="bpe",
        vocab_size=384,
        num_problems=500,
        cache_dir=str(tmp_path_factory.mktemp("serve_tok")),
    )
    return build_tokenizer(cfg, log=lambda line: None)


@pytest.fixture(scope="session")
def tiny_model():
    with torch.device("meta"):
        model = Transformer(get_flavor("tiny", max_seq_len=CONTEXT))
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def make_served(model, tokenizer, *, max_batch: int = 16, **config) -> Served:
    generator = Generator(
        model, tokenizer=tokenizer, config=GeneratorConfig(max_batch=max_batch, **config)
    )
    chat = ChatFormat(build_encoder(tokenizer, "", None))
    return Served(
        MODEL, Engine(generator), lambda text: [tokenizer.bos_id, *tokenizer.encode(text)], chat
    )


@pytest.fixture
def served(tiny_model, chat_tokenizer) -> Served:
    return make_served(tiny_model, chat_tokenizer)


@contextmanager
def uvicorn_server(app) -> Iterator[str]:
    """Serve `app` with uvicorn on an ephemeral 127.0.0.1 port; yields its /v1 base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(30)
