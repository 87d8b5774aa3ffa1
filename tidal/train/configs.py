"""Named training configs: functions returning a `Config`, registered by name.

`tidal train --config NAME` starts from one of these; command-line overrides adjust fields.
Add a config by writing a function here and decorating it with `@register`, or anywhere else
and naming it `--config MODULE:FUNCTION` (a dotted module on the import path, or a `.py` file).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

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
C = TypeVar("C")


def register(fn: Callable[[], Config]) -> Callable[[], Config]:
    CONFIGS[fn.__name__] = fn
    return fn


def get_config(name: str) -> Config:
    """The named config, freshly built: a registered name, or `MODULE:FUNCTION` (the module is
    imported, which registers any `@register` configs in it, then FUNCTION is called).

    Raises:
        ValueError: an unknown name, a module that cannot be imported, a missing function, or
            one that does not return a Config.
    """
    if ":" in name:
        return config_from_module(name, Config)
    if name not in CONFIGS:
        raise ValueError(
            f"unknown config {name!r}; choose one of {sorted(CONFIGS)}, or name a function "
            "as MODULE:FUNCTION"
        )
    return CONFIGS[name]()


def config_from_module(spec: str, kind: type[C]) -> C:
    """`MODULE:FUNCTION` (a module name or a .py path) called: the config it returns, which
    must be a `kind` (`Config` here, `RLConfig` for `tidal rl`).

    Raises:
        ValueError: naming the spec: a module that cannot be imported, a missing function, or
            one that returns something else.
    """
    module_name, _, fn_name = spec.rpartition(":")
    if not module_name or not fn_name:
        raise ValueError(f"--config {spec!r}: expected MODULE:FUNCTION (e.g. my_configs:long_run)")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser()
            if not path.is_file():
                raise ValueError(f"--config {spec!r}: no file {path}")
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            assert mod_spec is not None and mod_spec.loader is not None, f"cannot load {path}"
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules.setdefault(path.stem, module)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--config {spec!r}: cannot import {module_name!r}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(
            f"--config {spec!r}: module {module_name!r} has no function {fn_name!r}; it has "
            f"{public}"
        )
    cfg = fn()
    if not isinstance(cfg, kind):
        raise ValueError(
            f"--config {spec!r}: {fn_name}() returned {type(cfg).__name__}, expected a "
            f"{kind.__name__}"
        )
    return cfg


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
    """The Llama 3.1 8B shape, batch 4 x 4096 on Shakespeare; needs several GPUs (FSDP, TP)."""
    return _gpu_config("llama3_8b", "llama3_8b")


@register
def qwen3_0_6b() -> Config:
    """The Qwen 3 0.6B shape (QK-norm, tied embeddings), batch 4 x 4096, for one GPU."""
    return _gpu_config("qwen3_0_6b", "qwen3_0_6b")


@register
def qwen3_1_7b() -> Config:
    """The Qwen 3 1.7B shape (QK-norm, tied embeddings), batch 4 x 4096, for one GPU."""
    return _gpu_config("qwen3_1_7b", "qwen3_1_7b")


@register
def qwen3_8b() -> Config:
    """The Qwen 3 8B shape (QK-norm, untied), batch 4 x 4096; needs several GPUs (FSDP, TP)."""
    return _gpu_config("qwen3_8b", "qwen3_8b")


@register
def sft_addition() -> Config:
    """SFT from scratch on generated addition with worked carries (#### N answers), on CPU."""
    return Config(
        job=JobConfig(name="sft_addition", output_dir="outputs/sft_addition"),
        model=ModelConfig(flavor="debug", vocab_size=512),
        data=DataConfig(
            dataset="arithmetic",
            path="add:1-4",
            format="chat",
            tokenizer="bpe",
            vocab_size=512,
            num_problems=50_000,
            val_fraction=0.02,
        ),
        training=TrainingConfig(steps=300, batch_size=16, seq_len=256, seed=0),
        optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.1),
        lr_scheduler=SchedulerConfig(warmup_steps=30, decay_fraction=0.3, decay_type="cosine"),
        metrics=MetricsConfig(log_every=25, val_every=100, val_batches=4),
        sample=SampleConfig(max_new_tokens=0),
    )


@register
def sft_addition_slips() -> Config:
    """The `make demo` warm start: SFT from scratch on 1-3 digit addition worked by a sloppy
    teacher, who forgets 55% of the carries (and answers what it worked out). The model
    learns the slips too; RL on the true sums then beats its teacher (docs/rl.md)."""
    cfg = sft_addition()
    cfg.job = JobConfig(
        name="sft_addition_slips", output_dir="outputs/sft_addition_slips", cpu_kernels="portable"
    )
    cfg.data.path = "add:1-3:slip=0.55"
    cfg.training.steps = 300
    return cfg


@register
def sft_calculator_tools() -> Config:
    """The `make demo-tools` warm start: SFT from scratch (the 1M `debug_small`) on the
    `calculator` environment's problems (one product of two 3-digit operands, no tool block
    in the opening, the hint before the question), played by a teacher who calls the `calc`
    tool on 40% of them and guesses the rest (the last digits wrong). It learns the copy of
    the question's numbers in 1,000 steps and calls on fewer than half the problems, so greedy
    decoding never calls; RL on the true answer makes it call (docs/rl.md, "Tools demo")."""
    return Config(
        job=JobConfig(
            name="sft_calculator_tools",
            output_dir="outputs/sft_calculator_tools",
            cpu_kernels="portable",
        ),
        model=ModelConfig(flavor="debug_small", vocab_size=1024),
        data=DataConfig(
            dataset="generated",
            # Imported by name when the data is built: tidal/train imports nothing of tidal/rl.
            path="tidal.rl.envs.teacher:teacher_chats:calculator:tool=0.4:terms=1:digits=3"
            ":list_tools=false:hint_first=true",
            format="chat",
            tokenizer="bpe",
            vocab_size=1024,
            num_problems=20_000,
            val_fraction=0.02,
        ),
        # A conversation is 50-100 tokens; rows of 256 hold two to four.
        training=TrainingConfig(steps=1000, batch_size=16, seq_len=256, seed=0),
        optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.1),
        lr_scheduler=SchedulerConfig(warmup_steps=15, decay_fraction=0.3, decay_type="cosine"),
        metrics=MetricsConfig(log_every=10, val_every=0),
        sample=SampleConfig(max_new_tokens=0),
    )
