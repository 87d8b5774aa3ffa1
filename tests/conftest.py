import json
import os
from pathlib import Path

import pytest

# OpenMP threads with nothing to do sleep instead of spinning (torch's CPU kernels and MKL use
# libgomp, which reads this when torch is imported: tests import it after this file, and the
# processes they start inherit it). Spinning threads are harmless on an idle machine, but the
# tests run beside their own subprocesses and ranks on 2 cores, where a spinning thread holds
# the core its peer needs: measured at load 9, ten steps of the README's training example took
# 78 s spinning and 11 s passive. It changes how threads wait, not what they compute.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

USER_CACHE_DIR = Path(os.environ.get("TIDAL_CACHE_DIR") or "~/.cache/tidal").expanduser()
"""The user's tidal cache as it was before the tests set their own: read, never written, by
the tests of fetched models (SmolLM2), which skip or fetch into a temporary folder without."""


@pytest.fixture(scope="session", autouse=True)
def temporary_tidal_cache(tmp_path_factory):
    """Tests never write to the user's cache: every test of the session, and every process a
    test starts with this environment, gets a temporary tidal cache through TIDAL_CACHE_DIR
    (the default of `data.cache_dir`, `policy.cache_dir` and `tidal fetch --cache-dir`). One
    folder for the session, so a tokenizer a test trains from the default cache is trained
    once; a test that needs an empty cache passes its own `cache_dir`."""
    previous = os.environ.get("TIDAL_CACHE_DIR")
    os.environ["TIDAL_CACHE_DIR"] = str(tmp_path_factory.mktemp("tidal_home_cache"))
    yield
    if previous is None:
        os.environ.pop("TIDAL_CACHE_DIR", None)
    else:
        os.environ["TIDAL_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory) -> Path:
    """A few hundred KB of English prose from the standard library, as jsonl documents."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("corpus") / "topics.jsonl"
    with open(path, "w") as f:
        for name, text in sorted(topics.items()):
            f.write(json.dumps({"text": text, "name": name}) + "\n")
    return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tidal_cache")
