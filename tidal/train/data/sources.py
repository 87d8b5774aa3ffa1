"""Documents from each kind of source, cut to a bounded length, and the train/val split.

A document is one string; `load_documents` returns them in a deterministic order (files
sorted by path, records in file order). `split_documents` holds out a fraction of the text for
validation, chosen by content hash among paragraph-aligned pieces, so the split does not move
when files are reordered or the training seed changes.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path

from tidal.train.data.config import DataConfig
from tidal.train.data.fetch import shakespeare_dir

_SUFFIXES: dict[str, tuple[str, ...]] = {
    "text": (".txt",),
    "jsonl": (".jsonl", ".json", ".jsonl.gz", ".json.gz"),
    "parquet": (".parquet",),
}
_INSTALL_HINT = "dataset={kind!r} needs `{module}`: pip install tidal[data]"


def load_documents(cfg: DataConfig) -> list[str]:
    """Read every document of `cfg.dataset` (before any cutting or splitting).

    Raises:
        FileNotFoundError: `cfg.path` (or the Shakespeare corpus) does not exist or holds no
            file of the expected kind.
        ValueError: a record lacks `cfg.text_field` or its value is not a string; a text file
            is not UTF-8.
        ImportError: `pyarrow`/`datasets` are missing for parquet/hf.
    """
    if cfg.dataset == "shakespeare":
        root = shakespeare_dir(cfg.cache_dir)
        return [_read_text(p) for p in sorted(root.glob("*.txt"))]
    if cfg.dataset == "hf":
        return _load_hf(cfg)
    files = resolve_files(cfg.path, _SUFFIXES[cfg.dataset], kind=cfg.dataset)
    docs: list[str] = []
    for f in files:
        if cfg.dataset == "text":
            docs.append(_read_text(f))
        elif cfg.dataset == "jsonl":
            docs.extend(_read_jsonl(f, cfg.text_field))
        else:
            docs.extend(_read_parquet(f, cfg.text_field))
    return docs


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


def _read_jsonl(path: Path, field: str) -> list[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    docs: list[str] = []
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
                    f"{path}:{lineno}: record has no field {field!r} (DataConfig.text_field); "
                    f"it has {keys}"
                )
            text = record[field]
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}:{lineno}: field {field!r} is {type(text).__name__}, expected a string"
                )
            docs.append(text)
    return docs


def _read_parquet(path: Path, field: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(_INSTALL_HINT.format(kind="parquet", module="pyarrow")) from e
    schema = pq.read_schema(path)
    if field not in schema.names:
        raise ValueError(
            f"{path}: no column {field!r} (DataConfig.text_field); it has {schema.names}"
        )
    column = pq.read_table(path, columns=[field]).column(field).to_pylist()
    return _check_strings(column, field, str(path))


def _check_strings(values: list[object], field: str, where: str) -> list[str]:
    for row, v in enumerate(values):
        if not isinstance(v, str):
            raise ValueError(
                f"{where}: row {row}: column {field!r} is {type(v).__name__}, expected a string"
            )
    return values  # type: ignore[return-value]


_HF_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".gz": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".txt": "text",
    ".arrow": "arrow",
}


def _load_hf(cfg: DataConfig) -> list[str]:
    """`datasets` on local data only: a `save_to_disk` folder, a data folder, a file or a glob.

    Uses the `train` split when there is one, else the only split; tidal makes its own
    validation split.
    """
    try:
        import datasets
    except ImportError as e:
        raise ImportError(_INSTALL_HINT.format(kind="hf", module="datasets")) from e
    p = Path(cfg.path).expanduser()
    hf_cache = str(Path(cfg.cache_dir).expanduser() / "hf_datasets")
    if p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
        ds = datasets.load_from_disk(str(p))
    elif p.is_dir():
        ds = datasets.load_dataset(str(p), cache_dir=hf_cache)
    else:
        files = resolve_files(cfg.path, tuple(_HF_BUILDERS), kind="hf")
        suffix = files[0].suffix
        if suffix not in _HF_BUILDERS:
            raise ValueError(
                f"DataConfig.path={cfg.path!r}: cannot tell the format of {files[0]}; "
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
                f"DataConfig.path={cfg.path!r} has splits {sorted(ds)} and none is 'train'"
            )
    if cfg.text_field not in ds.column_names:
        raise ValueError(
            f"{cfg.path}: no column {cfg.text_field!r} (DataConfig.text_field); "
            f"it has {ds.column_names}"
        )
    return _check_strings(list(ds[cfg.text_field]), cfg.text_field, cfg.path)


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
    n_val = math.ceil(len(pieces) * val_fraction)
    digests = [hashlib.sha256(p.encode("utf-8")).digest() for _, p in pieces]
    ranked = sorted(range(len(pieces)), key=digests.__getitem__)
    is_val = [False] * len(pieces)
    for rank, i in enumerate(ranked):
        if rank >= n_val and digests[i] != digests[ranked[rank - 1]]:
            break
        is_val[i] = True
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
