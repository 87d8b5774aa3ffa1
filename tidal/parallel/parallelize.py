"""Spread a tidal Transformer over a DeviceMesh, from outside the model.

`parallelize(model, mesh, dims, ...)` applies, in this order:

1. tensor parallel with sequence parallel (declarative plans below; loss-parallel output when
   asked), on the `tp` mesh dimension; with `float8_tp`, torchao's float8 styles for the
   layers already converted to float8 (`float8_tp_plan`);
2. activation checkpointing (none, full, per-op selective, or every N blocks);
3. per-block `torch.compile`;
4. FSDP2 `fully_shard` per block and at the root over `dp_shard_cp` (HSDP when
   `dp_replicate > 1`: a 2-D (dp_replicate, dp_shard_cp) mesh), with a MixedPrecisionPolicy.

Expert parallelism (`ep` > 1, mixture-of-experts models) comes with step 1: the routed experts
are sharded over the `ep` mesh dimension and exchange tokens by all-to-all; in step 4 they
are FSDP-sharded over `dp_shard_mod_ep` before their block (tidal/parallel/expert.py).

It works on a meta-device model: call it before `to_empty` and `init_weights`, and after any
float8 conversion (tidal/train/float8.py), which must see plain `nn.Linear`s. Context
parallelism is applied per step around forward and backward (tidal/parallel/context.py), and
pipeline stages are cut before this runs (tidal/parallel/pipeline.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from tidal.models.moe import MoE
from tidal.models.transformer import Transformer
from tidal.parallel.config import ActivationCheckpointConfig, ParallelismConfig
from tidal.parallel.dims import NamedMesh, ParallelDims
from tidal.parallel.expert import apply_ep, shard_experts


def tp_plan_root(loss_parallel: bool, sequence_parallel: bool = True) -> dict:
    """Embedding, final norm and output projection. Activations between blocks are sharded
    over the sequence (Shard(1)); the output is vocabulary-sharded for a loss-parallel loss.
    Without `sequence_parallel` (generation: a decode step has one token per row, which
    cannot be split over ranks) activations stay replicated and the norm runs on every rank."""
    between = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    return plan


def tp_plan_block(
    sequence_parallel: bool = True, *, moe: bool = False, qk_norm: bool = False
) -> dict:
    """One transformer block: norms sequence-parallel, q/k/v and w1/w3 column-wise (heads and
    hidden units split), wo and w2 row-wise back to sequence-sharded activations. Without
    `sequence_parallel`, wo and w2 all-reduce to replicated activations and the norms are
    left alone (replicated).

    With `moe` (a mixture-of-experts MLP, beside expert parallel) only attention is split:
    the MoE gets its tokens gathered whole (plain tensors, the same on every TP rank) and
    runs replicated over `tp`; its output is cut back to this rank's part of the sequence
    (tidal/parallel/expert.py explains why this is correct and what it costs).

    With `qk_norm` (Qwen 3) and `sequence_parallel` (training), the per-head RMSNorms of q
    and k see only this rank's heads: their weights become DTensors replicated over `tp` and
    their inputs head-sharded (`Shard(2)` of [B, T, H, K]), so the weight gradients, partial
    per rank, are summed over the TP ranks (as torchtitan's Qwen 3 plan does). Generation
    (no `sequence_parallel`) takes no gradients and keeps them plain."""
    linears: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
    }
    if qk_norm and sequence_parallel:
        linears |= {
            "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        }
    if not moe:
        linears |= {
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
        }
    if not sequence_parallel:
        if moe:  # activations are replicated already: the MoE runs on them as they are
            return linears | {"attention.wo": RowwiseParallel(output_layouts=Replicate())}
        return linears | {
            "attention.wo": RowwiseParallel(output_layouts=Replicate()),
            "feed_forward.w2": RowwiseParallel(output_layouts=Replicate()),
        }
    # Attention.forward(x, rope, mask, cache): only x is sharded (on the sequence).
    gather_input = PrepareModuleInput(
        input_layouts=(Shard(1), None, None, None),
        desired_input_layouts=(Replicate(), None, None, None),
    )
    attention = {
        "attention_norm": SequenceParallel(),
        "attention": gather_input,
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if moe:
        # Gather the sequence into a plain tensor for the MoE; slice its (replicated) output
        # back to this rank's Shard(1) part. Backward: the output's gradient is all-gathered,
        # the input's (the same on every TP rank) sliced.
        moe_io = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        )
        return linears | attention | {"feed_forward": moe_io}
    return (
        linears
        | attention
        | {
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
    )


def float8_tp_plan(module: nn.Module, plan: dict) -> dict:
    """`plan` with torchao's float8 styles (tensorwise scaling, dynamic) for the linear
    layers of `module` that are Float8Linear: their inputs are cast to float8 before the
    sequence-parallel all-gather, so it moves half the bytes. A PrepareModuleInput in front
    of attention or the MLP becomes the float8 one only when every linear fed by that input
    is float8 (it hands them an already-cast tensor, which a plain linear cannot take).
    Layers left in high precision keep their plain styles."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    def is_float8(name: str) -> bool:
        return isinstance(module.get_submodule(name), Float8Linear)

    out = dict(plan)
    for name, style in plan.items():
        if isinstance(style, (ColwiseParallel, RowwiseParallel)) and is_float8(name):
            cls = (
                Float8ColwiseParallel
                if isinstance(style, ColwiseParallel)
                else Float8RowwiseParallel
            )
            out[name] = cls(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
    fed = {"attention": ("wq", "wk", "wv"), "feed_forward": ("w1", "w3")}
    for name, style in plan.items():
        linears = fed.get(name)
        if isinstance(style, PrepareModuleInput) and linears:
            if all(is_float8(f"{name}.{x}") for x in linears):
                out[name] = PrepareFloat8ModuleInput(
                    input_layouts=style.input_layouts,
                    desired_input_layouts=style.desired_input_layouts,
                    fwd_config_submodule_fqn=linears[0],  # relative to the module
                )
    return out


def apply_tp(
    model: Transformer,
    tp_mesh: DeviceMesh,
    loss_parallel: bool,
    sequence_parallel: bool = True,
    *,
    float8: bool = False,
) -> None:
    root = tp_plan_root(loss_parallel, sequence_parallel)
    root = {k: v for k, v in root.items() if getattr(model, k) is not None}
    # The embedding is sharded row-wise and the output column-wise: they cannot share a
    # weight. check_layout rejects such layouts before any process group exists.
    assert not model.args.tie_embeddings, "tensor parallel needs untied embeddings"
    # The root keeps plain styles under float8 too (as torchtitan's): an output layer in
    # float8 is fed gathered, replicated activations and its logits go to the loss as they are.
    parallelize_module(model, tp_mesh, root)
    for block in model.layers.values():
        plan = tp_plan_block(
            sequence_parallel,
            moe=isinstance(block.feed_forward, MoE),
            qk_norm=model.args.qk_norm,
        )
        parallelize_module(block, tp_mesh, float8_tp_plan(block, plan) if float8 else plan)


def apply_ac(model: Transformer, cfg: ActivationCheckpointConfig) -> None:
    """Wrap blocks in activation checkpointing according to `cfg`."""
    if cfg.mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    every = int(cfg.selective) if cfg.mode == "selective" and cfg.selective != "op" else 1
    for i, (name, block) in enumerate(list(model.layers.items())):
        if i % every:
            continue
        if cfg.mode == "selective" and cfg.selective == "op":
            wrapped = checkpoint_wrapper(
                block, context_fn=_selective_op_context, preserve_rng_state=False
            )
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        model.layers[name] = wrapped


_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_op_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        if op in _SAVE_OPS:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_compile(model: Transformer, mode: str = "default", dynamic: bool | None = None) -> None:
    """Compile each block on its own: one graph shape reused by every layer."""
    for block in model.layers.values():
        # In place: parameter names and state-dict keys stay the same.
        block.compile(mode=mode, dynamic=dynamic)


def apply_fsdp(
    model: Transformer,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reshard_after_forward: str,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """FSDP2 per block, then the root (embedding, norm, output) in one more group. With
    `expert_mesh` (expert parallel: dp_shard_mod_ep), each block's expert-parallel experts
    first get their own group over it."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        if reshard_after_forward == "default":
            # The last block's parameters are needed again right away by backward.
            reshard = i < len(blocks) - 1
        else:
            reshard = reshard_after_forward == "always"
        if expert_mesh is not None:
            shard_experts(
                block,
                expert_mesh,
                mp=mp,
                reshard_after_forward=reshard,
                divide_factor=float(dp_mesh.size()),
            )
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(
        model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward == "always"
    )
    # The cached forward (the end-of-run sample, greedy evaluation) gathers the root's
    # parameters as `forward` does.
    register_fsdp_forward_method(model, "forward_cached")


def parallelize(
    model: Transformer,
    mesh: NamedMesh | None,
    dims: ParallelDims,
    cfg: ParallelismConfig,
    ac: ActivationCheckpointConfig,
    *,
    compile: bool,
    param_dtype: torch.dtype | None,
    float8_tp: bool = False,
    compile_mode: str = "default",
    compile_dynamic: bool | None = None,
) -> Transformer:
    """Apply TP/SP, activation checkpointing, compile and FSDP2 to `model` in place. `mesh`
    is None only in a single process, where every degree is 1. `float8_tp`: give the float8
    layers (converted beforehand) torchao's float8 TP styles (`float8_tp_plan`). `compile_mode`:
    the torch.compile mode of the blocks; `compile_dynamic`, their `dynamic`."""
    sharded = dims.tp > 1 or dims.fsdp_enabled
    assert mesh is not None or not sharded, "a sharded layout needs a device mesh"
    if dims.tp > 1 and mesh is not None:
        apply_tp(model, mesh["tp"], cfg.loss_parallel, float8=float8_tp)
    if dims.ep > 1 and mesh is not None:
        apply_ep(model, mesh["ep"])
    apply_ac(model, ac)
    if compile:
        apply_compile(model, compile_mode, compile_dynamic)
    if dims.fsdp_enabled and mesh is not None:
        if dims.dp_replicate == 1:
            dp_mesh = mesh["dp_shard_cp"]
        elif dims.cp == 1:  # HSDP from root dimensions (no flattened dim to slice)
            dp_mesh = mesh["dp_replicate", "dp_shard"]
        else:
            dp_mesh = mesh["dp_replicate", "dp_shard_cp"]
        apply_fsdp(
            model,
            dp_mesh,
            param_dtype=param_dtype,
            reshard_after_forward=cfg.reshard_after_forward,
            expert_mesh=mesh["dp_shard_mod_ep"] if dims.ep > 1 else None,
        )
    return model
