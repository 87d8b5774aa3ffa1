"""Float8 training of a Transformer's linear layers with torchao (`quantize.float8`).

torchao (`pip install torchao==0.18.0`) is optional: it is imported only when float8 is on,
and a missing package stops the run in `check_job`, before any data or model work.

Lifecycle, in the trainer's build order (tidal/train/trainer.py), on every rank:

1. `check_float8(cfg, device)` in `check_job`: torchao importable, a CUDA device of compute
   capability >= 8.9 (or the CPU, emulated), no batch-invariant mode.
2. `convert(model, cfg, device=, fsdp=)` on the meta-device model (each pipeline stage),
   before `parallelize`: the selected `nn.Linear`s become torchao `Float8Linear`s with the
   same parameter names, so tensor-parallel plans, compile, FSDP2, `init_weights` and
   checkpoints see the same modules and state-dict keys. Tensor parallel then gives the
   converted layers torchao's float8 styles (`parallelize(..., float8_tp=True)`; tensorwise
   on CUDA only, see below), compile traces the float8 casts into the blocks' graphs, and
   FSDP2 all-gathers the weights in float8 when `Float8.fsdp_all_gather`.
3. `Float8.after_optimizer_step(modules)` after every optimizer step: with float8 all-gather,
   the weights' scales for the next step in one all-reduce
   (`precompute_float8_dynamic_scale_for_fsdp`); otherwise nothing.

Which layers: an `nn.Linear` is converted when its dims are both multiples of 16 (float8
GEMMs need it), both >= `quantize.float8_min_dim`, its name is not under a
`quantize.float8_skip` entry, and it is not the output projection unless
`quantize.float8_output`. The embedding, norms and attention stay as they are.

On CPU torchao's emulated path runs (`Float8LinearConfig(emulate=True)`): the same casts to
float8 and scales, the matmuls in high precision. It exists for tests (loss, layer
selection, FSDP on gloo), not speed. Tensor parallel on CPU keeps the plain styles: gloo has
no float8 dtype, so the float8 all-gather of activations that torchao's TP styles do cannot
run there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

from tidal.train.config import QuantizeConfig

TORCHAO_PIP = "pip install torchao==0.18.0"
"""The install command named by the error when torchao is missing (the tested version)."""
MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first float8 tensor cores (Ada; Hopper is 9.0)."""


def require_torchao(recipe: str) -> ModuleType:
    """`torchao.float8`, or an ImportError naming the pip command."""
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ImportError(
            f"quantize.float8={recipe} needs torchao, which is not installed ({e}); "
            f"install it with `{TORCHAO_PIP}`, or leave quantize.float8 at none"
        ) from None
    return float8


def check_float8(cfg: QuantizeConfig, device: torch.device, *, batch_invariant: bool) -> None:
    """The float8 checks that need no model: torchao present, a device with float8 GEMMs
    (or the CPU's emulation), no batch-invariant mode.

    Raises:
        ImportError: torchao is missing.
        ValueError: a GPU without float8 tensor cores, or training.batch_invariant.
    """
    if not cfg.enabled:
        return
    require_torchao(cfg.float8)
    if batch_invariant:
        raise ValueError(
            f"quantize.float8={cfg.float8} does not work with training.batch_invariant=true: "
            "the batch-invariant kernels cover high-precision matmuls only"
        )
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise ValueError(
                f"quantize.float8={cfg.float8} needs a GPU of compute capability "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, Hopper) for float8 "
                f"matmuls; {name} is {cap[0]}.{cap[1]}. Use quantize.float8=none"
            )
    elif device.type != "cpu":
        raise ValueError(
            f"quantize.float8={cfg.float8} runs on CUDA (float8 matmuls) or on the CPU "
            f"(emulated); not on {device.type}"
        )


def linear_filter(cfg: QuantizeConfig) -> Callable[[nn.Module, str], bool]:
    """The rule of the module docstring as torchao's `module_filter_fn(module, fqn)`."""
    skipped = cfg.skipped

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if fqn == "output" and not cfg.float8_output:
            return False
        if any(fqn == s or fqn.startswith(s + ".") for s in skipped):
            return False
        n_out, n_in = module.weight.shape
        if n_in % 16 or n_out % 16:
            return False
        return min(n_in, n_out) >= cfg.float8_min_dim

    return keep


