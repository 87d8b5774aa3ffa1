"""Tokenize a split once and pack it into one flat token stream, cached on disk.

Each document becomes `[bos] + ids + [eos]`; the documents of a split are concatenated into
`tokens` (uint16 when the vocabulary fits, else uint32), and `doc_starts[i]` is the offset of
document i's BOS in `tokens`. The pair is saved as two `.npy` files under
`<cache_dir>/tokens/<key>/`, where the key hashes the documents and the tokenizer, and is
memory-mapped when reused, so ranks on one host share the pages.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tidal.train.data.sources import corpus_hash
from tidal.train.data.tokenizer import Tokenizer, publish

_FORMAT = "tidal-packed-v1"


@dataclass(kw_only=True, slots=True)
class PackedSplit:
    """One split as a flat token stream with its document boundaries."""

    tokens: np.ndarray
    """[N] token ids, uint16 or uint32."""

    doc_starts: np.ndarray
    """[num_docs] int64, strictly increasing offsets of each document's BOS; starts at 0."""


def pack(ids: Sequence[Sequence[int]], *, bos_id: int, eos_id: int, vocab_size: int) -> PackedSplit:
    """Concatenate `[bos] + ids + [eos]` for every document."""
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    lengths = np.fromiter((len(d) + 2 for d in ids), dtype=np.int64, count=len(ids))
    doc_starts = np.zeros(len(ids), dtype=np.int64)
    np.cumsum(lengths[:-1], out=doc_starts[1:])
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    for start, d in zip(doc_starts.tolist(), ids, strict=True):
        tokens[start] = bos_id
        tokens[start + 1 : start + 1 + len(d)] = d
        tokens[start + 1 + len(d)] = eos_id
    return PackedSplit(tokens=tokens, doc_starts=doc_starts)


def encode_split(
    docs: Sequence[str],
    tokenizer: Tokenizer,
    cache_dir: str | os.PathLike[str],
    *,
    name: str,
    log: Callable[[str], None] | None = None,
) -> PackedSplit:
    """Tokenize and pack `docs`, or load the result cached by an earlier call.

    Args:
        docs: the split's documents.
        tokenizer: encodes them.
        cache_dir: tidal's cache directory; results go under `<cache_dir>/tokens/`.
        name: split name for log lines ("train", "val").
        log: where one line saying built-or-reused (with timing) goes.
    """
    t0 = time.perf_counter()
    key = hashlib.sha256(
        f"{_FORMAT}|{corpus_hash(docs)}|{tokenizer.fingerprint()}".encode()
    ).hexdigest()[:20]
    folder = Path(cache_dir).expanduser() / "tokens" / key
    tokens_path, starts_path = folder / "tokens.npy", folder / "doc_starts.npy"
    split = None
    if tokens_path.is_file() and starts_path.is_file():
        try:
            split = _load_cached(tokens_path, starts_path, tokenizer.vocab_size)
        except ValueError as e:
            # A damaged cache entry (truncated copy, disk error) is rebuilt, never trusted.
            if log is not None:
                log(f"data: {name}: cached tokens in {folder} are unreadable ({e}); rebuilding")
            tokens_path.unlink(missing_ok=True)
            starts_path.unlink(missing_ok=True)
    if split is not None:
        if log is not None:
            log(
                f"data: {name}: reused {len(split.tokens):,} cached tokens of "
                f"{len(split.doc_starts):,} documents from {folder} "
                f"({time.perf_counter() - t0:.2f}s)"
            )
        return split
    split = pack(
        tokenizer.encode_batch(docs),
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        vocab_size=tokenizer.vocab_size,
    )
    # doc_starts first: tokens.npy appearing is what marks the entry complete.
    publish(starts_path, lambda tmp: _save_npy(tmp, split.doc_starts))
    meta = {"format": _FORMAT, "documents": len(docs), "tokens": len(split.tokens)}
    publish(folder / "meta.json", lambda tmp: _write_text(tmp, json.dumps(meta) + "\n"))
    publish(tokens_path, lambda tmp: _save_npy(tmp, split.tokens))
    if log is not None:
        mb = sum(len(d) for d in docs) / 1e6
        log(
            f"data: {name}: encoded {len(docs):,} documents ({mb:.1f} MB) into "
            f"{len(split.tokens):,} tokens in {time.perf_counter() - t0:.2f}s, cached in {folder}"
        )
    return split


def _save_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object, so np.save adds no ".npy" suffix
        np.save(f, array)


def _write_text(path: Path, text: str) -> None:
    path.write_text(text)


def _load_cached(tokens_path: Path, starts_path: Path, vocab_size: int) -> PackedSplit:
    """Load a cache entry, checking it is whole; raises ValueError naming what is wrong."""
    try:
        tokens = np.load(tokens_path, mmap_mode="r")
        starts = np.load(starts_path)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"cannot read {tokens_path.name} / {starts_path.name}: {e}") from None
    if tokens.ndim != 1 or starts.ndim != 1 or len(starts) == 0 or starts[0] != 0:
        raise ValueError("unexpected array shapes")
    if starts[-1] >= len(tokens) or (len(starts) > 1 and not (np.diff(starts) > 0).all()):
        raise ValueError("document offsets do not fit the token stream")
    if len(tokens) and int(tokens[-1]) >= vocab_size:
        raise ValueError(f"token id {int(tokens[-1])} outside the vocabulary of {vocab_size}")
    return PackedSplit(tokens=tokens, doc_starts=starts)
