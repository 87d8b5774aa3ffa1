"""Qwen 3 MoE checkpoints in Hugging Face's layout (`model_type: qwen3_moe`, Qwen3-30B-A3B).

The architecture is tidal's `family="qwen3_moe"`: Qwen 3's attention (GQA, QK-norm, RoPE,
no biases; `head_dim` hidden_size / heads when absent, as transformers defaults it for this
model type) with a mixture of SwiGLU experts in every block (tidal/models/moe.py): a router
`mlp.gate` [E, D], softmax, top `num_experts_per_tok` with `norm_topk_prob`, and
`num_experts` (transformers 5 writes `num_local_experts`) experts of width
`moe_intermediate_size`.

Checkpoints store each expert's matrices apart (`mlp.experts.{e}.gate_proj.weight` [F, D],
`up_proj`, `down_proj`), as transformers 5 also writes them (it fuses them only in memory);
tidal stacks them into `experts.w1` / `w3` [E, F, D] and `w2` [E, D, F], so expert e's slice
holds exactly its file tensor (`hf_names` maps a stacked key to the tuple of its E names).

Refused with an error naming the field: dense layers among the sparse ones
(`mlp_only_layers` non-empty, `decoder_sparse_step` != 1), sliding windows, attention biases,
RoPE scaling other than llama3, quantized checkpoints. Aux-loss-free balancing
(`load_balance="bias"`) and shared experts have no Qwen 3 MoE config field: such a model is
not saved in this format.
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
from tidal.models.moe import MoEArgs
from tidal.models.transformer import ModelArgs

MODEL_TYPE = "qwen3_moe"
FAMILY = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"

_KEPT = ("router_aux_loss_coef",)
"""Config fields kept in ModelArgs.extra["hf"] and written back: the training recipe's."""


def _n_experts(c: ConfigFields) -> int:
    new, old = c.raw.get("num_local_experts"), c.raw.get("num_experts")
    if new is not None and old is not None and new != old:
        c.refuse("num_local_experts", new, f"the same as num_experts={old!r}")
    return c.integer("num_local_experts" if new is not None else "num_experts", 128)


def model_args(c: ConfigFields) -> ModelArgs:
    """ModelArgs of a Qwen 3 MoE config.json; defaults for absent fields are transformers'."""
    check_common_fields(c, ARCHITECTURE)
    c.expect("use_sliding_window", (False,))
    layer_types = c.raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        c.refuse("layer_types", layer_types, "'full_attention' for every layer")
    if c.raw.get("mlp_only_layers"):
        c.refuse("mlp_only_layers", c.raw["mlp_only_layers"], "[] (every layer sparse)")
    c.expect("decoder_sparse_step", (1,))
    dim, n_heads = c.required("hidden_size"), c.required("num_attention_heads")
    max_seq_len = c.integer("max_position_embeddings", 32768)
    rope_theta, rope_scaling = rope_from_config(c, max_seq_len)
    try:
        moe = MoEArgs(
            n_experts=_n_experts(c),
            top_k=c.integer("num_experts_per_tok", 8),
            ffn_dim=c.integer("moe_intermediate_size", 768),
            norm_topk_prob=c.flag("norm_topk_prob", False),
        )
    except ValueError as e:
        if c.source in str(e):
            raise
        raise ValueError(f"{c.source}: {e}") from None
    return build_args(
        c,
        family=FAMILY,
        dim=dim,
        n_layers=c.required("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=c.integer("num_key_value_heads", n_heads),
        head_dim=c.integer("head_dim", dim // n_heads),
        ffn_dim=c.integer("intermediate_size", 6144),
        vocab_size=c.required("vocab_size"),
        norm_eps=c.number("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        qk_norm=True,
        tie_embeddings=c.flag("tie_word_embeddings", False),
        max_seq_len=max_seq_len,
        moe=moe,
        extra={"hf": token_ids(c) | {k: c.raw[k] for k in _KEPT if c.raw.get(k) is not None}},
    )


def _check(args: ModelArgs) -> MoEArgs:
    moe = args.moe
    if moe is None:
        raise ValueError("a Qwen 3 MoE checkpoint needs args.moe (a mixture of experts)")
    if not args.qk_norm:
        raise ValueError("a Qwen 3 MoE checkpoint always has QK-norm; args.qk_norm must be True")
    if moe.n_shared_experts:
        raise ValueError(
            f"moe.n_shared_experts={moe.n_shared_experts}: Qwen 3 MoE checkpoints have no shared "
            "experts"
        )
    if moe.load_balance != "aux_loss":
        raise ValueError(
            f"moe.load_balance={moe.load_balance!r}: Qwen 3 MoE checkpoints have no expert bias "
            "(aux-loss-free balancing); use 'aux_loss'"
        )
    return moe


def hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json for `args` (without torch_dtype, which the writer adds)."""
    moe = _check(args)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "moe_intermediate_size": moe.ffn_dim,
        "num_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
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
    }


def hf_names(args: ModelArgs) -> dict[str, str | tuple[str, ...]]:
    """tidal state-dict key -> Hugging Face tensor name, or the E names (one per expert) a
    stacked expert tensor splits into along its first dim; in the checkpoint's order."""
    moe = _check(args)
    names: dict[str, str | tuple[str, ...]] = {"tok_embeddings.weight": "model.embed_tokens.weight"}
    for i in range(args.n_layers):
        t, h = f"layers.{i}.", f"model.layers.{i}."

        def per_expert(proj: str, h: str = h) -> tuple[str, ...]:
            return tuple(f"{h}mlp.experts.{e}.{proj}.weight" for e in range(moe.n_experts))

        names |= {
            t + "attention_norm.weight": h + "input_layernorm.weight",
            t + "attention.wq.weight": h + "self_attn.q_proj.weight",
            t + "attention.wk.weight": h + "self_attn.k_proj.weight",
            t + "attention.wv.weight": h + "self_attn.v_proj.weight",
            t + "attention.wo.weight": h + "self_attn.o_proj.weight",
            t + "attention.q_norm.weight": h + "self_attn.q_norm.weight",
            t + "attention.k_norm.weight": h + "self_attn.k_norm.weight",
            t + "ffn_norm.weight": h + "post_attention_layernorm.weight",
            t + "feed_forward.router.weight": h + "mlp.gate.weight",
            t + "feed_forward.experts.w1": per_expert("gate_proj"),
            t + "feed_forward.experts.w2": per_expert("down_proj"),
            t + "feed_forward.experts.w3": per_expert("up_proj"),
        }
    names["norm.weight"] = "model.norm.weight"
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    return names
