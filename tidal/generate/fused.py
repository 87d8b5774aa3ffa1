"""Fused projections of a Generator (`GeneratorConfig.fuse_projections`): the query, key and
value projections of every attention block as one product, and the gate and up projections
(W1, W3) of every dense MLP as another, so a decode step runs 2 matmuls where it ran 5 per
layer (and one bias add where Qwen 2 ran three).

The seam is the model's own: `Attention.project` and `FeedForward.gate_up` compute the
projections (tidal/models/transformer.py). For each block the Generator builds a copy of the
`TransformerBlock` whose attention and dense MLP are `FusedAttention` and `FusedFeedForward`:
shallow copies of the model's modules (every submodule, norm and parameter shared) whose
`project` / `gate_up` is one `nn.Linear` over a weight of stacked rows. The model object is
left as the trainer uses it (same modules, same forward, same parameters and state-dict
keys); the Generator runs the copies through `Transformer.forward_cached(blocks=...)`, which
a compiled block function (compile_scope="blocks") wraps as it wraps the model's blocks.

The stacked weight is not a copy: when the copies are built, the model's `wq`, `wk`, `wv`
weights (and biases) are laid out once as consecutive rows of one tensor, and each parameter's
data becomes its view into it (`param.data = rows`; the Parameter objects stay the same, as
do their values). In-place weight loads (`Generator.load_weights`, `load_from_store`, an RL
prefetcher's swap, all of which copy into `model.state_dict()`'s tensors) thereby write the
fused weight: nothing is refreshed, no memory is added, and its address, which captured CUDA
graphs read, never changes. A state dict taken from the model before the Generator was built
still holds the old tensors: take it afterwards. A second Generator over the same model finds
the parameters already laid out and shares the same tensor. Replacing a parameter's storage
afterwards (`model.to(...)`, `load_state_dict(assign=True)`) breaks the link: `check` (run at
every `generate`) raises then.

A product over stacked weights is the same sum per output feature, but a GEMM may tile a
wider N differently: results can differ from the three products in the last bits (fp32 on
CPU: log-probs within ~1e-6; see tests/generate/test_fused_projections.py). Hence off in
batch-invariant mode, whose fixed-shape reduction blocks are chosen by N.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tidal.generate.types import GeneratorConfig
from tidal.models.transformer import (
    Attention,
    FeedForward,
    Transformer,
    TransformerBlock,
    plain_linear,
)

M = TypeVar("M", bound=nn.Module)


class FusedAttention(Attention):
    """An `Attention` that shares the model's module's submodules and computes Q, K and V as
    one product over `wqkv` (built by `fuse_blocks`, never constructed directly)."""

    wqkv: nn.Linear
    qkv_sizes: list[int]

    def project(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_BTE, k_BTE, v_BTE = self.wqkv(x_BTD).split(self.qkv_sizes, dim=-1)
        return q_BTE, k_BTE, v_BTE


class FusedFeedForward(FeedForward):
    """A `FeedForward` that shares the model's module's submodules and computes the gate and
    up projections as one product over `w13` (built by `fuse_blocks`)."""

    w13: nn.Linear

    def gate_up(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate_BTF, up_BTF = self.w13(x_BTD).chunk(2, dim=-1)
        return gate_BTF, up_BTF


def fuse_enabled(config: GeneratorConfig, model: Transformer) -> bool:
    """`config.fuse_projections` checked against this model and mode.

    Raises:
        ValueError: True with `batch_invariant`, or with DTensor parameters.
    """
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    want = config.fuse_projections
    if want and config.batch_invariant:
        raise ValueError(
            "GeneratorConfig.fuse_projections=True with batch_invariant=True: a product over "
            "stacked weights changes the fixed reduction blocks, so the log-probs would no "
            "longer match the trainer's bit for bit; leave fuse_projections off there"
        )
    if want and sharded:
        raise ValueError(
            "GeneratorConfig.fuse_projections=True for a model with DTensor parameters "
            "(tensor parallel or FSDP): their shards cannot be laid out as one tensor; leave "
            "fuse_projections off for it"
        )
    return want


class FusedBlocks:
    """The fused copies of a model's blocks (see the module docstring).

    Args:
        model: the Generator's model; its attention and dense-MLP projection parameters are
            laid out as views into one tensor per module, in place.

    Modules whose projections are not plain `nn.Linear` layers of one dtype and device
    without hooks (float8 layers, tensor-parallel ones) are left unfused, as are
    mixture-of-experts layers (their shared experts too).
    """

    def __init__(self, model: Transformer):
        self.blocks: list[nn.Module] = []
        """One callable per layer, in order, for `forward_cached(blocks=...)`: the fused copy
        of the block, or the block itself where nothing was fused."""
        self.fused = 0
        """Attention and MLP modules fused."""
        self._links: list[tuple[str, torch.Tensor, int]] = []  # (name, parameter, data_ptr)
        for layer, block in model.layers.items():
            self.blocks.append(self._block(f"layers.{layer}", block))

    def _block(self, name: str, block: nn.Module) -> nn.Module:
        if not isinstance(block, TransformerBlock):
            return block
        children: dict[str, nn.Module] = {}
        if _fusable(block.attention, Attention.FUSABLE):
            att = _copy_as(block.attention, FusedAttention)
            linears = [getattr(att, n) for n in Attention.FUSABLE]
            att.wqkv = self._stack(f"{name}.attention", Attention.FUSABLE, linears)
            att.qkv_sizes = [lin.out_features for lin in linears]
            children["attention"] = att
        ffn = block.feed_forward
        if isinstance(ffn, FeedForward) and _fusable(ffn, FeedForward.FUSABLE):
            mlp = _copy_as(ffn, FusedFeedForward)
            linears = [getattr(mlp, n) for n in FeedForward.FUSABLE]
            mlp.w13 = self._stack(f"{name}.feed_forward", FeedForward.FUSABLE, linears)
            children["feed_forward"] = mlp
        if not children:
            return block
        self.fused += len(children)
        fused = _copy_as(block, type(block))
        for child, module in children.items():
            setattr(fused, child, module)
        return fused

    @torch.no_grad()
    def _stack(self, name: str, names: Sequence[str], linears: Sequence[nn.Linear]) -> nn.Linear:
        """One `nn.Linear` whose weight (and bias) rows are the linears' in order, their
        parameters laid out as views into it."""
        weight = _stacked([lin.weight for lin in linears])
        has_bias = linears[0].bias is not None
        out = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
        out.weight = nn.Parameter(weight, requires_grad=False)
        if has_bias:
            out.bias = nn.Parameter(_stacked([lin.bias for lin in linears]), requires_grad=False)
        for n, lin in zip(names, linears, strict=True):
            for kind, p in (("weight", lin.weight), ("bias", lin.bias)):
                if p is not None:
                    self._links.append((f"{name}.{n}.{kind}", p, p.data_ptr()))
        return out

    def check(self) -> None:
        """Raise when a fused parameter no longer lies in its stacked tensor.

        Raises:
            RuntimeError: a parameter's storage was replaced after the Generator was built
                (e.g. `model.to(...)`, `load_state_dict(assign=True)`): the fused products
                would read stale weights.
        """
        for name, p, ptr in self._links:
            if p.data_ptr() != ptr:
                raise RuntimeError(
                    f"parameter {name} was moved to new memory after the Generator was built "
                    "(GeneratorConfig.fuse_projections reads it through a stacked tensor): "
                    "load weights in place (Generator.load_weights, load_from_store) or build "
                    "a new Generator"
                )


def _fusable(module: nn.Module, names: Sequence[str]) -> bool:
    """Whether the named projections are plain `nn.Linear` layers without hooks, with plain
    tensor weights of one dtype and device, and biases on all or none."""
    linears = [getattr(module, n) for n in names]
    if not all(plain_linear(lin) for lin in linears):
        return False
    params = [p for lin in linears for p in (lin.weight, lin.bias) if p is not None]
    if any(isinstance(p, DTensor) for p in params):
        return False
    if len({(p.dtype, p.device) for p in params}) != 1:
        return False
    return len({lin.bias is None for lin in linears}) == 1


def _copy_as(module: nn.Module, cls: type[M]) -> M:
    """A shallow copy of `module` as an instance of `cls` (the class or a subclass that adds
    no state of its own): the same attributes, parameters, buffers and submodules, shared,
    in registries of its own, so that setting a submodule on the copy leaves `module` as it
    is."""
    copy = cls.__new__(cls)
    state = {k: type(v)(v) if isinstance(v, (dict, set)) else v for k, v in vars(module).items()}
    copy.__dict__.update(state)
    return copy


def _stacked(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One tensor whose leading-dimension blocks are `params` in order, each parameter's data
    laid out as its view into it; the parameters' own memory when they already lie so."""
    found = _adjacent(params)
    if found is not None:
        return found
    stacked = torch.cat([p.detach() for p in params])
    for p, rows in zip(params, stacked.split([p.shape[0] for p in params]), strict=True):
        p.data = rows
    return stacked


def _adjacent(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensor spanning `params` when they are contiguous blocks, one after another, of
    one storage (a Generator built before laid them out), else None."""
    first = params[0]
    storage = first.untyped_storage()
    offset = first.storage_offset()
    for p in params:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        if p.storage_offset() != offset or p.shape[1:] != first.shape[1:]:
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in params)
    out = first.detach().new_empty(0)
    shape = (rows, *first.shape[1:])
    stride = [math.prod(shape[i + 1 :]) for i in range(len(shape))]  # contiguous
    return out.set_(storage, first.storage_offset(), shape, stride)


__all__ = ["FusedAttention", "FusedBlocks", "FusedFeedForward", "fuse_enabled"]
