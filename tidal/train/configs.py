"""Named training configs: functions returning a `Config`, registered by name.

`tidal train --config NAME` starts from one of these; command-line overrides adjust fields.
Add a config by writing a function here and decorating it with `@register`.
"""

from __future__ import annotations

from collections.abc import Callable

from tidal.train.config import (
    Config,
    JobConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    SampleConfig,
    SchedulerConfig,
    TrainingConfig,
)
from tidal.train.data.config import DataConfig

CONFIGS: dict[str, Callable[[], Config]] = {}


def register(fn: Callable[[], Config]) -> Callable[[], Config]:
    CONFIGS[fn.__name__] = fn
    return fn


def get_config(name: str) -> Config:
    """The named config, freshly built."""
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; choose one of {sorted(CONFIGS)}")
    return CONFIGS[name]()


@register
def debug() -> Config:
    """A ~7M-parameter Llama on Shakespeare: a few minutes on a laptop CPU."""
    return Config(
        job=JobConfig(name="debug", output_dir="outputs/debug"),
        model=ModelConfig(flavor="debug"),
        data=DataConfig(dataset="shakespeare", tokenizer="bpe", vocab_size=4096),
        training=TrainingConfig(steps=240, batch_size=16, seq_len=256, seed=0),
        optimizer=OptimizerConfig(lr=2e-3, weight_decay=0.1),
        lr_scheduler=SchedulerConfig(warmup_steps=24, decay_fraction=0.3, decay_type="cosine"),
        metrics=MetricsConfig(log_every=10, val_every=100, val_batches=8),
        sample=SampleConfig(prompt="ROMEO:", max_new_tokens=120, temperature=0.8, top_k=50),
    )


@register
def debug_qwen3() -> Config:
    """The debug run with the Qwen 3 block (QK-norm, tied embeddings)."""
    cfg = debug()
    cfg.job.name, cfg.job.output_dir = "debug_qwen3", "outputs/debug_qwen3"
    cfg.model.flavor = "debug_qwen3"
    return cfg


def _gpu_config(name: str, flavor: str) -> Config:
    return Config(
        job=JobConfig(name=name, output_dir=f"outputs/{name}"),
        model=ModelConfig(flavor=flavor),
        data=DataConfig(dataset="shakespeare", tokenizer="bpe", vocab_size=8192),
        training=TrainingConfig(steps=1000, batch_size=4, seq_len=4096, seed=0),
        optimizer=OptimizerConfig(lr=3e-4),
        lr_scheduler=SchedulerConfig(warmup_steps=100, decay_fraction=0.2),
        metrics=MetricsConfig(log_every=10, val_every=200, val_batches=4),
        sample=SampleConfig(max_new_tokens=64),
    )


@register
def llama3_1b() -> Config:
    """torchtitan's 1B Llama 3 shape (1.5B parameters), batch 4 x 4096, for one GPU."""
    return _gpu_config("llama3_1b", "llama3_1b")


@register
def llama3_8b() -> Config:
    return _gpu_config("llama3_8b", "llama3_8b")


@register
def qwen3_0_6b() -> Config:
    return _gpu_config("qwen3_0_6b", "qwen3_0_6b")


@register
def qwen3_1_7b() -> Config:
    return _gpu_config("qwen3_1_7b", "qwen3_1_7b")


@register
def qwen3_8b() -> Config:
    return _gpu_config("qwen3_8b", "qwen3_8b")
