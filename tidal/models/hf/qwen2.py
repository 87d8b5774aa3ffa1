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

from tidal.models.hf import decoder
from tidal.models.hf.common import ConfigFields, HFName, check_common_fields
from tidal.models.transformer import ModelArgs

MODEL_TYPE = "qwen2"
FAMILY = "qwen2"
ARCHITECTURE = "Qwen2ForCausalLM"

WINDOW_FIELDS = ("sliding_window", "max_window_layers")
"""Inactive sliding-window settings, kept on load and written back on save."""


def model_args(c: ConfigFields) -> ModelArgs:
    """ModelArgs of a Qwen 2 / 2.5 config.json; defaults for absent fields are transformers'."""
    check_common_fields(c, ARCHITECTURE, attention_bias=True)
    decoder.refuse_sliding_windows(c, "use_mrope")
    window = {k: c.integer(k, None) for k in WINDOW_FIELDS if c.raw.get(k) is not None}
    return decoder.model_args(
        c, FAMILY, max_seq_len=32768, implicit_head_dim=True, kept=window, qkv_bias=True
    )


def hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json for `args` (without torch_dtype, which the writer adds)."""
    decoder.check_attention(args, "Qwen 2", qkv_bias=True, qk_norm=False)
    return decoder.hf_config(
        args,
        ARCHITECTURE,
        MODEL_TYPE,
        attention_dropout=0.0,
        **decoder.no_sliding_window(args.n_layers),
    )


def hf_names(args: ModelArgs) -> dict[str, HFName]:
    """tidal state-dict key -> Hugging Face tensor name, in the checkpoint's order."""
    return decoder.hf_names(args, qkv_bias=True)
