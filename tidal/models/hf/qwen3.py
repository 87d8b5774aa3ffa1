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

from tidal.models.hf import decoder
from tidal.models.hf.common import ConfigFields, HFName, check_common_fields
from tidal.models.transformer import ModelArgs

MODEL_TYPE = "qwen3"
FAMILY = "qwen3"
ARCHITECTURE = "Qwen3ForCausalLM"


def model_args(c: ConfigFields) -> ModelArgs:
    """ModelArgs of a Qwen 3 config.json; defaults for absent fields are transformers'."""
    check_common_fields(c, ARCHITECTURE)
    decoder.refuse_sliding_windows(c)
    return decoder.model_args(c, FAMILY, max_seq_len=32768, head_dim=128, qk_norm=True)


def hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json for `args` (without torch_dtype, which the writer adds)."""
    decoder.check_attention(args, "Qwen 3", qkv_bias=False, qk_norm=True)
    return decoder.hf_config(
        args,
        ARCHITECTURE,
        MODEL_TYPE,
        attention_bias=False,
        attention_dropout=0.0,
        **decoder.no_sliding_window(args.n_layers),
    )


def hf_names(args: ModelArgs) -> dict[str, HFName]:
    """tidal state-dict key -> Hugging Face tensor name, in the checkpoint's order."""
    return decoder.hf_names(args, qk_norm=True)
