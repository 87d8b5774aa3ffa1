"""Parallel dimensions: how the world's ranks split into pp x dp_replicate x dp_shard x cp x tp.

`check_layout` validates a `ParallelismConfig` against the world size, the model and the batch
shape (before any process-group work) and returns the `ParallelDims`, which build one named
DeviceMesh. Mesh dimension order, outermost first:

    pp, dp_replicate, dp_shard, cp, tp

so tensor-parallel peers are adjacent ranks (same host, fastest links) and pipeline stages are
the farthest apart. Derived, flattened dimensions:

- `dp`: dp_replicate x dp_shard, the ranks that see different data;
- `dp_shard_cp`: dp_shard x cp, the ranks FSDP shards parameters over (CP ranks hold the same
  weights and see different parts of the same sequences, so they shard like data parallel);
- `dp_cp`: dp_replicate x dp_shard x cp, the ranks whose gradients and token counts are summed.

Expert parallelism (`ep` > 1, mixture-of-experts models) borrows its ranks from dp_shard, as
torchtitan's does: the root dimension dp_shard is then split into `dp_shard_mod_ep` (outer)
x `ep` (inner, adjacent ranks), and `dp_shard` becomes a flattened dimension of the two, so
everything that shards or reduces over dp_shard is unchanged. The routed experts are sharded
over `ep` and FSDP-sharded over `dp_shard_mod_ep` (tidal/parallel/expert.py). Beside `tp`
(TP for attention) `ep` still comes from dp_shard only: the MoE runs replicated over the TP
ranks, so `ep` must divide world / tp. `ep` with dp_replicate, cp or pp is refused.

At world size 1 every degree is 1 and the same code runs with degenerate meshes.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tidal.models.transformer import ModelArgs
from tidal.parallel.config import ParallelismConfig
from tidal.parallel.pipeline import SINGLE_STAGE, stage_layers

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def check_layout(
    cfg: ParallelismConfig,
    args: ModelArgs,
    *,
    world_size: int,
    seq_len: int,
    batch_size: int,
    model_name: str = "the model",
) -> ParallelDims:
    """The layout `cfg` on `world_size` ranks, checked against the model `args` and each rank's
    micro-batch (`batch_size` sequences of `seq_len` tokens). Needs no process group.

    Every check that involves more than one field or the world size is here; checks of one
    field alone are in `ParallelismConfig.__post_init__`. `model_name` names the model in
    messages (the trainer passes "model.flavor 'NAME'").

    Raises:
        ValueError: naming the field to change and what it must satisfy.
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if cfg.ep > 1:
        check_ep(cfg, args, world_size=world_size, model_name=model_name)
    # The degrees multiply to the world size; dp_shard=-1 takes what the others leave.
    others = cfg.dp_replicate * cfg.cp * cfg.tp * cfg.pp
    if cfg.dp_shard == -1 and world_size % others:
        raise ValueError(
            f"world size {world_size} is not divisible by dp_replicate * cp * tp * pp"
            f" = {cfg.dp_replicate} * {cfg.cp} * {cfg.tp} * {cfg.pp} = {others}"
        )
    dp_shard = world_size // others if cfg.dp_shard == -1 else cfg.dp_shard
    if others * dp_shard != world_size:
        raise ValueError(
            f"parallel degrees multiply to {others * dp_shard} (dp_replicate={cfg.dp_replicate} "
            f"x dp_shard={dp_shard} x cp={cfg.cp} x tp={cfg.tp} x pp={cfg.pp}) but the world "
            f"size is {world_size}"
        )

    # The model and the sequence divide over the degrees.
    if args.n_heads % cfg.tp or args.n_kv_heads % cfg.tp:
        raise ValueError(
            f"tensor parallel degree {cfg.tp} must divide the query heads ({args.n_heads}) and "
            f"the key/value heads ({args.n_kv_heads})"
        )
    if cfg.pp > args.n_layers:
        raise ValueError(f"pipeline degree {cfg.pp} exceeds the {args.n_layers} layers")
    required = (2 * cfg.cp if cfg.cp > 1 else 1) * cfg.tp
    if seq_len % required:
        raise ValueError(
            f"training.seq_len={seq_len} must be divisible by {required}: sequence "
            f"parallel splits it over tp={cfg.tp} ranks and load-balanced context "
            f"parallel into 2 x cp={cfg.cp} chunks"
        )
    if args.tie_embeddings and (cfg.tp > 1 or cfg.pp > 1):
        why = (
            "tensor parallel needs untied embeddings (the embedding is sharded by rows, the "
            "output projection by columns)"
            if cfg.tp > 1
            else "pipeline parallel needs untied embeddings (the first and last stages would "
            "share a weight)"
        )
        raise ValueError(f"{why}; {model_name} ties them: use a flavor with tie_embeddings=False")

    if cfg.pp > 1:
        spr = cfg.stages_per_rank
        if cfg.pp_schedule in SINGLE_STAGE and spr != 1:
            raise ValueError(
                f"pp_schedule {cfg.pp_schedule} runs one stage per rank, got "
                f"pp_stages_per_rank={spr}"
            )
        if cfg.pp_schedule not in SINGLE_STAGE and spr < 2:
            raise ValueError(f"pp_schedule {cfg.pp_schedule} needs pp_stages_per_rank >= 2")
        if cfg.pp_schedule == "ZBVZeroBubble" and spr != 2:
            raise ValueError(
                f"pp_schedule ZBVZeroBubble places exactly 2 stages on each pipeline rank, got "
                f"pp_stages_per_rank={spr}"
            )
        stage_layers(args.n_layers, cfg.pp * spr, cfg.pp_split)  # raises on a bad split
        n_micro = cfg.microbatches
        if batch_size % n_micro:
            raise ValueError(
                f"training.batch_size={batch_size} must be divisible by the {n_micro} pipeline "
                f"micro-batches (parallelism.pp_microbatches)"
            )
        if cfg.pp_schedule != "GPipe" and n_micro < cfg.pp:
            raise ValueError(
                f"pp_schedule {cfg.pp_schedule} needs at least pp={cfg.pp} micro-batches, got "
                f"{n_micro}; raise parallelism.pp_microbatches (and training.batch_size)"
            )
        if cfg.pp_schedule not in SINGLE_STAGE and n_micro % cfg.pp:
            raise ValueError(
                f"pp_schedule {cfg.pp_schedule} needs the micro-batch count ({n_micro}) to be a "
                f"multiple of pp={cfg.pp}"
            )
        if args.attention == "flex":
            raise ValueError(
                "pipeline parallel runs the sdpa attention path only; set --model.attention sdpa"
            )
        if cfg.cp > 1:
            raise ValueError(
                "pipeline and context parallel together are not supported yet; "
                "use parallelism.pp=1 or parallelism.cp=1"
            )
    return ParallelDims(
        dp_replicate=cfg.dp_replicate,
        dp_shard=dp_shard,
        cp=cfg.cp,
        tp=cfg.tp,
        pp=cfg.pp,
        world_size=world_size,
        ep=cfg.ep,
    )


