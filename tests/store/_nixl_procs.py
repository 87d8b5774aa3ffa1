"""Workers for tests/store/test_nixl.py (imported by spawned processes)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import tidal.store
from tests.store import _procs
from tidal.store import wire

SHAPES = {"emb": (12, 256), "w1": (20, 64), "w2": (64, 20), "norm": (64,)}


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = {}
    for name, dtype in sorted(wire.DTYPES.items()):
        top = 2 if dtype == torch.bool else 256  # bool: only 0 and 1 are values
        raw = torch.randint(0, top, (37 * 11 * dtype.itemsize,), dtype=torch.uint8, generator=g)
        out[name] = raw.view(dtype).view(37, 11)  # every bit pattern kind, NaNs included
    out["wide"] = torch.randn(16, 512, generator=g)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=g)


def put_every_dtype(address: str) -> None:
    with tidal.store.connect(address) as store:
        store.put_state_dict(every_dtype(), "dtypes", version=0)


def get_every_dtype(address: str) -> None:
    with tidal.store.connect(address, transport="nixl") as store:
        want = every_dtype()
        got = store.get_state_dict("dtypes", version=0)
        for k, w in want.items():
            assert torch.equal(_bytes(got[k]), _bytes(w)), k
        into = {k: torch.empty(11, 37, dtype=w.dtype).t() for k, w in want.items()}  # strided
        into["wide"] = torch.empty(16, 1024)[:, 256:768]  # strided rows: read straight in
        store.get_state_dict("dtypes", into=into, version=0)
        for k, w in want.items():
            assert torch.equal(_bytes(into[k]), _bytes(w)), k
        sent = store.session.nixl().messages  # type: ignore[attr-defined]
        store.get_state_dict("dtypes", into=into, version=0)
        assert store.session.nixl().messages == sent, "a steady get asked the volume again"


def _init(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def fsdp4_put(rank: int, world: int, address: str, init_file: str) -> None:
    _init(rank, world, init_file)
    mesh = init_device_mesh("cpu", (world,))
    sd = {n: distribute_tensor(full(n), mesh, [Shard(0)]) for n in SHAPES}
    with tidal.store.connect(address) as store:
        store.put_state_dict({"model": sd}, "fsdp", version=0)
    dist.destroy_process_group()


def tp2_get(rank: int, world: int, address: str, init_file: str) -> None:
    _init(rank, world, init_file)
    mesh = init_device_mesh("cpu", (world,))
    # Column-parallel w1 and emb rows, row-parallel w2 (strided boxes), replicated norm.
    placements = {"emb": Shard(1), "w1": Shard(0), "w2": Shard(1), "norm": Shard(0)}
    into = {n: distribute_tensor(torch.zeros(SHAPES[n]), mesh, [placements[n]]) for n in SHAPES}
    with tidal.store.connect(address, transport="nixl") as store:
        store.get_state_dict("fsdp", into={"model": into}, version=0)
    for n, t in into.items():
        want = distribute_tensor(full(n), mesh, [placements[n]]).to_local()
        assert torch.equal(t.to_local(), want), f"{n} differs on rank {rank}"
    dist.destroy_process_group()


def churn_writer(address: str) -> None:
    with tidal.store.connect(address) as store:
        for v in range(1, _procs.VERSIONS):
            store.put_state_dict(_procs.payload(v), "c", version=v)


def churn_reader(address: str) -> None:
    from tidal.store import VersionNotFoundError

    store = tidal.store.connect(address, transport="nixl")
    into = {
        "a": torch.empty(_procs.N, dtype=torch.int64),
        "b": torch.empty(1000, dtype=torch.int64),
    }
    seen, reads = -1, 0
    deadline = time.monotonic() + 120
    while seen < _procs.VERSIONS - 1:
        assert time.monotonic() < deadline, f"the writer never reached its last version ({seen})"
        try:
            v = _procs.version_of(store.get_state_dict("c", into=into))
        except KeyError:  # KeyNotFoundError, VersionNotFoundError: nothing committed yet
            if seen >= 0:
                raise
            time.sleep(0.01)
            continue
        assert v >= seen, f"latest went backwards: {seen} -> {v}"
        seen, reads = v, reads + 1
        try:
            old = max(1, v - 2)
            assert _procs.version_of(store.get_state_dict("c", version=old)) == old
        except VersionNotFoundError as e:
            assert "evicted" in str(e), str(e)
    assert reads > 1
    store.close()


def volume_process(address: str, pipe) -> None:
    """A standalone volume joining the store at ``address`` (killed by the test)."""
    from tidal.store.standalone import run_volume

    run_volume(address, "vol1", ready=lambda a: pipe.send(os.getpid()))


def put_big(address: str, nbytes: int) -> None:
    with tidal.store.connect(address, volume="vol1") as store:
        store.put("big", torch.arange(nbytes // 8, dtype=torch.int64), version=0)


def get_every_dtype_cuda(address: str) -> None:
    with tidal.store.connect(address, transport="nixl") as store:
        want = every_dtype()
        into = {k: torch.empty_like(w, device="cuda") for k, w in want.items()}
        store.get_state_dict("dtypes", into=into, version=0)
        torch.cuda.synchronize()
        for k, w in want.items():
            assert torch.equal(_bytes(into[k].cpu()), _bytes(w)), k
