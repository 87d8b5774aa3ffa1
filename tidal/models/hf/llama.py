"""Llama (2, 3, 3.1, 3.2) checkpoints in Hugging Face's layout (`model_type: llama`).

The architecture is tidal's `family="llama3"`: GQA (`num_key_value_heads`, all heads when
absent, as in Llama 2), rotate-half RoPE with `rope_theta` (10000 when absent) and optional
Llama 3.1 frequency scaling (`rope_type: llama3`), RMSNorm, SwiGLU, no biases, and an
output projection that is tied to the embedding when `tie_word_embeddings` (Llama 3.2 1B/3B,
SmolLM2). Hugging Face's q/k weights are already in the rotate-half layout tidal's attention
uses: names change, no tensor does.

Refused with an error naming the field: other activations, attention or MLP biases,
interleaved or partial RoPE, RoPE scaling other than llama3, quantized checkpoints.
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

MODEL_TYPE = "llama"
FAMILY = "llama3"
ARCHITECTURE = "LlamaForCausalLM"


def model_args(c: ConfigFields) -> ModelArgs:
    """ModelArgs of a Llama config.json; defaults for absent fields are transformers'."""
    check_common_fields(c, ARCHITECTURE)
    dim, n_heads = c.required("hidden_size"), c.required("num_attention_heads")
    head_dim = c.integer("head_dim", dim // n_heads)
    max_seq_len = c.integer("max_position_embeddings", 2048)
    rope_theta, rope_scaling = rope_from_config(c, max_seq_len)
    return build_args(
        c,
        family=FAMILY,
        dim=dim,
        n_layers=c.required("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=c.integer("num_key_value_heads", n_heads),
        head_dim=None if head_dim * n_heads == dim else head_dim,
        ffn_dim=c.required("intermediate_size"),
        vocab_size=c.required("vocab_size"),
        norm_eps=c.number("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_embeddings=c.flag("tie_word_embeddings", False),
        max_seq_len=max_seq_len,
        extra={"hf": token_ids(c)},
    )


def hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json for `args` (without torch_dtype, which the writer adds)."""
    if args.qkv_bias:
        raise ValueError("a Llama checkpoint has no q/k/v biases; args.qkv_bias must be False")
    if args.qk_norm:
        raise ValueError("a Llama checkpoint has no QK-norm; args.qk_norm must be False")
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
        "mlp_bias": False,
        "attention_dropout": 0.0,
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
            t + "ffn_norm.weight": h + "post_attention_layernorm.weight",
            t + "feed_forward.w1.weight": h + "mlp.gate_proj.weight",
            t + "feed_forward.w2.weight": h + "mlp.down_proj.weight",
            t + "feed_forward.w3.weight": h + "mlp.up_proj.weight",
        }
    names["norm.weight"] = "model.norm.weight"
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    return names
