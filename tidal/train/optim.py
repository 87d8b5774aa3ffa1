"""AdamW with weight-decay groups, optionally with bf16 moment estimates, and the
warmup-stable-decay learning-rate schedule.

bf16 optimizer states (`optimizer.state_dtype=bf16`, as in DeepSeek-V3 and torchtitan's
`fused_opt_states_bf16`): `exp_avg` and `exp_avg_sq` are stored in bfloat16 while parameters
and gradients stay fp32, halving optimizer-state memory. torch's kernels (fused, foreach and
for-loop on CPU; fused on CUDA too: torch 2.11's `_fused_adamw_` says "params, grads, exp_avgs,
and exp_avg_sqs must have same dtype", measured on an H200) reject moments whose dtype differs
from the parameters', so `AdamWBF16States` runs its own per-tensor step, the same on every
device: read the moments as fp32, update them, store them rounded to nearest
bf16, and apply the update from the fp32 values. Rounding to nearest drops a second-moment
increment smaller than 2^-9 of its value, so with beta2 close to 1 (0.999) `exp_avg_sq` can
stall where it should grow; tidal's default beta2 of 0.95 keeps increments of 5%.

On CUDA the per-tensor update is one kernel compiled by inductor (`compiled=None`, the
default, turns it on for CUDA parameters): it reads the parameter, gradient and both moments
once and writes them once, where the eager form makes a dozen passes. The scalars of a step
(learning rate, bias corrections) reach it in a small device tensor, so one compiled graph
with a dynamic length serves every tensor and every step.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tidal.train.config import OptimizerConfig, SchedulerConfig


class AdamWBF16States(torch.optim.AdamW):
    """AdamW whose `exp_avg` and `exp_avg_sq` are bfloat16 (parameters stay in their dtype).

    Same hyperparameters and update as `torch.optim.AdamW` (no amsgrad, no maximize); the
    moment arithmetic is fp32. `state_dict()` holds the bf16 moments and `load_state_dict`
    keeps them bf16 (torch's loader casts optimizer state to the parameters' dtype).

    Example::

        opt = AdamWBF16States(model.parameters(), lr=1e-3, weight_decay=0.1)
        loss.backward(); opt.step()
        opt.state[p]["exp_avg"].dtype  # torch.bfloat16
    """

    state_dtype = torch.bfloat16

    def __init__(self, params: Any, *, compiled: bool | None = None, **kw: Any) -> None:
        """`compiled`: run the update as one inductor kernel per tensor (None: for CUDA
        parameters only; True on CPU needs a C++ compiler)."""
        for name in ("amsgrad", "maximize", "foreach", "fused", "capturable"):
            if kw.get(name):
                raise ValueError(f"AdamWBF16States does not support {name}=True")
        super().__init__(params, foreach=False, fused=False, **kw)
        self.compiled = compiled

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            scalars: dict[tuple[float, torch.device], torch.Tensor] = {}  # by (step, device)
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad if p.grad.dtype == torch.float32 else p.grad.float()
                state = self.state[p]
                if not state:
                    # step on the host (as torch's non-capturable AdamW): reading it never syncs.
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                state["step"] += 1
                t = float(state["step"])
                bias1, bias2 = 1 - beta1**t, 1 - beta2**t
                compiled = p.is_cuda if self.compiled is None else self.compiled
                flat = compiled and _flat_locals(p, grad, state["exp_avg"], state["exp_avg_sq"])
                if flat:
                    if (t, p.device) not in scalars:
                        scalars[t, p.device] = torch.tensor(
                            [1 - beta1, beta2, 1 - lr * wd, -lr / bias1, math.sqrt(bias2), eps],
                            dtype=torch.float32,
                        ).to(p.device)
                    _compiled_update()(*flat, scalars[t, p.device])
                    continue
                exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2)
                exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
                p.mul_(1 - lr * wd)
                denom = exp_avg_sq.sqrt_().div_(math.sqrt(bias2)).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-lr / bias1)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != self.state_dtype:
                    state[key] = state[key].to(self.state_dtype)


def _flat_locals(*tensors: torch.Tensor) -> list[torch.Tensor] | None:
    """Each tensor's local data (a DTensor's shard: the parameter, its gradient and moments
    share one placement) as a 1-D view, or None if one is not contiguous."""
    from torch.distributed.tensor import DTensor

    out = []
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        if not local.is_contiguous():
            return None
        out.append(local.view(-1))
    return out


def _update(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    s: torch.Tensor,
) -> None:
    """The step of `AdamWBF16States.step` on 1-D tensors; `s` holds 1 - beta1, beta2,
    1 - lr * wd, -lr / bias1, sqrt(bias2) and eps (fp32, on the tensors' device)."""
    g = grad.float()
    m = exp_avg.float().lerp(g, s[0])
    v = exp_avg_sq.float() * s[1] + (1 - s[1]) * g * g
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    p.copy_(p * s[2] + s[3] * m / (v.sqrt() / s[4] + s[5]))


@functools.cache
def _compiled_update() -> Callable[..., None]:
    return torch.compile(_update, dynamic=True)


def build_optimizer(
    modules: nn.Module | Sequence[nn.Module], cfg: OptimizerConfig, device: torch.device
) -> torch.optim.Optimizer:
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
    betas = (cfg.beta1, cfg.beta2)
    if cfg.state_dtype == "bf16":
        if cfg.implementation != "auto":
            warnings.warn(
                f"optimizer.implementation={cfg.implementation!r} is ignored with "
                "optimizer.state_dtype=bf16 (tidal's per-tensor AdamW step runs)",
                stacklevel=2,
            )
        return AdamWBF16States(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device.type in ("cuda", "cpu") else "foreach"
    kw = {"fused": impl == "fused", "foreach": impl == "foreach"}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, **kw)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's state tensors (moments and step counters)."""
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                local = v.to_local() if hasattr(v, "to_local") else v
                total += local.numel() * local.element_size()
    return total


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
