"""Parallel dimensions: how the world's ranks split into pp x dp_replicate x dp_shard x cp x tp.

`ParallelDims` validates the degrees against the world size (before any process-group work)
and builds one named DeviceMesh. Mesh dimension order, outermost first:

    pp, dp_replicate, dp_shard, cp, tp

so tensor-parallel peers are adjacent ranks (same host, fastest links) and pipeline stages are
the farthest apart. Derived, flattened dimensions:

- `dp`: dp_replicate x dp_shard, the ranks that see different data;
- `dp_shard_cp`: dp_shard x cp, the ranks FSDP shards parameters over (CP ranks hold the same
  weights and see different parts of the same sequences, so they shard like data parallel);
- `dp_cp`: dp_replicate x dp_shard x cp, the ranks whose gradients and token counts are summed.

At world size 1 every degree is 1 and the same code runs with degenerate meshes.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(kw_only=True, slots=True)
class ParallelDims:
    """Degrees of each parallelism; `dp_shard=-1` takes whatever the others leave."""

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallelism.{name} must be >= 1, got {getattr(self, name)}")
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by dp_replicate * cp * tp * pp"
                    f" = {self.dp_replicate} * {self.cp} * {self.tp} * {self.pp} = {others}"
                )
            self.dp_shard = self.world_size // others
        elif self.dp_shard < 1:
            raise ValueError(f"parallelism.dp_shard must be >= 1 or -1, got {self.dp_shard}")
        product = others * self.dp_shard
        if product != self.world_size:
            raise ValueError(
                f"parallel degrees multiply to {product} (dp_replicate={self.dp_replicate} x "
                f"dp_shard={self.dp_shard} x cp={self.cp} x tp={self.tp} x pp={self.pp}) but "
                f"the world size is {self.world_size}"
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
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    def build_mesh(self, device_type: str) -> NamedMesh:
        """The named world mesh with the flattened dp, dp_shard_cp and dp_cp dimensions."""
        mesh = init_device_mesh(device_type, tuple(self.degrees.values()), mesh_dim_names=MESH_DIMS)
        flat = {
            "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
            "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
            "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        }
        return NamedMesh(mesh, flat)

    def check_model(self, n_heads: int, n_kv_heads: int, n_layers: int, seq_len: int) -> None:
        """Raise ValueError when the model's shape does not divide over these degrees."""
        if n_heads % self.tp or n_kv_heads % self.tp:
            raise ValueError(
                f"tensor parallel degree {self.tp} must divide the query heads ({n_heads}) and "
                f"the key/value heads ({n_kv_heads})"
            )
        if self.pp > n_layers:
            raise ValueError(f"pipeline degree {self.pp} exceeds the {n_layers} layers")
        required = (2 * self.cp if self.cp > 1 else 1) * self.tp
        if seq_len % required:
            raise ValueError(
                f"training.seq_len={seq_len} must be divisible by {required}: sequence "
                f"parallel splits it over tp={self.tp} ranks and load-balanced context "
                f"parallel into 2 x cp={self.cp} chunks"
            )


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
