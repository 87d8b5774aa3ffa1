"""Qwen 3 dense checkpoints in Hugging Face's layout (`model_type: qwen3`).

The architecture is tidal's `family="qwen3"`: Llama's blocks (GQA, rotate-half RoPE, RMSNorm,
SwiGLU, no biases) plus a per-head RMSNorm on queries and keys before RoPE (QK-norm, always
on), a `head_dim` that need not be hidden_size / heads (128 when absent, as transformers
defaults it), and tied embeddings for the small sizes (`tie_word_embeddings`). Names are
Llama's plus `self_attn.q_norm` / `self_attn.k_norm`; no tensor is permuted.

Refused with an error naming the field: sliding-window attention (`use_sliding_window`, or
`layer_types` other than full attention), attention biases, RoPE scaling other than llama3
(Qwen's YaRN), quantized checkpoints. Qwen 3 MoE (`qwen3_moe`) is another model_type.
"""

from __future__ import annotations

from typing import Any

from tidal.models.hf.common import (
    ConfigFields,
    build_args,
    check_common_fields,
    rope_from_config,
    rope_to_config,
    token_ids,
)
from tidal.models.transformer import ModelArgs

MODEL_TYPE = "qwen3"
FAMILY = "qwen3"
ARCHITECTURE = "Qwen3ForCausalLM"


def model_args(c: ConfigFields) -> ModelArgs:
    """ModelArgs of a Qwen 3 config.json; defaults for absent fields are transformers'."""
    check_common_fields(c, ARCHITECTURE)
    c.expect("use_sliding_window", (False,))
    layer_types = c.raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        c.refuse("layer_types", layer_types, "'full_attention' for every layer")
    dim, n_heads = c.required("hidden_size"), c.required("num_attention_heads")
    head_dim = c.integer("head_dim", 128)
    max_seq_len = c.integer("max_position_embeddings", 32768)
    rope_theta, rope_scaling = rope_from_config(c, max_seq_len)
    return build_args(
        c,
        family=FAMILY,
        dim=dim,
        n_layers=c.required("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=c.integer("num_key_value_heads", n_heads),
        head_dim=head_dim,
        ffn_dim=c.required("intermediate_size"),
        vocab_size=c.required("vocab_size"),
        norm_eps=c.number("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        qk_norm=True,
        tie_embeddings=c.flag("tie_word_embeddings", False),
        max_seq_len=max_seq_len,
        extra={"hf": token_ids(c)},
    )


def hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json for `args` (without torch_dtype, which the writer adds)."""
    if args.qkv_bias:
        raise ValueError("a Qwen 3 checkpoint has no q/k/v biases; args.qkv_bias must be False")
    if not args.qk_norm:
        raise ValueError("a Qwen 3 checkpoint always has QK-norm; args.qk_norm must be True")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
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
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
    }


def hf_names(args: ModelArgs) -> dict[str, str]:
    """tidal state-dict key -> Hugging Face tensor name, in the checkpoint's order."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight"}
    for i in range(args.n_layers):
        t, h = f"layers.{i}.", f"model.layers.{i}."
        names |= {
            t + "attention_norm.weight": h + "input_layernorm.weight",
            t + "attention.wq.weight": h + "self_attn.q_proj.weight",
            t + "attention.wk.weight": h + "self_attn.k_proj.weight",
            t + "attention.wv.weight": h + "self_attn.v_proj.weight",
            t + "attention.wo.weight": h + "self_attn.o_proj.weight",
            t + "attention.q_norm.weight": h + "self_attn.q_norm.weight",
            t + "attention.k_norm.weight": h + "self_attn.k_norm.weight",
            t + "ffn_norm.weight": h + "post_attention_layernorm.weight",
            t + "feed_forward.w1.weight": h + "mlp.gate_proj.weight",
            t + "feed_forward.w2.weight": h + "mlp.down_proj.weight",
            t + "feed_forward.w3.weight": h + "mlp.up_proj.weight",
        }
    names["norm.weight"] = "model.norm.weight"
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    return names
