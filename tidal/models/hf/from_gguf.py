"""llama.cpp GGUF files to Hugging Face checkpoint folders, with the `gguf` package alone.

`gguf_to_hf(gguf_path, folder)` writes config.json, model.safetensors (float32),
tokenizer.json, tokenizer_config.json and chat_template.jinja for a Llama-architecture GGUF
(SmolLM2 ships as one); `tidal fetch smollm2-135m` calls it. No transformers involved.

- Config: llama.cpp's `llama.*` metadata keys map to config.json fields and go through the
  Llama adapter's validation (tidal/models/hf/llama.py). float32 metadata values (eps, theta)
  are written in their shortest decimal form (1e-05, not 9.999999747378752e-06). Llama 3.1
  RoPE scaling, which llama.cpp stores as a `rope_freqs` tensor, is refused, and so are MoE
  and partial-RoPE files.
- Tensors: `gguf.quants.dequantize` expands each block-quantized tensor to float32, exactly
  (Q4_1: 32 weights share an fp16 scale d and minimum m, w = d * q + m; Q8_0: w = d * q).
  GGUF lists dims innermost first, so a file's [in, out] is numpy's row-major [out, in]. An
  absent `output.weight` means tied embeddings.
- q/k permutation: llama.cpp's converter reorders the rows of each head of `attn_q` and
  `attn_k` from Hugging Face's rotate-half pairs (i, i + K/2) to GGML's adjacent pairs
  (2i, 2i + 1): rows viewed as [heads, 2, K/2] are transposed to [heads, K/2, 2]. `unpermute`
  transposes them back. Quantization blocks run along a row, so reordering rows commutes
  with quantization and dequantize-then-unpermute is exact.
- Tokenizer (`tokenizer.ggml.model == "gpt2"`): byte-level BPE from `tokenizer.ggml.tokens`
  and `tokenizer.ggml.merges`; the pre-tokenizer follows `tokenizer.ggml.pre` as llama.cpp
  does: "smollm" splits digits one by one, then applies GPT-2's regex (SmolLM2's own
  tokenizer.json); "gpt2" is GPT-2's regex alone. Tokens of type CONTROL (3) become special
  added tokens. The chat template is `tokenizer.chat_template`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tidal.models.hf import llama
from tidal.models.hf.checkpoint import save_hf_state_dict
from tidal.models.hf.common import ConfigFields

_TOP = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}
_BLOCK = {
    "attn_norm": "attention_norm",
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
}
_CONTROL = 3  # llama.cpp's token type for special tokens
_PRE_TOKENIZERS = ("smollm", "gpt2")


def require_gguf():
    """The `gguf` module, or an ImportError that says what to install."""
    try:
        import gguf
    except ImportError as e:
        raise ImportError(
            "reading GGUF files needs the `gguf` package: pip install 'tidal[hf]'"
        ) from e
    return gguf


def unpermute(w_RD: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: each head's rows [K/2, 2] back to [2, K/2]."""
    R, D = w_RD.shape
    K = R // n_heads
    # [heads, K/2, 2, D] -> [heads, 2, K/2, D]: pair (2i, 2i+1) -> rows i and i + K/2.
    return w_RD.reshape(n_heads, K // 2, 2, D).transpose(1, 2).reshape(R, D)


def _short_float(x: float) -> float:
    """A float32 metadata value in its shortest decimal spelling (1e-05, not 9.99e-06)."""
    return float(str(np.float32(x)))


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata field of a GGUFReader as plain Python values."""
    return {name: field.contents() for name, field in reader.fields.items()}


def hf_config(meta: dict[str, Any], tensor_names: set[str], source: str) -> dict[str, Any]:
    """A Llama config.json for a GGUF file's metadata (validated by the Llama adapter)."""

    def refuse(key: str, value: Any, expected: str):
        raise ValueError(f"{source}: {key} = {value!r} is not supported; expected {expected}")

    arch = meta.get("general.architecture")
    if arch != "llama":
        refuse("general.architecture", arch, "'llama'")
    if meta.get("llama.expert_count"):
        refuse("llama.expert_count", meta["llama.expert_count"], "0 (a dense model)")
    if "rope_freqs.weight" in tensor_names:
        refuse("tensor rope_freqs.weight", "present", "none (Llama 3.1 RoPE scaling)")
    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        refuse("llama.rope.scaling.type", scaling, "'none'")

    def need(key: str) -> Any:
        if key not in meta:
            raise ValueError(f"{source}: metadata key {key!r} is missing")
        return meta[key]

    dim, n_heads = need("llama.embedding_length"), need("llama.attention.head_count")
    head_dim = meta.get("llama.attention.key_length", dim // n_heads)
    rope_dim = meta.get("llama.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        refuse("llama.rope.dimension_count", rope_dim, f"the head dim {head_dim} (full RoPE)")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config = {
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": need("llama.feed_forward_length"),
        "num_hidden_layers": need("llama.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "vocab_size": meta.get("llama.vocab_size", len(tokens)),
        "rms_norm_eps": _short_float(need("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _short_float(meta.get("llama.rope.freq_base", 10_000.0)),
        "max_position_embeddings": need("llama.context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if gguf_key in meta:
            config[hf_key] = meta[gguf_key]
    return config


def _tidal_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK and parts[3] == "weight":
        return f"layers.{parts[1]}.{_BLOCK[parts[2]]}.weight"
    return None


def gguf_state_dict(reader: Any, args: Any, source: str) -> dict[str, torch.Tensor]:
    """Dequantized float32 tensors under tidal's names, q/k rows in Hugging Face's order."""
    gguf = require_gguf()
    expected = set(llama.hf_names(args))
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _tidal_name(t.name)
        if name is None or name not in expected:
            raise ValueError(
                f"{source}: tensor {t.name!r} has no place in a {args.n_layers}-layer Llama"
            )
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists dims innermost first
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
        if not values.flags.writeable:  # float32 tensors come as views of the memory map
            values = values.copy()
        w = torch.from_numpy(values)
        if name.endswith("attention.wq.weight"):
            w = unpermute(w, args.n_heads)
        elif name.endswith("attention.wk.weight"):
            w = unpermute(w, args.n_kv_heads)
        sd[name] = w.clone() if not w.is_contiguous() else w
    missing = sorted(expected - set(sd))
    if missing:
        raise ValueError(f"{source}: tensors missing for a Llama model: {missing[:5]}")
    return sd


def gguf_tokenizer(meta: dict[str, Any], source: str):
    """A `tokenizers.Tokenizer` equal to the GGUF file's byte-level BPE tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{source}: tokenizer.ggml.model = {kind!r}; only 'gpt2' (byte-level BPE) is supported"
        )
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"{source}: tokenizer.ggml.pre = {pre!r}; supported: {list(_PRE_TOKENIZERS)}"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    merges = []
    for m in meta.get("tokenizer.ggml.merges", []):
        left, _, right = m.partition(" ")
        merges.append((left, right))
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # llama.cpp: each "\p{N}" alone first, then GPT-2's regex
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _CONTROL
        ]
    )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        b = tokens[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b}:0 $A:0", pair=f"{b}:0 $A:0 {b}:1 $B:1", special_tokens=[(b, bos)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: special tokens by name, BOS/EOS flags, the chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("pad_token", "padding_token_id"),
        ("unk_token", "unknown_token_id"),
    ):
        if f"tokenizer.ggml.{key}" in meta:
            out[name] = tokens[meta[f"tokenizer.ggml.{key}"]]
    if "llama.context_length" in meta:
        out["model_max_length"] = meta["llama.context_length"]
    if meta.get("tokenizer.chat_template"):
        out["chat_template"] = meta["tokenizer.chat_template"]
    return out


def gguf_to_hf(gguf_path: str | Path, folder: str | Path) -> Path:
    """Convert a Llama-architecture GGUF file into a Hugging Face checkpoint folder.

    Writes config.json, model.safetensors (float32 dequantized weights), tokenizer.json,
    tokenizer_config.json (with `chat_template`) and chat_template.jinja into `folder`.

    Raises:
        ImportError: `gguf` is not installed.
        ValueError: the file is not a dense Llama GGUF with a byte-level BPE tokenizer
            (the message names the metadata key or tensor).

    Example:
        >>> gguf_to_hf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2")  # doctest: +SKIP
        >>> model = load_hf("smollm2")  # doctest: +SKIP
    """
    gguf = require_gguf()
    path, out = Path(gguf_path), Path(folder)
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a readable GGUF file: {e}") from e
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = hf_config(meta, names, str(path))
    args = llama.model_args(ConfigFields(config, f"{path} (as config.json)"))
    tokenizer = gguf_tokenizer(meta, str(path))  # before the big work: fail early
    save_hf_state_dict(gguf_state_dict(reader, args, str(path)), args, out)
    tokenizer.save(str(out / "tokenizer.json"))
    tok_config = tokenizer_config(meta)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    if "chat_template" in tok_config:
        (out / "chat_template.jinja").write_text(tok_config["chat_template"])
    return out
