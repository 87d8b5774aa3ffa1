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

from tidal.models.hf import decoder
from tidal.models.hf.common import ConfigFields, HFName, check_common_fields
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


def _moe_args(c: ConfigFields) -> MoEArgs:
    """The experts' fields, with MoEArgs' validation errors prefixed with the config file."""
    try:
        return MoEArgs(
            n_experts=_n_experts(c),
            top_k=c.integer("num_experts_per_tok", 8),
            ffn_dim=c.integer("moe_intermediate_size", 768),
            norm_topk_prob=c.flag("norm_topk_prob", False),
        )
    except ValueError as e:
        if c.source in str(e):
            raise
        raise ValueError(f"{c.source}: {e}") from None


def model_args(c: ConfigFields) -> ModelArgs:
    """ModelArgs of a Qwen 3 MoE config.json; defaults for absent fields are transformers'."""
    check_common_fields(c, ARCHITECTURE)
    decoder.refuse_sliding_windows(c)
    if c.raw.get("mlp_only_layers"):
        c.refuse("mlp_only_layers", c.raw["mlp_only_layers"], "[] (every layer sparse)")
    c.expect("decoder_sparse_step", (1,))
    return decoder.model_args(
        c,
        FAMILY,
        max_seq_len=32768,
        ffn_dim=6144,
        moe=_moe_args,
        kept={k: c.raw[k] for k in _KEPT if c.raw.get(k) is not None},
        qk_norm=True,
    )


def _check(args: ModelArgs) -> MoEArgs:
    moe = args.moe
    if moe is None:
        raise ValueError("a Qwen 3 MoE checkpoint needs args.moe (a mixture of experts)")
    decoder.check_attention(args, "Qwen 3 MoE", qkv_bias=None, qk_norm=True)
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
    mlp = {
        "moe_intermediate_size": moe.ffn_dim,
        "num_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    return decoder.hf_config(
        args,
        ARCHITECTURE,
        MODEL_TYPE,
        mlp_fields=mlp,
        attention_bias=False,
        attention_dropout=0.0,
        **decoder.no_sliding_window(),
    )


def hf_names(args: ModelArgs) -> dict[str, HFName]:
    """tidal state-dict key -> Hugging Face tensor name, or the E names (one per expert) a
    stacked expert tensor splits into along its first dim; in the checkpoint's order."""
    moe = _check(args)

    def experts(t: str, h: str) -> dict[str, HFName]:
        def per_expert(proj: str) -> tuple[str, ...]:
            return tuple(f"{h}mlp.experts.{e}.{proj}.weight" for e in range(moe.n_experts))

        return {
            t + "feed_forward.router.weight": h + "mlp.gate.weight",
            t + "feed_forward.experts.w1": per_expert("gate_proj"),
            t + "feed_forward.experts.w2": per_expert("down_proj"),
            t + "feed_forward.experts.w3": per_expert("up_proj"),
        }

    return decoder.hf_names(args, qk_norm=True, mlp=experts)
