"""Training data: documents or chat samples -> tokenizer -> packed token stream -> batches.

`build_data` is the one call a trainer makes:

1. Each source (`DataConfig.dataset`, or every entry of `DataConfig.sources` for
   `interleave`) is read (never downloaded: the Shakespeare corpus comes from
   `tidal fetch shakespeare`, see `fetch.py`; arithmetic problems are generated in code).
   Format text reads documents; format chat reads lists of messages, checked one by one.
2. Each source is split into train and val: `split_documents` holds out `val_fraction` of the
   text as paragraph-aligned pieces chosen by content hash; chat samples are held out whole
   by hash; arithmetic problems by the hash of the problem (`arithmetic.split_of`).
3. The tokenizer is trained on the train splits (`tokenizer="bpe"`) or loaded from a file;
   for chat, the chat template is compiled and tried on a small conversation first.
4. `encode_split` / `encode_chat_split` tokenize each split once and cache the ids (chat:
   with a loss mask on assistant tokens; `pack_rows` then lays whole samples into rows).
5. A `PackedLoader` per source cuts windows of `seq_len + 1` tokens; several sources are
   mixed row by row by an `InterleavedLoader`.

Every step that costs time is cached under `DataConfig.cache_dir` and logs one line saying
whether it reused the cache or built it.
"""

from __future__ import annotations

import importlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.train.data import arithmetic
from tidal.train.data.chat import (
    ChatEncoder,
    ChatTemplate,
    Messages,
    check_messages,
    find_template,
    training_text,
)
from tidal.train.data.config import (
    CHAT_SPECIAL_TOKENS,
    SPECIAL_TOKENS,
    DataConfig,
    SourceConfig,
    parse_generator,
)
from tidal.train.data.fetch import fetch_shakespeare, main_fetch, shakespeare_dir
from tidal.train.data.loader import Batch, InterleavedLoader, PackedLoader
from tidal.train.data.packing import PackedSplit, encode_chat_split, encode_split, pack_rows
from tidal.train.data.sources import held_out, load_chats, load_documents, split_documents
from tidal.train.data.tokenizer import Tokenizer, train_bpe
from tidal.train.loss import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "ChatEncoder",
    "DataBundle",
    "DataConfig",
    "InterleavedLoader",
    "PackedLoader",
    "PackedSplit",
    "SourceConfig",
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

    train: PackedLoader | InterleavedLoader | None
    """Infinite, shuffled, resumable batches of the training split for this rank; None for a
    trainer whose caller passes its own batches to `Trainer.train_step` (RL)."""

    val: PackedLoader | InterleavedLoader | None
    """Unshuffled batches of the validation split for this rank; use
    `val.iter_epoch(max_batches=n)` for the same n batches at every evaluation. None when
    `val_fraction == 0`."""

    chat: ChatEncoder | None = None
    """Format chat: the template and tokenizer the samples were encoded with; use
    `chat.prompt_ids(messages)` to prompt the trained model the same way."""


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
    cache = Path(cfg.cache_dir).expanduser()
    tokenizer: Tokenizer | None = None
    template: ChatTemplate | None = None
    if cfg.tokenizer != "bpe":  # a file: load it first, it is cheap and may be wrong
        t0 = time.perf_counter()
        tokenizer = Tokenizer.from_file(cfg.tokenizer)
        log(f"data: loaded tokenizer {cfg.tokenizer} {tokenizer} ({time.perf_counter() - t0:.2f}s)")
    if cfg.is_chat:
        template = _chat_template(cfg, tokenizer)
        log(f"data: chat template {template.name}")

    splits = _read_splits(cfg, log)
    if tokenizer is None:  # train a BPE on every source's training text
        tokenizer = _train_bpe(cfg, splits, template, log)
    encoder = ChatEncoder(tokenizer, template) if template is not None else None

    def encode(part: Any, name: str) -> PackedSplit:
        if encoder is None:
            return encode_split(part, tokenizer, cache, name=name, log=log)
        samples, wheres = part
        split = encode_chat_split(samples, encoder, cache, name=name, wheres=wheres, log=log)
        rows, cut = pack_rows(split, seq_len, pad_id=tokenizer.eos_id)
        if cut:
            log(
                f"data: {name}: {cut:,} of {len(samples):,} samples are longer than "
                f"seq_len={seq_len} and were cut to it"
            )
        return rows

    def loader(part: Any, name: str, shuffle: bool, rows_per_batch: int) -> PackedLoader:
        split = encode(part, name)
        return PackedLoader(
            split.tokens,
            split.doc_starts,
            seq_len=seq_len,
            batch_size=rows_per_batch,
            seed=seed,
            shuffle=shuffle,
            dp_rank=dp_rank,
            dp_world=dp_world,
            name=name,
            loss_mask=split.loss_mask,
        )

    def has(part: Any) -> bool:
        return bool(part[0]) if encoder is not None else bool(part)

    if len(splits) == 1:
        _, train_part, val_part = splits[0]
        train = loader(train_part, "train", True, batch_size)
        val = loader(val_part, "val", False, batch_size) if has(val_part) else None
        return DataBundle(tokenizer=tokenizer, train=train, val=val, chat=encoder)

    def mix(which: int, name: str, shuffle: bool) -> InterleavedLoader | None:
        parts = [(i, s, p[which]) for i, (s, *p) in enumerate(splits) if has(p[which])]
        if not parts:
            return None
        loaders = [loader(p, f"{name} (source {i})", shuffle, 1) for i, _, p in parts]
        return InterleavedLoader(
            loaders,
            [s.weight for _, s, _ in parts],
            batch_size=batch_size,
            seed=seed,
            stopping_strategy=cfg.stopping_strategy,
            shuffle=shuffle,
            name=name,
        )

    train_mix = mix(0, "train", True)
    assert train_mix is not None, "every source has a training split"
    return DataBundle(tokenizer=tokenizer, train=train_mix, val=mix(1, "val", False), chat=encoder)


