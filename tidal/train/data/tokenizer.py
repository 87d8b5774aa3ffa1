"""Tokenizers: a byte-level BPE trained on the fly, or any Hugging Face `tokenizer.json`.

Text is encoded without the tokenizer's own template (no automatic BOS/EOS) and with special
tokens written in the text treated as plain text, so a document containing "<|eos|>" cannot
inject a real EOS. The packer adds `bos_id` and `eos_id` itself. Rendered chat templates are
the exception: they write their turn markers as text, so `encode(..., special_tokens=True)`
reads special tokens as control tokens (tidal/train/data/chat.py).

tidal's own BPE splits digits one by one before the byte-level pre-tokenizer (as Qwen's and
DeepSeek's tokenizers do), so numbers are spelled digit by digit, which arithmetic needs.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from tidal.train.data.config import MIN_BPE_VOCAB, SPECIAL_TOKENS
from tidal.train.data.sources import corpus_hash

#: Tokens recognized as beginning/end of sequence in a `tokenizer.json`, most specific first.
BOS_CANDIDATES: tuple[str, ...] = (
    "<|bos|>",
    "<|begin_of_text|>",
    "<s>",
    "<bos>",
    "<|startoftext|>",
)
EOS_CANDIDATES: tuple[str, ...] = (
    "<|eos|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "</s>",
    "<eos>",
)

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_ENCODE_CHUNK = 1024  # documents per encode_batch call, bounds peak memory of Encodings


class Tokenizer:
    """A `tokenizers.Tokenizer` with the ids tidal needs.

    Attributes:
        vocab_size: one more than the largest token id (size the embedding with this).
        bos_id: id prepended to every document.
        eos_id: id appended to every document.

    Example::

        tok = Tokenizer.from_file("tokenizer.json")
        ids = tok.encode("To be, or not to be")
        assert tok.decode(ids) == "To be, or not to be"
    """

    __slots__ = ("_special", "_specials_tok", "_tok", "bos_id", "eos_id", "vocab_size")

    def __init__(self, tok: tokenizers.Tokenizer, *, bos_id: int, eos_id: int) -> None:
        self._tok = tok
        # Special tokens written in documents are encoded as text, never as control tokens.
        self._tok.encode_special_tokens = True
        self._specials_tok: tokenizers.Tokenizer | None = None  # a copy that parses them
        self.bos_id = bos_id
        self.eos_id = eos_id
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self._special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a Hugging Face `tokenizer.json`.

        BOS is the first token of `BOS_CANDIDATES` in the vocabulary and EOS the first of
        `EOS_CANDIDATES`. When only an EOS exists (GPT-2's `<|endoftext|>`), it doubles as BOS,
        as GPT-2 does.

        Raises:
            FileNotFoundError: no file at `path`.
            ValueError: the file is not a tokenizer, or has no EOS candidate.
        """
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {p} (DataConfig.tokenizer)")
        try:
            tok = tokenizers.Tokenizer.from_file(str(p))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"{p} is not a Hugging Face tokenizer.json: {e}") from e
        vocab = tok.get_vocab(with_added_tokens=True)
        eos = next((t for t in EOS_CANDIDATES if t in vocab), None)
        if eos is None:
            specials = sorted(t for t in vocab if t.startswith("<") and t.endswith(">"))[:20]
            raise ValueError(
                f"{p}: no end-of-sequence token; looked for {list(EOS_CANDIDATES)}, "
                f"found special-looking tokens {specials}"
            )
        bos = next((t for t in BOS_CANDIDATES if t in vocab), eos)
        return cls(tok, bos_id=vocab[bos], eos_id=vocab[eos])

    def _backend(self, special_tokens: bool) -> tokenizers.Tokenizer:
        if not special_tokens:
            return self._tok
        if self._specials_tok is None:
            self._specials_tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
            self._specials_tok.encode_special_tokens = False
        return self._specials_tok

    def encode(self, text: str, *, special_tokens: bool = False) -> list[int]:
        """Token ids of `text`, without BOS/EOS. `special_tokens=True` reads special tokens
        written in the text (`<|im_end|>`) as control tokens, for rendered chat templates."""
        return self._backend(special_tokens).encode(text, add_special_tokens=False).ids

    def encode_batch(
        self, texts: Sequence[str], *, special_tokens: bool = False
    ) -> list[list[int]]:
        """`encode` on many texts, in parallel threads inside `tokenizers`."""
        tok = self._backend(special_tokens)
        # encode_batch_fast (tokenizers >= 0.21) skips offsets; same ids.
        encode_batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
        out: list[list[int]] = []
        for i in range(0, len(texts), _ENCODE_CHUNK):
            chunk = list(texts[i : i + _ENCODE_CHUNK])
            out.extend(e.ids for e in encode_batch(chunk, add_special_tokens=False))
        return out

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special (control) token such as BOS, EOS or `<|im_end|>`."""
        return token_id in self._special

    def token_id(self, text: str) -> int | None:
        """The id of the token spelled `text` (`<|im_end|>`), or None if there is none."""
        return self._tok.token_to_id(text)

    def token_text(self, token_id: int) -> str:
        """The text of one token as the vocabulary spells it (`<|bos|>`)."""
        text = self._tok.id_to_token(token_id)
        assert text is not None, f"token id {token_id} is not in the vocabulary"
        return text

    def byte_fallback_ids(self) -> frozenset[int]:
        """The ids of byte-fallback tokens (`<0x00>` to `<0xFF>`, SentencePiece-style
        vocabularies: runs of them decode together into characters); none in a byte-level
        BPE."""
        vocab = self._tok.get_vocab(with_added_tokens=False)
        return frozenset(i for t, i in vocab.items() if _BYTE_TOKEN.fullmatch(t))

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; BOS/EOS and other special tokens are dropped unless asked for."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the tokenizer as a Hugging Face `tokenizer.json`."""
        self._tok.save(str(path))

    def fingerprint(self) -> str:
        """sha256 of the serialized tokenizer and the BOS/EOS choice; keys encoded-id caches."""
        h = hashlib.sha256(self._tok.to_str().encode("utf-8"))
        h.update(f"bos={self.bos_id},eos={self.eos_id}".encode())
        return h.hexdigest()

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"
        )