def check_ep(cfg: ParallelismConfig, args: ModelArgs, *, world_size: int, model_name: str) -> None:
    """The expert-parallel degree against the model and the world (`check_layout`'s first
    checks when `cfg.ep` > 1)."""
    if args.moe is None:
        raise ValueError(
            f"parallelism.ep={cfg.ep} needs a mixture-of-experts model; {model_name} is dense"
        )
    if args.moe.n_experts % cfg.ep:
        raise ValueError(
            f"parallelism.ep={cfg.ep} must divide the {args.moe.n_experts} experts of {model_name}"
        )
    if world_size % cfg.ep:
        raise ValueError(f"parallelism.ep={cfg.ep} must divide the world size {world_size}")
    others = {"dp_replicate": cfg.dp_replicate, "cp": cfg.cp, "pp": cfg.pp}
    bad = ", ".join(f"parallelism.{k}={v}" for k, v in others.items() if v > 1)
    if bad:
        raise ValueError(
            f"parallelism.ep={cfg.ep} composes with FSDP (dp_shard) and TP only, not with {bad}"
        )
    # ep borrows from dp_shard: it must divide what tp leaves of the world.
    if cfg.tp > 1 and world_size // cfg.tp % cfg.ep:
        raise ValueError(
            f"parallelism.ep={cfg.ep} must divide dp_shard = world size {world_size} / "
            f"tp={cfg.tp} = {world_size // cfg.tp}"
        )


@dataclass(kw_only=True, slots=True)
class ParallelDims:
    """Degrees of each parallelism, resolved and multiplying to the world size (made by
    `check_layout`; tests may build one directly)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int = 1
    ep: int = 1
    """Expert-parallel degree, borrowed from dp_shard (not a factor of the world size)."""

    def __post_init__(self) -> None:
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        assert min(self.degrees.values()) >= 1 and product == self.world_size, (
            f"degrees {self.degrees} must be >= 1 and multiply to the world size "
            f"{self.world_size}; check_layout validates a layout"
        )
        assert self.ep >= 1 and self.dp_shard % self.ep == 0, (
            f"ep={self.ep} must divide dp_shard={self.dp_shard}"
        )

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """fully_shard is applied: parameters sharded over dp_shard x cp, or replicated over
        dp_replicate (HSDP)."""
        return self.dp_shard * self.cp > 1 or self.dp_replicate > 1

    @property
    def dp_shard_mod_ep(self) -> int:
        """The ranks the routed experts are FSDP-sharded over: dp_shard / ep."""
        return self.dp_shard // self.ep

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    def build_mesh(self, device_type: str) -> NamedMesh:
        """The named world mesh with the flattened dp, dp_shard_cp and dp_cp dimensions (and,
        with ep > 1, root dimensions dp_shard_mod_ep and ep, flattened into dp_shard)."""
        if self.ep == 1:
            mesh = init_device_mesh(
                device_type, tuple(self.degrees.values()), mesh_dim_names=MESH_DIMS
            )
            shard: tuple[str, ...] = ("dp_shard",)
            flat = {}
        else:
            names = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
            sizes = (self.pp, self.dp_replicate, self.dp_shard_mod_ep, self.ep, self.cp, self.tp)
            mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
            shard = ("dp_shard_mod_ep", "ep")
            flat = {"dp_shard": mesh[shard]._flatten("dp_shard")}
        flat |= {
            "dp": mesh[("dp_replicate", *shard)]._flatten("dp"),
            "dp_shard_cp": mesh[(*shard, "cp")]._flatten("dp_shard_cp"),
            "dp_cp": mesh[("dp_replicate", *shard, "cp")]._flatten("dp_cp"),
        }
        return NamedMesh(mesh, flat)


class NamedMesh:
    """The world mesh plus its flattened dimensions, indexed by name.

    Flattened meshes are kept as `_flatten` returned them (torch deprecates slicing them back
    out of the root mesh); root dimensions and tuples of them are sliced from the root.
    """

    def __init__(self, root: DeviceMesh, flat: dict[str, DeviceMesh]):
        self.root, self.flat = root, flat

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str) and names in self.flat:
            return self.flat[names]
        return self.root[names]