def build_tokenizer(cfg: DataConfig, *, log: Callable[[str], None] = print) -> Tokenizer:
    """The tokenizer `build_data` builds for `cfg`, without encoding the corpus.

    A `tokenizer.json` path is loaded directly. For `tokenizer="bpe"` the sources are read
    and split as `build_data` does (the BPE is keyed by the training text), and the cached
    BPE is loaded, or trained once and cached.

    Raises:
        FileNotFoundError: missing data or tokenizer file.
        ValueError: no documents, or a malformed tokenizer file.

    Example::

        tok = build_tokenizer(get_config("debug").data)   # the debug run's BPE
    """
    if cfg.tokenizer != "bpe":
        return Tokenizer.from_file(cfg.tokenizer)
    template = _chat_template(cfg, None) if cfg.is_chat else None
    return _train_bpe(cfg, _read_splits(cfg, log), template, log)


def _read_splits(
    cfg: DataConfig, log: Callable[[str], None]
) -> list[tuple[SourceConfig, Any, Any]]:
    """(source, train part, val part) of every source: (samples, wheres) for chat data,
    documents for text."""
    splits: list[tuple[SourceConfig, Any, Any]] = []
    for i, source in enumerate(cfg.source_list()):
        prefix = f"data: {_label(i, source)}: " if cfg.dataset == "interleave" else "data: "
        t0 = time.perf_counter()
        train_part: Any  # (samples, wheres) for chat, documents for text
        val_part: Any
        if cfg.is_chat:
            train_part, val_part = _chat_splits(cfg, source)
            log(
                f"{prefix}{len(train_part[0]):,} train / {len(val_part[0]):,} val chat samples "
                f"from {source.dataset} {source.path} in {time.perf_counter() - t0:.2f}s"
            )
        else:
            docs = load_documents(cfg, source)
            if not docs:
                raise ValueError(
                    f"dataset={source.dataset!r} path={source.path!r} yielded no documents"
                )
            train_part, val_part = split_documents(
                docs, cfg.val_fraction, piece_chars=cfg.split_piece_chars
            )
            mb = sum(len(d) for d in docs) / 1e6
            val_mb = sum(len(d) for d in val_part) / 1e6
            grain = f"{cfg.split_piece_chars}-char pieces" if cfg.split_piece_chars else "documents"
            log(
                f"{prefix}loaded {len(docs):,} {source.dataset} documents ({mb:.1f} MB) and "
                f"split them by {grain} into {len(train_part):,} train / {len(val_part):,} val "
                f"documents ({val_mb:.2f} MB val) in {time.perf_counter() - t0:.2f}s"
            )
        splits.append((source, train_part, val_part))

    return splits


