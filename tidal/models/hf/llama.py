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

from tidal.models.hf import decoder
from tidal.models.hf.common import ConfigFields, HFName, check_common_fields
from tidal.models.transformer import ModelArgs

MODEL_TYPE = "llama"
FAMILY = "llama3"
ARCHITECTURE = "LlamaForCausalLM"


def model_args(c: ConfigFields) -> ModelArgs:
    """ModelArgs of a Llama config.json; defaults for absent fields are transformers'."""
    check_common_fields(c, ARCHITECTURE)
    return decoder.model_args(c, FAMILY, max_seq_len=2048, implicit_head_dim=True)


def hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json for `args` (without torch_dtype, which the writer adds)."""
    decoder.check_attention(args, "Llama", qkv_bias=False, qk_norm=False)
    return decoder.hf_config(
        args, ARCHITECTURE, MODEL_TYPE, attention_bias=False, mlp_bias=False, attention_dropout=0.0
    )


def hf_names(args: ModelArgs) -> dict[str, HFName]:
    """tidal state-dict key -> Hugging Face tensor name, in the checkpoint's order."""
    return decoder.hf_names(args)
