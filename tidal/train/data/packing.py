"""Tokenize a split once and pack it into one flat token stream, cached on disk.

Text: each document becomes `[bos] + ids + [eos]`; the documents of a split are concatenated
into `tokens` (uint16 when the vocabulary fits, else uint32), and `doc_starts[i]` is the offset
of document i's BOS in `tokens`. The pair is saved as two `.npy` files under
`<cache_dir>/tokens/<key>/`, where the key hashes the documents and the tokenizer, and is
memory-mapped when reused, so ranks on one host share the pages.

Chat: each sample's ids (BOS first, from `ChatEncoder`) are concatenated the same way, with a
third array `loss_mask` (1 on assistant tokens). `pack_rows` then lays whole samples into rows
of `seq_len` tokens (first fit in order, the rest of a row padded), so the loader's windows
never cut a sample: a sample keeps its prompt, and no window starts inside an answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tidal.train.data.sources import corpus_hash
from tidal.train.data.tokenizer import Tokenizer, publish

if TYPE_CHECKING:
    from tidal.train.data.chat import ChatEncoder, Messages

_FORMAT = "tidal-packed-v1"
_CHAT_FORMAT = "tidal-chat-packed-v1"


@dataclass(kw_only=True, slots=True)
class PackedSplit:
    """One split as a flat token stream with its document boundaries."""

    tokens: np.ndarray
    """[N] token ids, uint16 or uint32."""

    doc_starts: np.ndarray
    """[num_docs] int64, strictly increasing offsets of each document's BOS; starts at 0."""

    loss_mask: np.ndarray | None = None
    """[N] uint8, 1 where a token is a training target (assistant turns of chat samples); None
    for text, where every token is."""


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
    key = f"{_FORMAT}|{corpus_hash(docs)}|{tokenizer.fingerprint()}"

    def build() -> PackedSplit:
        return pack(
            tokenizer.encode_batch(docs),
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
            vocab_size=tokenizer.vocab_size,
        )

    mb = sum(len(d) for d in docs) / 1e6
    what = f"{len(docs):,} documents ({mb:.1f} MB)"
    return _cached(
        key, build, tokenizer.vocab_size, cache_dir, name=name, what=what, masked=False, log=log
    )


