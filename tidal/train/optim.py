"""AdamW with weight-decay groups, and the warmup-stable-decay learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from tidal.train.config import OptimizerConfig, SchedulerConfig


def build_optimizer(
    modules: nn.Module | Sequence[nn.Module], cfg: OptimizerConfig, device: torch.device
):
    """AdamW over the modules' parameters (one model, or this rank's pipeline stages);
    matrices decay, embeddings and 1-D tensors do not."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for module in [modules] if isinstance(modules, nn.Module) else modules:
        for name, p in module.named_parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 and "embeddings" not in name else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device.type in ("cuda", "cpu") else "foreach"
    kw = {"fused": impl == "fused", "foreach": impl == "foreach"}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kw)


def wsd_multiplier(step: int, total_steps: int, cfg: SchedulerConfig) -> float:
    """Learning-rate multiplier at optimizer step `step` (1-based) of `total_steps`.

    Linear warmup over `warmup_steps`, constant, then a decay to `min_lr_ratio` over the last
    `decay_fraction` of the steps (linear, cosine or 1 - sqrt).
    """
    warmup = min(cfg.warmup_steps, total_steps)
    decay_steps = int(round(cfg.decay_fraction * total_steps))
    decay_start = max(warmup, total_steps - decay_steps)
    if step <= warmup and warmup > 0:
        return step / warmup
    if step <= decay_start or decay_steps == 0:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
    if cfg.decay_type == "linear":
        shape = 1.0 - progress
    elif cfg.decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # sqrt
        shape = 1.0 - math.sqrt(progress)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        # A tensor lr would avoid recompiles under compile; a float is fine for eager AdamW.
        group["lr"] = lr
