"""What the family adapters share: the Llama-style decoder's config.json fields and tensor names.

Every family tidal loads (llama.py, qwen2.py, qwen3.py, qwen3_moe.py) is Llama's decoder with
a few switches: q/k/v biases (Qwen 2), QK-norm (Qwen 3), a mixture of experts in place of the
MLP (Qwen 3 MoE). The fields and names they have in common are read, written and listed here,
in the order transformers writes them; a family's adapter passes its switches, its defaults
and its extra fields, and keeps its own checks. `model_args`, `hf_config` and `hf_names` here
are what an adapter's functions of the same names call; this module is not an adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tidal.models.hf.common import (
    ConfigFields,
    HFName,
    build_args,
    rope_from_config,
    rope_to_config,
    token_ids,
)
from tidal.models.moe import MoEArgs
from tidal.models.transformer import ModelArgs

# ---------------------------------------------------------------------------------------
# config.json -> ModelArgs


def refuse_sliding_windows(c: ConfigFields, *also_false: str) -> None:
    """Refuse an active sliding window: `use_sliding_window` (then each of `also_false`) must
    be false or absent, and `layer_types`, when given, full attention for every layer."""
    for key in ("use_sliding_window", *also_false):
        c.expect(key, (False,))
    layer_types = c.raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        c.refuse("layer_types", layer_types, "'full_attention' for every layer")


def model_args(
    c: ConfigFields,
    family: str,
    *,
    max_seq_len: int,
    head_dim: int | None = None,
    implicit_head_dim: bool = False,
    ffn_dim: int | None = None,
    moe: Callable[[ConfigFields], MoEArgs] | None = None,
    kept: Mapping[str, Any] | None = None,
    **fields: Any,
) -> ModelArgs:
    """ModelArgs of a decoder's config.json, from the fields every family has.

    Args:
        max_seq_len: `max_position_embeddings` when absent.
        head_dim: `head_dim` when absent; None for hidden_size / heads.
        implicit_head_dim: leave `ModelArgs.head_dim` None when it equals hidden_size / heads.
        ffn_dim: `intermediate_size` when absent; None where the field is required.
        moe: reads the family's expert fields (after the RoPE fields) into `ModelArgs.moe`.
        kept: more config fields for `ModelArgs.extra["hf"]` (with the token ids).
        fields: the family's fixed ModelArgs fields (`qkv_bias=True`, `qk_norm=True`).
    """
    dim, n_heads = c.required("hidden_size"), c.required("num_attention_heads")
    k = c.integer("head_dim", head_dim or dim // n_heads)
    seq_len = c.integer("max_position_embeddings", max_seq_len)
    rope_theta, rope_scaling = rope_from_config(c, seq_len)
    if moe is not None:
        fields["moe"] = moe(c)
    return build_args(
        c,
        family=family,
        dim=dim,
        n_layers=c.required("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=c.integer("num_key_value_heads", n_heads),
        head_dim=None if implicit_head_dim and k * n_heads == dim else k,
        ffn_dim=c.integer("intermediate_size", ffn_dim),
        vocab_size=c.required("vocab_size"),
        norm_eps=c.number("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_embeddings=c.flag("tie_word_embeddings", False),
        max_seq_len=seq_len,
        extra={"hf": token_ids(c) | dict(kept or {})},
        **fields,
    )


# ---------------------------------------------------------------------------------------
# ModelArgs -> config.json


def check_attention(
    args: ModelArgs, checkpoint: str, *, qkv_bias: bool | None, qk_norm: bool
) -> None:
    """Refuse `args` whose attention the family's checkpoints (named `checkpoint`, e.g.
    "Qwen 2") cannot hold: q/k/v biases unless `qkv_bias` (None: not checked), and QK-norm
    unless `qk_norm`, or the lack of either where the family always has it."""
    if qkv_bias is not None and args.qkv_bias != qkv_bias:
        has = "always has" if qkv_bias else "has no"
        raise ValueError(
            f"a {checkpoint} checkpoint {has} q/k/v biases; args.qkv_bias must be {qkv_bias}"
        )
    if args.qk_norm != qk_norm:
        has = "always has" if qk_norm else "has no"
        raise ValueError(f"a {checkpoint} checkpoint {has} QK-norm; args.qk_norm must be {qk_norm}")


def hf_config(
    args: ModelArgs,
    architecture: str,
    model_type: str,
    *,
    mlp_fields: Mapping[str, Any] | None = None,
    **tail: Any,
) -> dict[str, Any]:
    """config.json for `args` (without torch_dtype, which the writer adds): the fields every
    family writes, the family's `mlp_fields` after intermediate_size, and its `tail` last."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        **(mlp_fields or {}),
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.k,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        **rope_to_config(args),
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        **tail,
    }


def no_sliding_window(max_window_layers: int | None = None) -> dict[str, Any]:
    """config.json fields of a Qwen model whose every layer attends in full, with
    `max_window_layers` when given (Qwen 2 and Qwen 3 dense write it, Qwen 3 MoE does not)."""
    fields: dict[str, Any] = {"use_sliding_window": False, "sliding_window": None}
    if max_window_layers is not None:
        fields["max_window_layers"] = max_window_layers
    return fields


# ---------------------------------------------------------------------------------------
# tensor names


def dense_mlp_names(t: str, h: str) -> dict[str, HFName]:
    """A SwiGLU MLP's names in block `t` (tidal) / `h` (Hugging Face)."""
    return {
        t + "feed_forward.w1.weight": h + "mlp.gate_proj.weight",
        t + "feed_forward.w2.weight": h + "mlp.down_proj.weight",
        t + "feed_forward.w3.weight": h + "mlp.up_proj.weight",
    }


def hf_names(
    args: ModelArgs,
    *,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    mlp: Callable[[str, str], Mapping[str, HFName]] = dense_mlp_names,
) -> dict[str, HFName]:
    """tidal state-dict key -> Hugging Face tensor name, in the checkpoint's order, for a
    family whose attention has q/k/v biases (`qkv_bias`) or QK-norm (`qk_norm`) and whose
    block `t` / `h` holds the `mlp` names. The switches are the family's, not `args`'."""
    names: dict[str, HFName] = {"tok_embeddings.weight": "model.embed_tokens.weight"}
    for i in range(args.n_layers):
        t, h = f"layers.{i}.", f"model.layers.{i}."
        names[t + "attention_norm.weight"] = h + "input_layernorm.weight"
        for p in "qkv":
            names[f"{t}attention.w{p}.weight"] = f"{h}self_attn.{p}_proj.weight"
            if qkv_bias:
                names[f"{t}attention.w{p}.bias"] = f"{h}self_attn.{p}_proj.bias"
        names[t + "attention.wo.weight"] = h + "self_attn.o_proj.weight"
        if qk_norm:
            names[t + "attention.q_norm.weight"] = h + "self_attn.q_norm.weight"
            names[t + "attention.k_norm.weight"] = h + "self_attn.k_norm.weight"
        names[t + "ffn_norm.weight"] = h + "post_attention_layernorm.weight"
        names |= mlp(t, h)
    names["norm.weight"] = "model.norm.weight"
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    return names