def selected_linears(model: nn.Module, cfg: QuantizeConfig) -> list[str]:
    """Names of the linear layers of `model` that `convert` turns into float8."""
    keep = linear_filter(cfg)
    return [name for name, m in model.named_modules() if keep(m, name)]


@dataclass(kw_only=True)
class Float8:
    """What `convert` did: the recipe, whether it is emulated (CPU), whether FSDP all-gathers
    the weights in float8, and the converted layer names of each converted module."""

    recipe: str
    emulate: bool
    fsdp_all_gather: bool
    converted: list[list[str]] = field(default_factory=list)

    @property
    def tp_styles(self) -> bool:
        """Tensor parallel with torchao's float8 styles (activations cast to float8 before
        their all-gather): tensorwise scaling on CUDA. Rowwise, and gloo on CPU (no float8
        dtype), keep the plain styles around the float8 layers."""
        return self.recipe == "tensorwise" and not self.emulate

    def describe(self) -> str:
        n = sum(len(c) for c in self.converted)
        how = ", emulated on CPU" if self.emulate else ""
        gather = ", FSDP all-gather in float8" if self.fsdp_all_gather else ""
        return f"float8 {self.recipe} on {n} linear layers{how}{gather}"

    def after_optimizer_step(self, modules: Sequence[nn.Module]) -> None:
        """With float8 all-gather: the next step's weight scales, one all-reduce per module
        (without it each weight's scale would be computed inside its all-gather)."""
        if not self.fsdp_all_gather:
            return
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for module in modules:
            precompute_float8_dynamic_scale_for_fsdp(module)


def convert(
    model: nn.Module,
    cfg: QuantizeConfig,
    *,
    device: torch.device,
    fsdp: bool,
    state: Float8 | None = None,
    log: Callable[[str], None] = print,
) -> Float8 | None:
    """Swap the selected linear layers of `model` (a meta-device or materialized model, not
    yet parallelized or compiled) for torchao's Float8Linear, in place.

    Args:
        model: the model or one pipeline stage.
        cfg: the quantize section; None is returned when float8 is off.
        device: the training device: CPU selects the emulated path.
        fsdp: whether FSDP2 will shard the model (float8 all-gather then applies).
        state: the Float8 of an earlier stage of the same job, to record this one in.
        log: receives a note when the filter selects no layer at all, or when
            float8_fsdp_all_gather is set without FSDP.

    Returns:
        The job's Float8 (`state` when given), or None when quantize.float8 is none.

    Raises:
        ImportError: torchao is missing.
        ValueError: a module of the model is already converted.
    """
    if not cfg.enabled:
        return None
    float8 = require_torchao(cfg.float8)
    from torchao.float8.float8_linear import Float8Linear

    if any(isinstance(m, Float8Linear) for m in model.modules()):
        raise ValueError("the model already holds Float8Linear layers: convert it once")
    gather = cfg.float8_fsdp_all_gather
    gather = (cfg.float8 == "tensorwise") if gather is None else gather
    if state is None:
        state = Float8(recipe=cfg.float8, emulate=device.type == "cpu", fsdp_all_gather=False)
        if cfg.float8_fsdp_all_gather and not fsdp:
            log("warning: quantize.float8_fsdp_all_gather is ignored: this layout has no FSDP")
    state.fsdp_all_gather = bool(gather and fsdp)
    config = dataclasses.replace(
        float8.Float8LinearConfig.from_recipe_name(cfg.float8),
        emulate=state.emulate,
        enable_fsdp_float8_all_gather=state.fsdp_all_gather,
    )
    names = selected_linears(model, cfg)
    if names:
        float8.convert_to_float8_training(model, config=config, module_filter_fn=linear_filter(cfg))
    else:
        log(
            f"quantize.float8={cfg.float8}: no linear layer passes the filter (dims multiples "
            f"of 16 and >= quantize.float8_min_dim={cfg.float8_min_dim}); nothing converted"
        )
    state.converted.append(names)
    return state
