"""Qwen 2 and Qwen 2.5 checkpoints in Hugging Face's layout (`model_type: qwen2`).

The architecture is tidal's `family="qwen2"`: Llama's blocks (GQA, rotate-half RoPE, RMSNorm,
SwiGLU) with biases on the query, key and value projections (always: `Qwen2Attention` has
no `attention_bias` switch; `o_proj` and the MLP have none), RoPE base `rope_theta` (1e6 in
Qwen 2.5; 10000 when absent, as transformers defaults it), RMSNorm eps 1e-6 when absent, and
an output projection tied to the embedding when `tie_word_embeddings` (0.5B, 1.5B, 3B).
Names are Llama's plus `self_attn.{q,k,v}_proj.bias`; no tensor is permuted. Qwen2.5-Math
and DeepSeek-R1-Distill-Qwen checkpoints are this model_type too.

Sliding windows: released configs carry `sliding_window` and `max_window_layers` with
`use_sliding_window: false`, so every layer attends in full; such a config loads, and the two
fields are kept (in `ModelArgs.extra["hf"]`) and written back by `save_hf`. tidal implements
full causal attention only, so an active window is refused.

Refused with an error naming the field: active sliding windows (`use_sliding_window: true`,
or `layer_types` other than full attention), multimodal RoPE (`use_mrope: true`),
`attention_bias: false`, MLP biases, other activations, RoPE scaling other than llama3 (YaRN,
dynamic NTK), quantized checkpoints (GPTQ, AWQ).
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

MODEL_TYPE = "qwen2"
FAMILY = "qwen2"
ARCHITECTURE = "Qwen2ForCausalLM"

WINDOW_FIELDS = ("sliding_window", "max_window_layers")
"""Inactive sliding-window settings, kept on load and written back on save."""


def model_args(c: ConfigFields) -> ModelArgs:
    """ModelArgs of a Qwen 2 / 2.5 config.json; defaults for absent fields are transformers'."""
    check_common_fields(c, ARCHITECTURE, attention_bias=True)
    c.expect("use_sliding_window", (False,))
    c.expect("use_mrope", (False,))
    layer_types = c.raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        c.refuse("layer_types", layer_types, "'full_attention' for every layer")
    window = {k: c.integer(k, None) for k in WINDOW_FIELDS if c.raw.get(k) is not None}
    dim, n_heads = c.required("hidden_size"), c.required("num_attention_heads")
    head_dim = c.integer("head_dim", dim // n_heads)
    max_seq_len = c.integer("max_position_embeddings", 32768)
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
        qkv_bias=True,
        tie_embeddings=c.flag("tie_word_embeddings", False),
        max_seq_len=max_seq_len,
        extra={"hf": token_ids(c) | window},
    )


def hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json for `args` (without torch_dtype, which the writer adds)."""
    if not args.qkv_bias:
        raise ValueError("a Qwen 2 checkpoint always has q/k/v biases; args.qkv_bias must be True")
    if args.qk_norm:
        raise ValueError("a Qwen 2 checkpoint has no QK-norm; args.qk_norm must be False")
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
            t + "attention.wq.bias": h + "self_attn.q_proj.bias",
            t + "attention.wk.weight": h + "self_attn.k_proj.weight",
            t + "attention.wk.bias": h + "self_attn.k_proj.bias",
            t + "attention.wv.weight": h + "self_attn.v_proj.weight",
            t + "attention.wv.bias": h + "self_attn.v_proj.bias",
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