def new_bpe_tokenizer() -> tokenizers.Tokenizer:
    """An untrained byte-level BPE: digits split one by one, then GPT-2's pre-tokenization
    regex, no prefix space."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(
    documents: Sequence[str],
    vocab_size: int,
    cache_dir: str | os.PathLike[str],
    *,
    extra_specials: Sequence[str] = (),
    log: Callable[[str], None] | None = None,
) -> Tokenizer:
    """Train a byte-level BPE with specials `<|bos|>` (id 0) and `<|eos|>` (id 1), then
    `extra_specials` (ids 2, 3, ...), or load it.

    The result is cached as `<cache_dir>/bpe-<vocab_size>-<hash>.json`, keyed by the corpus,
    `vocab_size`, the specials and the `tokenizers` version; a second call with the same inputs
    loads it. Every byte sequence has an encoding and decoding round-trips any text.

    Raises:
        ValueError: `vocab_size` below 256 + the specials, or no documents.
    """
    specials = [*SPECIAL_TOKENS, *extra_specials]
    if vocab_size < MIN_BPE_VOCAB + len(extra_specials):
        raise ValueError(
            f"vocab_size must be >= {MIN_BPE_VOCAB + len(extra_specials)}, got {vocab_size}"
        )
    if not documents:
        raise ValueError("cannot train a BPE tokenizer on zero documents")
    key = hashlib.sha256(
        f"{corpus_hash(documents)}|{vocab_size}|tokenizers={tokenizers.__version__}|digits=1|"
        f"specials={','.join(specials)}".encode()
    ).hexdigest()[:16]
    path = Path(cache_dir).expanduser() / f"bpe-{vocab_size}-{key}.json"
    t0 = time.perf_counter()
    if not path.is_file():
        tok = new_bpe_tokenizer()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(documents, trainer=trainer, length=len(documents))
        publish(path, lambda tmp: tok.save(str(tmp)))
        if log is not None:
            mb = sum(len(d) for d in documents) / 1e6
            log(
                f"data: trained byte-level BPE (vocab {vocab_size}) on {len(documents)} documents "
                f"({mb:.1f} MB) in {time.perf_counter() - t0:.1f}s -> {path}"
            )
    elif log is not None:
        log(f"data: reused cached tokenizer {path}")
    # Load what is on disk, so concurrent ranks that trained in parallel agree on one file.
    tokenizer = _load_trained(path)
    if tokenizer.vocab_size < vocab_size and log is not None:
        log(
            f"data: the corpus supports only {tokenizer.vocab_size} of the {vocab_size} "
            "requested tokens; tokenizer.vocab_size is the real size"
        )
    return tokenizer


def _load_trained(path: Path) -> Tokenizer:
    tok = tokenizers.Tokenizer.from_file(str(path))
    bos, eos = (tok.token_to_id(t) for t in SPECIAL_TOKENS)
    assert bos is not None and eos is not None, f"{path} lacks {SPECIAL_TOKENS}"
    return Tokenizer(tok, bos_id=bos, eos_id=eos)


def publish(path: Path, write: Callable[[Path], None]) -> bool:
    """Create `path` atomically via `write(tmp)`; first writer wins.

    Returns True if this call created `path`, False if another process did first (this
    process's file is discarded, so every process then reads the same bytes).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        try:
            os.link(tmp, path)  # fails if path exists, unlike os.replace
        except FileExistsError:
            return False
        except OSError:
            # Documented fallback for file systems without hard links: last writer wins.
            os.replace(tmp, path)
        return True
    finally:
        tmp.unlink(missing_ok=True)
