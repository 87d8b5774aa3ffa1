"""Loading a Hugging Face checkpoint into DTensor state dicts (FSDP2, TP, FSDP2 + TP) on four
spawned CPU ranks: every local shard equals its slice of the full tensor, and every rank reads
exactly the elements of its own shards through safetensors slices."""

from __future__ import annotations

from pathlib import Path

from tests.parallel._launch import run_ranks

DATA = Path(__file__).parent / "data"


class _CountingHandle:
    """A safe_open handle that records how many elements each read returns."""

    def __init__(self, handle, reads: dict[str, int]):
        self.handle, self.reads = handle, reads

    def get_slice(self, name):
        handle, reads = self.handle, self.reads

        class Slice:
            def __getitem__(self, index):
                t = handle.get_slice(name)[index]
                reads[name] = reads.get(name, 0) + t.numel()
                return t

        return Slice()

    def get_tensor(self, name):
        t = self.handle.get_tensor(name)
        self.reads[name] = self.reads.get(name, 0) + t.numel()
        return t

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)


def _load_sharded(rank: int, world: int, folder: str) -> dict:
    import safetensors
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from tidal.models import Transformer, load_hf
    from tidal.models.hf import hf_model_args, load_hf_state_dict

    reads: dict[str, int] = {}
    real_open = safetensors.safe_open
    safetensors.safe_open = lambda *a, **kw: _CountingHandle(real_open(*a, **kw), reads)

    dist.init_process_group("gloo")
    try:
        full = load_hf(folder).state_dict()
        args = hf_model_args(folder)
        flat = init_device_mesh("cpu", (world,))
        mesh2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        block_plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
        root_plan = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(),
        }
        out = {}
        for layout in ("fsdp", "tp", "fsdp+tp"):
            with torch.device("meta"):
                model = Transformer(args)
            if "tp" in layout:
                parallelize_module(model, mesh2d["tp"], root_plan)
                for block in model.layers.values():
                    parallelize_module(block, mesh2d["tp"], block_plan)
            if "fsdp" in layout:
                dp = mesh2d["dp"] if "tp" in layout else flat
                for block in model.layers.values():
                    fully_shard(block, mesh=dp)
                fully_shard(model, mesh=dp)
            model.to_empty(device="cpu")
            sd = model.state_dict()
            reads.clear()
            load_hf_state_dict(folder, sd)
            mismatched, local_numel, placements = [], 0, set()
            for key, t in sd.items():
                if isinstance(t, DTensor):
                    want = distribute_tensor(
                        full[key], t.device_mesh, t.placements, src_data_rank=None
                    ).to_local()
                    local = t.to_local()
                    placements.add(str(t.placements))
                else:
                    want, local = full[key], t
                local_numel += local.numel()
                if not torch.equal(local, want):
                    mismatched.append(key)
            out[layout] = {
                "mismatched": mismatched,
                "read": sum(reads.values()),
                "local": local_numel,
                "full": sum(v.numel() for v in full.values()),
                "placements": sorted(placements),
            }
        return out
    finally:
        dist.destroy_process_group()


def test_dtensor_shards_read_only_their_slices(tmp_path):
    # tiny_qwen3 has vocab 99: the embedding and output rows split unevenly (25/25/25/24).
    results = run_ranks(4, _load_sharded, str(DATA / "tiny_qwen3"), tmp_path=tmp_path)
    for rank, by_layout in enumerate(results):
        for layout, r in by_layout.items():
            assert not r["mismatched"], (rank, layout, r["mismatched"])
            assert r["read"] == r["local"], (rank, layout, r)  # its own shards, nothing more
            assert r["read"] < r["full"] / 1.5, (rank, layout, r)
            assert r["placements"], (rank, layout)
    # The layouts differ as intended: FSDP shards every tensor over 4 ranks, TP over 2.
    fsdp, tp = results[0]["fsdp"], results[0]["tp"]
    assert fsdp["read"] < tp["read"]
    assert any(
        "_StridedShard" in p or "Shard(dim=0), Shard(dim=0)" in p
        for p in results[0]["fsdp+tp"]["placements"]
    )
