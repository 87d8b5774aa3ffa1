"""Pre-training data: documents -> tokenizer -> packed token stream -> batches.

`build_data` is the one call a trainer makes:

1. `load_documents` reads the source named by `DataConfig.dataset` (never downloads: the
   Shakespeare corpus comes from `tidal fetch shakespeare`, see `fetch.py`).
2. `split_documents` holds out `val_fraction` of the text, as paragraph-aligned pieces of
   at most `split_piece_chars` chosen by content hash.
3. The tokenizer is trained on the train split (`tokenizer="bpe"`) or loaded from a file.
4. `encode_split` tokenizes each split once into `[bos] doc [eos]` runs and caches the ids.
5. `PackedLoader`s cut the streams into windows of `seq_len + 1` tokens.

Every step that costs time is cached under `DataConfig.cache_dir` and logs one line saying
whether it reused the cache or built it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tidal.train.data.config import DataConfig
from tidal.train.data.fetch import fetch_shakespeare, main_fetch, shakespeare_dir
from tidal.train.data.loader import Batch, PackedLoader
from tidal.train.data.packing import PackedSplit, encode_split
from tidal.train.data.sources import load_documents, split_documents
from tidal.train.data.tokenizer import Tokenizer, train_bpe
from tidal.train.loss import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "DataBundle",
    "DataConfig",
    "PackedLoader",
    "PackedSplit",
    "Tokenizer",
    "build_data",
    "build_tokenizer",
    "fetch_shakespeare",
    "main_fetch",
    "shakespeare_dir",
]


@dataclass(kw_only=True, slots=True)
class DataBundle:
    """What a trainer needs from the data pipeline."""

    tokenizer: Tokenizer
    """Encodes/decodes text; `tokenizer.vocab_size` sizes the model's embedding."""

    train: PackedLoader
    """Infinite, shuffled, resumable batches of the training split for this rank."""

    val: PackedLoader | None
    """Unshuffled batches of the validation split for this rank; use
    `val.iter_epoch(max_batches=n)` for the same n batches at every evaluation. None when
    `val_fraction == 0`."""


def build_data(
    cfg: DataConfig,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    dp_rank: int = 0,
    dp_world: int = 1,
    log: Callable[[str], None] = print,
) -> DataBundle:
    """Build the tokenizer and the train/val loaders for `cfg`, reusing cached work.

    Args:
        cfg: the data configuration.
        seq_len: tokens per row.
        batch_size: rows per batch on each rank.
        seed: seeds the training window order (not the train/val split, which is fixed by
            the documents' contents).
        dp_rank: this rank among `dp_world` data-parallel ranks; ranks get disjoint windows.
        dp_world: number of data-parallel ranks.
        log: receives one line per step (loaded, reused or built, with timings).

    Every data-parallel rank calls this with its own `dp_rank`. Caches are written atomically
    with the first writer winning, so ranks may build them concurrently on a first run; calling
    it on rank 0 first and then on the others after a barrier avoids the duplicated work.

    Raises:
        FileNotFoundError: missing data, corpus or tokenizer file.
        ValueError: malformed records, or a split too small for `seq_len`/`batch_size`.

    Example::

        data = build_data(DataConfig(), seq_len=256, batch_size=32, seed=0)
        batch = next(data.train)  # Batch of [32, 256] tensors
    """
    t0 = time.perf_counter()
    docs = load_documents(cfg)
    if not docs:
        raise ValueError(f"dataset={cfg.dataset!r} path={cfg.path!r} yielded no documents")
    train_docs, val_docs = split_documents(
        docs, cfg.val_fraction, piece_chars=cfg.split_piece_chars
    )
    mb = sum(len(d) for d in docs) / 1e6
    val_mb = sum(len(d) for d in val_docs) / 1e6
    grain = f"{cfg.split_piece_chars}-char pieces" if cfg.split_piece_chars else "documents"
    log(
        f"data: loaded {len(docs):,} {cfg.dataset} documents ({mb:.1f} MB) and split them by "
        f"{grain} into {len(train_docs):,} train / {len(val_docs):,} val documents "
        f"({val_mb:.2f} MB val) in {time.perf_counter() - t0:.2f}s"
    )

    cache = Path(cfg.cache_dir).expanduser()
    tokenizer = _tokenizer(cfg, train_docs, log)

    def loader(split_docs: list[str], name: str, shuffle: bool) -> PackedLoader:
        split = encode_split(split_docs, tokenizer, cache, name=name, log=log)
        return PackedLoader(
            split.tokens,
            split.doc_starts,
            seq_len=seq_len,
            batch_size=batch_size,
            seed=seed,
            shuffle=shuffle,
            dp_rank=dp_rank,
            dp_world=dp_world,
            name=name,
        )

    train = loader(train_docs, "train", shuffle=True)
    val = loader(val_docs, "val", shuffle=False) if val_docs else None
    return DataBundle(tokenizer=tokenizer, train=train, val=val)


def build_tokenizer(cfg: DataConfig, *, log: Callable[[str], None] = print) -> Tokenizer:
    """The tokenizer `build_data` builds for `cfg`, without encoding the corpus.

    A `tokenizer.json` path is loaded directly. For `tokenizer="bpe"` the documents are read
    and split as `build_data` does (the BPE is keyed by the training split), and the cached
    BPE is loaded, or trained once and cached.

    Raises:
        FileNotFoundError: missing data or tokenizer file.
        ValueError: no documents, or a malformed tokenizer file.

    Example::

        tok = build_tokenizer(get_config("debug").data)   # the debug run's BPE
    """
    if cfg.tokenizer != "bpe":
        return _tokenizer(cfg, [], log)
    docs = load_documents(cfg)
    if not docs:
        raise ValueError(f"dataset={cfg.dataset!r} path={cfg.path!r} yielded no documents")
    train_docs, _ = split_documents(docs, cfg.val_fraction, piece_chars=cfg.split_piece_chars)
    return _tokenizer(cfg, train_docs, log)


def _tokenizer(cfg: DataConfig, train_docs: list[str], log: Callable[[str], None]) -> Tokenizer:
    if cfg.tokenizer == "bpe":
        cache = Path(cfg.cache_dir).expanduser()
        return train_bpe(train_docs, cfg.vocab_size, cache / "tokenizers", log=log)
    t0 = time.perf_counter()
    tokenizer = Tokenizer.from_file(cfg.tokenizer)
    log(f"data: loaded tokenizer {cfg.tokenizer} {tokenizer} ({time.perf_counter() - t0:.2f}s)")
    return tokenizer