def _train_bpe(
    cfg: DataConfig,
    splits: list[tuple[SourceConfig, Any, Any]],
    template: ChatTemplate | None,
    log: Callable[[str], None],
) -> Tokenizer:
    """tidal's BPE, trained on every source's training text (cached by that text)."""
    cache = Path(cfg.cache_dir).expanduser()
    if template is not None:
        texts = [training_text(template.render(m)) for _, (ms, _w), _v in splits for m in ms]
        extra: tuple[str, ...] = CHAT_SPECIAL_TOKENS
    else:
        texts = [d for _, docs, _v in splits for d in docs]
        extra = ()
    return train_bpe(texts, cfg.vocab_size, cache / "tokenizers", extra_specials=extra, log=log)


def _label(i: int, source: SourceConfig) -> str:
    return f"source {i} ({source.dataset}" + (f" {source.path})" if source.path else ")")


def _chat_template(cfg: DataConfig, tokenizer: Tokenizer | None) -> ChatTemplate:
    """The compiled chat template, tried on a small conversation (fails before any data)."""
    name, source = find_template(cfg.chat_template, None if tokenizer is None else cfg.tokenizer)
    if tokenizer is None:  # tidal's BPE, trained later: its specials are known
        bos, eos = SPECIAL_TOKENS
    else:
        bos, eos = tokenizer.token_text(tokenizer.bos_id), tokenizer.token_text(tokenizer.eos_id)
    template = ChatTemplate(source, name=name, bos_token=bos, eos_token=eos)
    template.check()
    return template


def _generated_splits(
    cfg: DataConfig, source: SourceConfig
) -> tuple[tuple[list[Messages], Any], tuple[list[Messages], Any]]:
    """The splits of a dataset="generated" source: its function called once per split
    (imported by name, so tidal/train imports nothing of the module it names)."""
    module_name, fn_name, spec = parse_generator(source.path)
    try:
        fn = getattr(importlib.import_module(module_name), fn_name, None)
    except ImportError as e:
        raise ValueError(
            f"DataConfig.path={source.path!r}: cannot import {module_name!r}: {e}"
        ) from None
    if not callable(fn):
        raise ValueError(f"DataConfig.path={source.path!r}: {module_name} has no {fn_name!r}")
    n_val = math.ceil(cfg.num_problems * cfg.val_fraction)
    parts = []
    for split, n in (("train", cfg.num_problems), ("val", n_val)):

        def where(i: int, split: str = split) -> str:
            return f"generated {split} sample {i} of {source.path}"

        chats = [check_messages(m, where(i)) for i, m in enumerate(fn(spec, n, split=split))]

        parts.append((chats, where))
    return parts[0], parts[1]


def _chat_splits(
    cfg: DataConfig, source: SourceConfig
) -> tuple[tuple[list[Messages], Any], tuple[list[Messages], Any]]:
    """((train samples, wheres), (val samples, wheres)) of one chat source."""
    if source.dataset == "arithmetic":
        forms = arithmetic.parse_spec(source.path, where="DataConfig.path")
        n_val = math.ceil(cfg.num_problems * cfg.val_fraction)
        out = []
        sizes: tuple[tuple[arithmetic.Split, int], ...] = (
            ("train", cfg.num_problems),
            ("val", n_val),
        )
        for split, n in sizes:
            problems = arithmetic.generate(forms, n, split=split)

            def where(i: int, problems: list[arithmetic.Problem] = problems) -> str:
                return f"arithmetic problem {problems[i].key}"

            out.append(([p.messages() for p in problems], where))
        return out[0], out[1]
    if source.dataset == "generated":
        return _generated_splits(cfg, source)
    samples, wheres = load_chats(cfg, source)
    if not samples:
        raise ValueError(f"dataset={source.dataset!r} path={source.path!r} yielded no chat samples")
    if cfg.val_fraction == 0:
        return (samples, wheres), ([], [])
    keys = [json.dumps(m, sort_keys=True, ensure_ascii=False) for m in samples]
    is_val = held_out(keys, cfg.val_fraction)
    if len(samples) < 2 or all(is_val):
        raise ValueError(
            f"cannot hold out val_fraction={cfg.val_fraction} of {len(samples)} chat samples of "
            f"{source.path!r} and keep some for training; add samples or set "
            "DataConfig.val_fraction=0"
        )
    train = (
        [m for m, v in zip(samples, is_val, strict=True) if not v],
        [w for w, v in zip(wheres, is_val, strict=True) if not v],
    )
    val = (
        [m for m, v in zip(samples, is_val, strict=True) if v],
        [w for w, v in zip(wheres, is_val, strict=True) if v],
    )
    return train, val
