"""Documents and chat samples from each kind of source, cut to a bounded length, and the
train/val split.

A document is one string; `load_documents` returns them in a deterministic order (files
sorted by path, records in file order). A chat sample is a list of messages; `load_chats` reads
them the same way and checks each (tidal/train/data/chat.py). `split_documents` holds out a
fraction of the text for validation, chosen by content hash among paragraph-aligned pieces, so
the split does not move when files are reordered or the training seed changes.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

from tidal.train.data.chat import Messages, check_messages
from tidal.train.data.config import DataConfig, SourceConfig
from tidal.train.data.fetch import shakespeare_dir

_SUFFIXES: dict[str, tuple[str, ...]] = {
    "text": (".txt",),
    "jsonl": (".jsonl", ".json", ".jsonl.gz", ".json.gz"),
    "parquet": (".parquet",),
}
_INSTALL_HINT = "dataset={kind!r} needs `{module}`: pip install tidal[data]"


def load_documents(cfg: DataConfig, source: SourceConfig | None = None) -> list[str]:
    """Read every document of `source` (default: the top-level source of `cfg`), before any
    cutting or splitting.

    Raises:
        FileNotFoundError: the path (or the Shakespeare corpus) does not exist or holds no
            file of the expected kind.
        ValueError: a record lacks the text field or its value is not a string; a text file
            is not UTF-8.
        ImportError: `pyarrow`/`datasets` are missing for parquet/hf.
    """
    source = source or cfg.source_list()[0]
    if source.dataset == "shakespeare":
        root = shakespeare_dir(cfg.cache_dir)
        return [_read_text(p) for p in sorted(root.glob("*.txt"))]
    if source.dataset == "text":
        files = resolve_files(source.path, _SUFFIXES["text"], kind="text")
        return [_read_text(f) for f in files]
    docs: list[str] = []
    for value, where in _records(source, cfg.cache_dir, "DataConfig.text_field"):
        if not isinstance(value, str):
            raise ValueError(
                f"{where}: field {source.field!r} is {type(value).__name__}, expected a string"
            )
        docs.append(value)
    return docs


def load_chats(cfg: DataConfig, source: SourceConfig) -> tuple[list[Messages], list[str]]:
    """The chat samples of a jsonl/parquet/hf `source` and where each comes from
    (`file:line`), every one checked by `chat.check_messages`.

    Raises:
        FileNotFoundError, ImportError: as `load_documents`.
        ValueError: a record without the messages field, or a malformed sample (not a list of
            role/content messages, or no assistant turn), naming the file and line or row.
    """
    if source.dataset in ("shakespeare", "text", "arithmetic", "generated"):
        raise ValueError(f"dataset={source.dataset!r} has no chat records to read")
    samples: list[Messages] = []
    wheres: list[str] = []
    for value, where in _records(source, cfg.cache_dir, "DataConfig.messages_field"):
        samples.append(check_messages(value, where))
        wheres.append(where)
    return samples, wheres


def _records(
    source: SourceConfig, cache_dir: str, field_setting: str
) -> Iterator[tuple[object, str]]:
    """(value of `source.field`, "file:line") of every record of a jsonl/parquet/hf source."""
    if source.dataset == "hf":
        yield from _hf_records(source, cache_dir, field_setting)
        return
    files = resolve_files(source.path, _SUFFIXES[source.dataset], kind=source.dataset)
    for f in files:
        if source.dataset == "jsonl":
            yield from _jsonl_records(f, source.field, field_setting)
        else:
            yield from _parquet_records(f, source.field, field_setting)


def resolve_files(path: str, suffixes: Sequence[str], *, kind: str) -> list[Path]:
    """Expand a file, a directory (recursive, files ending in `suffixes`) or a glob.

    Returns the files sorted by path. A file named explicitly is taken whatever its suffix.

    Raises:
        FileNotFoundError: nothing exists at `path`, or it matches no file.
    """
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(tuple(suffixes)))
        if not files:
            raise FileNotFoundError(
                f"DataConfig.path={path!r} (dataset={kind!r}) is a directory with no "
                f"{'/'.join(suffixes)} files"
            )
        return files
    if glob.has_magic(str(p)):
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        if not files:
            raise FileNotFoundError(f"DataConfig.path={path!r} (dataset={kind!r}) matches no file")
        return files
    raise FileNotFoundError(f"DataConfig.path={path!r} (dataset={kind!r}) does not exist")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: {e}") from e


def _jsonl_records(path: Path, field: str, setting: str) -> Iterator[tuple[object, str]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from e
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{path}:{lineno}: record has no field {field!r} ({setting}); it has {keys}"
                )
            yield record[field], f"{path}:{lineno}"


def _parquet_records(path: Path, field: str, setting: str) -> Iterator[tuple[object, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(_INSTALL_HINT.format(kind="parquet", module="pyarrow")) from e
    schema = pq.read_schema(path)
    if field not in schema.names:
        raise ValueError(f"{path}: no column {field!r} ({setting}); it has {schema.names}")
    column = pq.read_table(path, columns=[field]).column(field).to_pylist()
    for row, value in enumerate(column):
        yield value, f"{path}: row {row}"


_HF_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".gz": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".txt": "text",
    ".arrow": "arrow",
}


def _hf_records(source: SourceConfig, cache_dir: str, setting: str) -> Iterator[tuple[object, str]]:
    """`datasets` on local data only: a `save_to_disk` folder, a data folder, a file or a glob.

    Uses the `train` split when there is one, else the only split; tidal makes its own
    validation split.
    """
    try:
        import datasets
    except ImportError as e:
        raise ImportError(_INSTALL_HINT.format(kind="hf", module="datasets")) from e
    p = Path(source.path).expanduser()
    hf_cache = str(Path(cache_dir).expanduser() / "hf_datasets")
    if p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
        ds = datasets.load_from_disk(str(p))
    elif p.is_dir():
        ds = datasets.load_dataset(str(p), cache_dir=hf_cache)
    else:
        files = resolve_files(source.path, tuple(_HF_BUILDERS), kind="hf")
        suffix = files[0].suffix
        if suffix not in _HF_BUILDERS:
            raise ValueError(
                f"DataConfig.path={source.path!r}: cannot tell the format of {files[0]}; "
                f"expected one of {sorted(_HF_BUILDERS)}"
            )
        ds = datasets.load_dataset(
            _HF_BUILDERS[suffix], data_files=[str(f) for f in files], cache_dir=hf_cache
        )
    if isinstance(ds, datasets.DatasetDict):
        if "train" in ds:
            ds = ds["train"]
        elif len(ds) == 1:
            ds = next(iter(ds.values()))
        else:
            raise ValueError(
                f"DataConfig.path={source.path!r} has splits {sorted(ds)} and none is 'train'"
            )
    if source.field not in ds.column_names:
        raise ValueError(
            f"{source.path}: no column {source.field!r} ({setting}); it has {ds.column_names}"
        )
    for row, value in enumerate(ds[source.field]):
        yield value, f"{source.path}: row {row}"


def cut_document(text: str, max_chars: int) -> list[str]:
    """Cut `text` into pieces of at most `max_chars` whose concatenation is `text`.

    Each cut falls after the last blank line of the window if there is one, else after the last
    newline, else at `max_chars`. Whitespace-only pieces are dropped. `max_chars == 0` keeps
    `text` whole.
    """
    if max_chars == 0 or len(text) <= max_chars:
        return [text] if text.strip() else []
    pieces: list[str] = []
    pos = 0
    while len(text) - pos > max_chars:
        window = text[pos : pos + max_chars]
        cut = window.rfind("\n\n")
        if cut > 0:
            cut += 2
        else:
            cut = window.rfind("\n") + 1 or max_chars
        pieces.append(text[pos : pos + cut])
        pos += cut
    pieces.append(text[pos:])
    return [p for p in pieces if p.strip()]


def split_documents(
    docs: Sequence[str], val_fraction: float, *, piece_chars: int = 0
) -> tuple[list[str], list[str]]:
    """Deterministic train/val split by content hash, at a finer grain than documents.

    1. Each document is cut into pieces of at most `piece_chars` characters (`cut_document`;
       0 keeps documents whole).
    2. Pieces are ranked by sha256 and the lowest go to validation until it holds
       `ceil(num_pieces * val_fraction)` of them. Copies of a piece share a hash, so they land
       on the same side (and can push validation slightly over its share).
    3. Consecutive pieces of one document on the same side are joined back. A document none
       of whose pieces was held out comes back whole, so training documents are broken only
       where validation text was taken out of them.

    Both splits keep the input order. The split depends on no seed and on no document's
    position, so it is stable across runs and across reordering of the input files.

    Raises:
        ValueError: `val_fraction > 0` and one split would be empty.
    """
    pieces = [(d, piece) for d, doc in enumerate(docs) for piece in cut_document(doc, piece_chars)]
    if val_fraction == 0:
        return _join_runs(pieces, [True] * len(pieces)), []
    is_val = held_out([p for _, p in pieces], val_fraction)
    if len(pieces) < 2 or all(is_val):
        raise ValueError(
            f"cannot hold out val_fraction={val_fraction} of {len(pieces)} pieces "
            f"(documents cut to <= {piece_chars or 'unlimited'} chars) and keep some for "
            "training; add documents, lower DataConfig.split_piece_chars, or set "
            "DataConfig.val_fraction=0"
        )
    train = _join_runs(pieces, [not v for v in is_val])
    val = _join_runs(pieces, is_val)
    return train, val


def held_out(keys: Sequence[str], val_fraction: float) -> list[bool]:
    """Which of `keys` go to validation: the `ceil(len * val_fraction)` lowest sha256 digests
    (and every copy of the last one taken), so the choice depends on contents only."""
    n_val = math.ceil(len(keys) * val_fraction)
    digests = [hashlib.sha256(k.encode("utf-8")).digest() for k in keys]
    ranked = sorted(range(len(keys)), key=digests.__getitem__)
    is_val = [False] * len(keys)
    for rank, i in enumerate(ranked):
        if rank >= n_val and digests[i] != digests[ranked[rank - 1]]:
            break
        is_val[i] = True
    return is_val


def _join_runs(pieces: Sequence[tuple[int, str]], keep: Sequence[bool]) -> list[str]:
    """Join the kept pieces, one string per run of consecutive kept pieces of a document."""
    runs: list[list[str]] = []
    prev_doc, prev_kept = -1, False
    for (d, piece), k in zip(pieces, keep, strict=True):
        if k:
            if prev_kept and d == prev_doc:
                runs[-1].append(piece)
            else:
                runs.append([piece])
        prev_doc, prev_kept = d, k
    return ["".join(run) for run in runs]


def corpus_hash(docs: Sequence[str]) -> str:
    """sha256 hex digest of a list of documents (order and boundaries included)."""
    h = hashlib.sha256()
    for d in docs:
        b = d.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()