def encode_chat_split(
    samples: Sequence[Messages],
    encoder: ChatEncoder,
    cache_dir: str | os.PathLike[str],
    *,
    name: str,
    wheres: Sequence[str] | Callable[[int], str],
    log: Callable[[str], None] | None = None,
) -> PackedSplit:
    """Render, tokenize and concatenate chat samples with their loss masks, or load them from
    the cache (keyed by the samples, the tokenizer and the template).

    `wheres` names each sample in errors (file:line). `doc_starts` are the samples' starts.
    """
    canonical = [json.dumps(m, sort_keys=True, ensure_ascii=False) for m in samples]
    key = f"{_CHAT_FORMAT}|{corpus_hash(canonical)}|{encoder.fingerprint()}"
    vocab_size = encoder.tokenizer.vocab_size

    def build() -> PackedSplit:
        ids, masks = encoder.encode_many(samples, wheres)
        dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        starts = np.zeros(len(ids), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        tokens = np.fromiter((t for x in ids for t in x), dtype=dtype, count=int(lengths.sum()))
        mask = np.fromiter((t for x in masks for t in x), dtype=np.uint8, count=len(tokens))
        return PackedSplit(tokens=tokens, doc_starts=starts, loss_mask=mask)

    what = f"{len(samples):,} chat samples"
    return _cached(key, build, vocab_size, cache_dir, name=name, what=what, masked=True, log=log)


def pack_rows(split: PackedSplit, seq_len: int, *, pad_id: int) -> tuple[PackedSplit, int]:
    """Lay the samples of a chat split into rows of `seq_len` tokens; returns the row-aligned
    split and how many samples were cut to `seq_len`.

    Samples go into rows in order, each into the current row if it fits, else into a new one;
    the tail of a row is padding (`pad_id`, mask 0, a document of its own). Row r is
    `tokens[r*seq_len : (r+1)*seq_len]`, and one padding token ends the stream, so the loader's
    window r (seq_len + 1 tokens from r*seq_len) is exactly row r plus the next row's first
    token, a BOS or padding, which is never a target. A sample longer than a row keeps its
    first `seq_len` tokens.
    """
    assert split.loss_mask is not None, "pack_rows lays out chat splits (with a loss mask)"
    T = seq_len
    starts = split.doc_starts.tolist()
    ends = [*starts[1:], len(split.tokens)]
    row_fill = 0  # tokens in the current row
    out_starts: list[int] = []  # (in the output) sample starts and padding starts
    placed: list[tuple[int, int, int]] = []  # (output offset, source start, length)
    cut = 0
    offset = 0
    for a, b in zip(starts, ends, strict=True):
        n = b - a
        if n > T:
            n, cut = T, cut + 1
        if row_fill + n > T:  # pad out this row (row_fill < T here: full rows are closed)
            out_starts.append(offset)
            offset += T - row_fill
            row_fill = 0
        out_starts.append(offset)
        placed.append((offset, a, n))
        offset += n
        row_fill = (row_fill + n) % T
    if row_fill:
        out_starts.append(offset)
        offset += T - row_fill
    total = offset + 1  # one padding token closes the last window
    tokens = np.full(total, pad_id, dtype=split.tokens.dtype)
    mask = np.zeros(total, dtype=np.uint8)
    for o, a, n in placed:
        tokens[o : o + n] = split.tokens[a : a + n]
        mask[o : o + n] = split.loss_mask[a : a + n]
    if out_starts[-1] != offset:
        out_starts.append(offset)  # the closing pad token is a document of its own
    doc_starts = np.asarray(out_starts, dtype=np.int64)
    return PackedSplit(tokens=tokens, doc_starts=doc_starts, loss_mask=mask), cut


def _cached(
    key: str,
    build: Callable[[], PackedSplit],
    vocab_size: int,
    cache_dir: str | os.PathLike[str],
    *,
    name: str,
    what: str,
    masked: bool,
    log: Callable[[str], None] | None,
) -> PackedSplit:
    """The split cached under `<cache_dir>/tokens/<hash of key>/`, or `build()` saved there."""
    t0 = time.perf_counter()
    folder = Path(cache_dir).expanduser() / "tokens" / hashlib.sha256(key.encode()).hexdigest()[:20]
    tokens_path, starts_path = folder / "tokens.npy", folder / "doc_starts.npy"
    mask_path = folder / "loss_mask.npy"
    split = None
    if tokens_path.is_file() and starts_path.is_file():
        try:
            split = _load_cached(
                tokens_path, starts_path, mask_path if masked else None, vocab_size
            )
        except ValueError as e:
            # A damaged cache entry (truncated copy, disk error) is rebuilt, never trusted.
            if log is not None:
                log(f"data: {name}: cached tokens in {folder} are unreadable ({e}); rebuilding")
            for p in (tokens_path, starts_path, mask_path):
                p.unlink(missing_ok=True)
    if split is not None:
        if log is not None:
            log(
                f"data: {name}: reused {len(split.tokens):,} cached tokens of "
                f"{len(split.doc_starts):,} documents from {folder} "
                f"({time.perf_counter() - t0:.2f}s)"
            )
        return split
    split = build()
    # doc_starts and the mask first: tokens.npy appearing is what marks the entry complete.
    publish(starts_path, lambda tmp: _save_npy(tmp, split.doc_starts))
    if split.loss_mask is not None:
        mask = split.loss_mask
        publish(mask_path, lambda tmp: _save_npy(tmp, mask))
    meta = {
        "format": key.split("|")[0],
        "documents": len(split.doc_starts),
        "tokens": len(split.tokens),
    }
    publish(folder / "meta.json", lambda tmp: _write_text(tmp, json.dumps(meta) + "\n"))
    publish(tokens_path, lambda tmp: _save_npy(tmp, split.tokens))
    if log is not None:
        log(
            f"data: {name}: encoded {what} into {len(split.tokens):,} tokens in "
            f"{time.perf_counter() - t0:.2f}s, cached in {folder}"
        )
    return split


def _save_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object, so np.save adds no ".npy" suffix
        np.save(f, array)


def _write_text(path: Path, text: str) -> None:
    path.write_text(text)


def _load_cached(
    tokens_path: Path, starts_path: Path, mask_path: Path | None, vocab_size: int
) -> PackedSplit:
    """Load a cache entry (with its loss mask when `mask_path` is given), checking it is
    whole; raises ValueError naming what is wrong."""
    try:
        tokens = np.load(tokens_path, mmap_mode="r")
        starts = np.load(starts_path)
        mask = np.load(mask_path, mmap_mode="r") if mask_path is not None else None
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"cannot read the cached arrays: {e}") from None
    if mask is not None and mask.shape != tokens.shape:
        raise ValueError("loss_mask does not match the token stream")
    if tokens.ndim != 1 or starts.ndim != 1 or len(starts) == 0 or starts[0] != 0:
        raise ValueError("unexpected array shapes")
    if starts[-1] >= len(tokens) or (len(starts) > 1 and not (np.diff(starts) > 0).all()):
        raise ValueError("document offsets do not fit the token stream")
    if len(tokens) and int(tokens[-1]) >= vocab_size:
        raise ValueError(f"token id {int(tokens[-1])} outside the vocabulary of {vocab_size}")
    return PackedSplit(tokens=tokens, doc_starts=starts, loss_mask=mask)
