"""Validate a large layout in one CPU process: fake process group, meta-device model.

`dry_run(args, parallelism, activation_checkpoint, world_size=...)` checks the layout with
`check_layout`, joins a fake process group as rank 0 of `world_size`, builds the named mesh,
cuts pipeline stages, applies the full `parallelize` (TP, activation checkpointing, FSDP;
compile is skipped) to meta-device models and reports, per pipeline stage, what one rank
holds: parameters, and the bytes of parameters, gradients and AdamW state. No tensor is
allocated and no math runs. With expert parallelism it also reports the EP layout: experts per
rank, the ranks they are FSDP-sharded over, and the expert parameters one rank holds.
`tidal train --dry-run WORLD_SIZE` calls it with the pieces of the training config
(tidal/cli.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tidal.models.transformer import ModelArgs, Transformer
from tidal.parallel.config import ActivationCheckpointConfig, ParallelismConfig
from tidal.parallel.dims import check_layout
from tidal.parallel.parallelize import parallelize
from tidal.parallel.pipeline import build_stages

GIB = 2**30


def local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def dry_run(
    args: ModelArgs,
    parallelism: ParallelismConfig,
    activation_checkpoint: ActivationCheckpointConfig,
    *,
    world_size: int,
    seq_len: int,
    batch_size: int,
    bf16: bool = True,
    model_name: str = "the model",
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Report per-rank parameter counts and memory for each pipeline stage of the model `args`
    spread as `parallelism` over `world_size` ranks, each with micro-batches of `batch_size`
    sequences of `seq_len` tokens; `bf16` sets FSDP's compute dtype as training would. Raises
    ValueError (from `check_layout`) before any process group for an invalid layout."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims = check_layout(
        parallelism,
        args,
        world_size=world_size,
        seq_len=seq_len,
        batch_size=batch_size,
        model_name=model_name,
    )
    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = dims.build_mesh("cpu")
        with torch.device("meta"):
            full = Transformer(args)
        total = sum(p.numel() for p in full.parameters())
        if dims.pp > 1:
            stage_sets = [build_stages(args, parallelism, r) for r in range(dims.pp)]
            per_rank = [(r, s.ids, s.modules) for r, s in enumerate(stage_sets)]
        else:
            per_rank = [(0, [0], [full])]
        reports: list[dict] = []
        for pp_rank, ids, modules in per_rank:
            n = n_experts = 0
            for m in modules:
                parallelize(
                    m,
                    mesh,
                    dims,
                    parallelism,
                    activation_checkpoint,
                    compile=False,
                    param_dtype=torch.bfloat16 if bf16 else None,
                )
                n += sum(local_numel(p) for p in m.parameters())
                n_experts += sum(
                    local_numel(p) for name, p in m.named_parameters() if ".experts." in name
                )
            # fp32 master weights + fp32 grads + AdamW exp_avg and exp_avg_sq.
            state_gib = n * 4 * 4 / GIB
            reports.append(
                {
                    "pp_rank": pp_rank,
                    "stages": ids,
                    "params_per_rank": n,
                    "expert_params_per_rank": n_experts,
                    "param_state_gib": state_gib,
                }
            )
        layout = ", ".join(f"{k}={v}" for k, v in dims.degrees.items())
        if dims.ep > 1:
            layout += f", ep={dims.ep} (of dp_shard)"
        log(
            f"dry run: {model_name} ({total / 1e9:.2f}B parameters) on {world_size} ranks: {layout}"
        )
        if dims.ep > 1 and args.moe is not None:
            E = args.moe.n_experts
            log(
                f"  expert parallel: {E // dims.ep} of {E} experts per rank (ep={dims.ep}), "
                f"FSDP-sharded over dp_shard/ep={dims.dp_shard_mod_ep} ranks; other parameters "
                f"over dp_shard={dims.dp_shard}"
                + (
                    f"; attention TP-sharded over tp={dims.tp}, the MoE (router, experts, "
                    f"shared experts) replicated over it"
                    if dims.tp > 1
                    else ""
                )
            )
        for r in reports:
            log(
                f"  pp rank {r['pp_rank']} (stages {r['stages']}): "
                f"{r['params_per_rank'] / 1e6:,.1f}M parameters per rank"
                + (
                    f" ({r['expert_params_per_rank'] / 1e6:,.1f}M of them routed experts)"
                    if args.moe is not None
                    else ""
                )
                + ", "
                f"{r['param_state_gib']:.2f} GiB for weights + grads + AdamW state"
            )
        log("layout OK: meshes built and every stage sharded on the meta device")
        return reports
    finally:
        dist.destroy_process_group()
