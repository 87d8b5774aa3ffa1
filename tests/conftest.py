import json
from pathlib import Path

import pytest


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
