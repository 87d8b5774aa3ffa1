"""Workers for the multi-process resharding tests (imported by spawned processes).

Three jobs share one embedded store living in the pytest process:
  A (2 ranks) puts 2-rank layouts;  B (4 ranks) reads A's into 4-rank layouts and puts
  4-rank layouts (1-D, 2-D FSDP x TP, uneven, FSDP2 and FSDP2+TP models);  C (2 ranks)
  reads B's into 2-rank layouts. Every read is checked against the full tensor and against
  what DCP loads into the same destination from a checkpoint of the same source.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import tidal.store
from tidal.parallel.launch import destroy_process_group


def full(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(dtype)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 8)
        self.w1 = nn.Linear(8, 20)  # 20 rows: uneven over 3 or 8, even over 2/4
        self.w2 = nn.Linear(20, 8)
        self.norm = nn.LayerNorm(8)


def tiny_full() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in Tiny().state_dict().items()}


def tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"w1": ColwiseParallel(), "w2": RowwiseParallel()}


def _init(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def _check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got_l = got.to_local() if isinstance(got, DTensor) else got
    want_l = want.to_local() if isinstance(want, DTensor) else want
    assert torch.equal(got_l, want_l), f"{name}: store result differs on rank {dist.get_rank()}"


def put_case(store, ckpt: str, key: str, src) -> None:
    store.put(key, src, version=0)
    dcp.save({"t": src}, checkpoint_id=os.path.join(ckpt, key))


def get_case(store, ckpt: str, key: str, shape, dtype, mesh, placements) -> None:
    ref = full(key, shape, dtype)
    dst = distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, placements)
    store.get(key, into=dst, version=0)
    _check(f"{key} vs full", dst, distribute_tensor(ref, mesh, placements))
    via_dcp = distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, placements)
    dcp.load({"t": via_dcp}, checkpoint_id=os.path.join(ckpt, key))
    _check(f"{key} vs DCP", dst, via_dcp)
    # The same destination again (a cached plan) after a second version.
    store.put(key + "/again", full(key, shape, dtype) * 2) if dist.get_rank() == 0 else None
    dist.barrier()
    dst2 = distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, placements)
    store.get(key + "/again", into=dst2)
    _check(f"{key} again", dst2, distribute_tensor(ref * 2, mesh, placements))


def _job_a(rank: int, world: int, address: str, init_file: str, ckpt: str) -> None:
    _init(rank, world, init_file)
    store = tidal.store.connect(address)
    mesh = init_device_mesh("cpu", (2,))
    put_case(store, ckpt, "row2", distribute_tensor(full("row2", (8, 6)), mesh, [Shard(0)]))
    put_case(store, ckpt, "repl2", distribute_tensor(full("repl2", (6, 10)), mesh, [Replicate()]))
    dist.barrier()
    # Row-wise -> column-wise within the same job.
    get_case(store, ckpt, "row2", (8, 6), torch.float32, mesh, [Shard(1)])
    store.close()


def _job_b(rank: int, world: int, address: str, init_file: str, ckpt: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    _init(rank, world, init_file)
    store = tidal.store.connect(address)
    mesh = init_device_mesh("cpu", (4,))
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # Reads of A's 2-rank layouts: 2 -> 4 ranks, replicated -> sharded, 1-D -> 2-D.
    get_case(store, ckpt, "row2", (8, 6), torch.float32, mesh, [Shard(0)])
    get_case(store, ckpt, "repl2", (6, 10), torch.float32, mesh, [Shard(1)])
    get_case(store, ckpt, "row2", (8, 6), torch.float32, mesh2d, [Shard(1), Shard(0)])
    # 4-rank layouts for job C.
    put_case(store, ckpt, "row4", distribute_tensor(full("row4", (8, 6)), mesh, [Shard(0)]))
    t2d = distribute_tensor(full("fsdp_tp", (8, 6)), mesh2d, [Shard(0), Shard(1)])
    put_case(store, ckpt, "fsdp_tp", t2d)
    put_case(store, ckpt, "uneven", distribute_tensor(full("uneven", (7, 5)), mesh, [Shard(0)]))
    # TP on a sub-mesh, replicated over dp: 4 writers, 2 distinct shards.
    put_case(
        store, ckpt, "tp_sub", distribute_tensor(full("tp_sub", (6, 4)), mesh2d["tp"], [Shard(0)])
    )
    bf = full("bf16", (4, 9), torch.bfloat16)
    put_case(store, ckpt, "bf16", distribute_tensor(bf, mesh, [Shard(1)]))
    # Whole models: FSDP2 over 4 ranks, and FSDP2 + TP on the 2-D mesh.
    ref = tiny_full()
    m = Tiny()
    m.load_state_dict(ref)
    fully_shard(m, mesh=mesh)
    sd = m.state_dict()
    assert all(isinstance(v, DTensor) for v in sd.values())
    store.put_state_dict(sd, "fsdp_model", version=0)
    dcp.save(sd, checkpoint_id=os.path.join(ckpt, "fsdp_model"))
    m2 = Tiny()
    m2.load_state_dict(ref)
    parallelize_module(m2, mesh2d["tp"], tp_plan())
    fully_shard(m2, mesh=mesh2d["dp"])
    sd2 = m2.state_dict()
    store.put_state_dict(sd2, "fsdp_tp_model", version=0)
    dcp.save(sd2, checkpoint_id=os.path.join(ckpt, "fsdp_tp_model"))
    # And read the FSDP2 model back into this job's 2-D model (4 -> 2x2 within a job).
    dist.barrier()
    got = {k: torch.zeros_like(v) for k, v in sd2.items()}
    store.get_state_dict("fsdp_model", into=got)
    for k, v in got.items():
        _check(f"fsdp_model->{k}", v, sd2[k])
    store.close()


def _job_c(rank: int, world: int, address: str, init_file: str, ckpt: str) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    _init(rank, world, init_file)
    store = tidal.store.connect(address)
    mesh = init_device_mesh("cpu", (2,))
    get_case(store, ckpt, "row4", (8, 6), torch.float32, mesh, [Shard(0)])  # 4 -> 2
    get_case(store, ckpt, "fsdp_tp", (8, 6), torch.float32, mesh, [Shard(1)])  # 2-D -> 1-D TP
    get_case(store, ckpt, "uneven", (7, 5), torch.float32, mesh, [Shard(0)])  # 2,2,2,1 -> 4,3
    get_case(store, ckpt, "uneven", (7, 5), torch.float32, mesh, [Shard(1)])  # rows -> cols
    get_case(store, ckpt, "bf16", (4, 9), torch.bfloat16, mesh, [Replicate()])
    get_case(store, ckpt, "tp_sub", (6, 4), torch.float32, mesh, [Shard(1)])
    ref = tiny_full()
    for key in ("fsdp_model", "fsdp_tp_model"):
        m = Tiny()
        parallelize_module(m, mesh, tp_plan())
        dst = {k: torch.zeros_like(v) for k, v in m.state_dict().items()}
        store.get_state_dict(key, into=dst, version=0)
        via_dcp = {k: torch.zeros_like(v) for k, v in m.state_dict().items()}
        dcp.load(via_dcp, checkpoint_id=os.path.join(ckpt, key))
        for k, v in dst.items():
            want = ref[k]
            if isinstance(v, DTensor):
                want = distribute_tensor(want, v.device_mesh, v.placements)
            _check(f"{key}.{k} vs full", v, want)
            _check(f"{key}.{k} vs DCP", v, via_dcp[k])
        # Bytes in place: the model's own parameters hold the values.
        m.load_state_dict(dst)
        w1 = m.w1.weight
        assert isinstance(w1, DTensor) and torch.equal(w1.full_tensor(), ref["w1.weight"])
    store.close()


def _ended(body):
    """The job ``body`` as a spawn target: once it returned (its meshes and models gone with
    its frame), the process groups are freed before the interpreter exits."""

    def job(*args) -> None:
        try:
            body(*args)
        finally:
            destroy_process_group()

    return job


def job_a(*args) -> None:
    _ended(_job_a)(*args)


def job_b(*args) -> None:
    _ended(_job_b)(*args)


def job_c(*args) -> None:
    _ended(_job_c)(*args)
