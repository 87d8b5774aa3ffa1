"""Named model shapes. `published_params` is the count from the model card / checkpoint (for
a mixture of experts, the total over every expert)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tidal.models.moe import MoEArgs
from tidal.models.transformer import ModelArgs, RopeScaling

LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
LLAMA32_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)


def _llama3(**kw: Any) -> ModelArgs:
    base: dict[str, Any] = dict(
        family="llama3",
        n_kv_heads=8,
        vocab_size=128256,
        norm_eps=1e-5,
        rope_theta=500_000.0,
        max_seq_len=8192,
    )
    return ModelArgs(**(base | kw))


def _qwen2(**kw: Any) -> ModelArgs:
    """Qwen 2.5 as released (config.json: rope_theta 1e6, rms_norm_eps 1e-6, biases on q/k/v,
    sliding window off)."""
    base: dict[str, Any] = dict(
        family="qwen2",
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        qkv_bias=True,
        max_seq_len=32768,
    )
    return ModelArgs(**(base | kw))


def _qwen3(**kw: Any) -> ModelArgs:
    base: dict[str, Any] = dict(
        family="qwen3",
        n_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        qk_norm=True,
        max_seq_len=40960,
    )
    return ModelArgs(**(base | kw))


FLAVORS: dict[str, ModelArgs] = {
    # A few million parameters: trains on CPU in minutes; vocabulary 4096, the debug BPE size.
    "debug": ModelArgs(
        family="llama3",
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=768,
        vocab_size=4096,
        rope_theta=10_000.0,
        max_seq_len=2048,
    ),
    # ~1M parameters (vocabulary 1024): `make demo-tools`' policy, 5x fewer FLOPs a token than
    # debug, so its SFT sees enough tool calls on 2 CPU cores to learn to copy the question.
    "debug_small": ModelArgs(
        family="llama3",
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=384,
        vocab_size=4096,
        rope_theta=10_000.0,
        max_seq_len=2048,
    ),
    # For parity tests of every parallel layout: 4 layers, heads divisible by 2 and 4.
    "tiny": ModelArgs(
        family="llama3",
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=192,
        vocab_size=512,
        rope_theta=10_000.0,
        max_seq_len=512,
    ),
    "debug_qwen2": ModelArgs(
        family="qwen2",
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=768,
        vocab_size=4096,
        norm_eps=1e-6,
        rope_theta=10_000.0,
        qkv_bias=True,
        tie_embeddings=True,
        max_seq_len=2048,
    ),
    "debug_qwen3": ModelArgs(
        family="qwen3",
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=48,
        ffn_dim=768,
        vocab_size=4096,
        norm_eps=1e-6,
        rope_theta=10_000.0,
        qk_norm=True,
        tie_embeddings=True,
        max_seq_len=2048,
    ),
    # SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M-Instruct: 134.5M parameters with its
    # 49,152 vocabulary, tied output); the RL peer benchmark trains it with a small vocabulary.
    "smollm2_135m": _llama3(
        dim=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        ffn_dim=1536,
        vocab_size=49152,
        rope_theta=100_000.0,
        max_seq_len=8192,
        tie_embeddings=True,
        extra={"published_params": 134_515_008},
    ),
    # torchtitan's "1B" Llama 3 shape (untied output: 1.50B parameters with the 128k vocab).
    "llama3_1b": _llama3(
        dim=2048,
        n_layers=16,
        n_heads=32,
        ffn_dim=8192,
        rope_scaling=LLAMA32_SCALING,
        extra={"published_params": 1_498_482_688},
    ),
    # Llama 3.2 1B as released: the same blocks with tied embeddings.
    "llama3_2_1b": _llama3(
        dim=2048,
        n_layers=16,
        n_heads=32,
        ffn_dim=8192,
        tie_embeddings=True,
        rope_scaling=LLAMA32_SCALING,
        max_seq_len=131072,
        extra={"published_params": 1_235_814_400},
    ),
    "llama3_8b": _llama3(
        dim=4096,
        n_layers=32,
        n_heads=32,
        ffn_dim=14336,
        rope_scaling=LLAMA31_SCALING,
        max_seq_len=131072,
        extra={"published_params": 8_030_261_248},
    ),
    "llama3_70b": _llama3(
        dim=8192,
        n_layers=80,
        n_heads=64,
        ffn_dim=28672,
        rope_scaling=LLAMA31_SCALING,
        max_seq_len=131072,
        extra={"published_params": 70_553_706_496},
    ),
    # Qwen 2.5 base models (Qwen/Qwen2.5-0.5B, -1.5B, -7B; the Instruct, Math and
    # DeepSeek-R1-Distill-Qwen models of these sizes share the shapes). 7B: untied, vocab 152064.
    "qwen2_5_0_5b": _qwen2(
        dim=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        ffn_dim=4864,
        tie_embeddings=True,
        extra={"published_params": 494_032_768},
    ),
    "qwen2_5_1_5b": _qwen2(
        dim=1536,
        n_layers=28,
        n_heads=12,
        n_kv_heads=2,
        ffn_dim=8960,
        tie_embeddings=True,
        extra={"published_params": 1_543_714_304},
    ),
    "qwen2_5_7b": _qwen2(
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        ffn_dim=18944,
        vocab_size=152064,
        max_seq_len=131072,
        extra={"published_params": 7_615_616_512},
    ),
    "qwen3_0_6b": _qwen3(
        dim=1024,
        n_layers=28,
        n_heads=16,
        ffn_dim=3072,
        tie_embeddings=True,
        extra={"published_params": 596_049_920},
    ),
    "qwen3_1_7b": _qwen3(
        dim=2048,
        n_layers=28,
        n_heads=16,
        ffn_dim=6144,
        tie_embeddings=True,
        extra={"published_params": 1_720_574_976},
    ),
    "qwen3_8b": _qwen3(
        dim=4096, n_layers=36, n_heads=32, ffn_dim=12288, extra={"published_params": 8_190_735_360}
    ),
}


def _qwen3_moe(moe: MoEArgs, **kw: Any) -> ModelArgs:
    return _qwen3(family="qwen3_moe", moe=moe, **kw)


# Qwen 3 MoE shapes (tidal/models/moe.py): every block's MLP a mixture of SwiGLU experts.
FLAVORS |= {
    # CPU tests and demos: debug_qwen3's attention, 8 experts of width 128, 2 per token.
    "debug_moe": ModelArgs(
        family="qwen3_moe",
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        ffn_dim=768,
        vocab_size=4096,
        norm_eps=1e-6,
        rope_theta=10_000.0,
        qk_norm=True,
        max_seq_len=2048,
        moe=MoEArgs(n_experts=8, top_k=2, ffn_dim=128),
    ),
    # One GPU benchmarks: 0.98B parameters in all, 0.45B active per token (0.14B outside
    # the embeddings): 64 fine-grained experts of width 256, 8 per token, as in Qwen3-30B-A3B.
    "qwen3_moe_1b": _qwen3_moe(
        MoEArgs(n_experts=64, top_k=8, ffn_dim=256),
        dim=1024,
        n_layers=12,
        n_heads=16,
        n_kv_heads=4,
        ffn_dim=3072,
    ),
    # Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.35B active (128 experts, 8 per token).
    "qwen3_30b_a3b": _qwen3_moe(
        MoEArgs(n_experts=128, top_k=8, ffn_dim=768),
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        ffn_dim=6144,
        extra={"published_params": 30_532_122_624},
    ),
}


def get_flavor(name: str, **overrides) -> ModelArgs:
    """The ModelArgs of a named flavor, with optional field overrides."""
    if name not in FLAVORS:
        raise ValueError(f"unknown model flavor {name!r}; choose one of {sorted(FLAVORS)}")
    return replace(FLAVORS[name], **overrides) if overrides else FLAVORS[name]
