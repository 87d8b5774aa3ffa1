"""The torchstore side of benchmarks/store_peer.py, run by it in torchstore's own environment
(torch, torchmonarch and torchstore; never the project's): it imports monarch and
torchstore, which tidal's environment does not have.

Its layout mirrors the tidal side: ``ts.initialize()`` spawns torchstore's controller and one
storage volume (the default singleton strategy, shared-memory transport); writers and
readers are monarch actors, one process each, in meshes of 1 (put, get) or 4 -> 2 ranks
(FSDP -> TP, gloo groups for the DTensors). Each rank times its own calls; a row is the
slowest rank of each round. Results go to a JSON file (never pickled).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import tempfile
import time

import torch
import torchstore as ts
from monarch.actor import Actor, current_rank, endpoint, this_host

COLS = 4096


def shapes(mb: int, tensors: int) -> list[tuple[int, int]]:
    rows = (mb << 20) // tensors // (4 * COLS)
    rows -= rows % 8  # divisible by the 4 FSDP ranks (and 8)
    return [(rows, COLS)] * tensors


def make_sd(shape_list, layout: str, world: int, rank: int, fill: bool) -> dict:
    """Plain fp32 tensors (layout "full"), or DTensor shards: "fsdp" Shard(0), "tp" Shard(1)."""
    if layout == "full":
        return {
            f"layers.{i}.w": torch.full(s, float(i + 1) if fill else 0.0)
            for i, s in enumerate(shape_list)
        }
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    dim = 0 if layout == "fsdp" else 1
    out = {}
    for i, s in enumerate(shape_list):
        local = list(s)
        local[dim] //= world
        t = torch.full(local, float(i + 1) if fill else 0.0)
        out[f"layers.{i}.w"] = DTensor.from_local(
            t, mesh, [Shard(dim)], shape=torch.Size(s), stride=(s[1], 1)
        )
    return out


class Worker(Actor):
    def __init__(self, world: int, init_file: str, mb: int, tensors: int, layout: str) -> None:
        self.rank = current_rank().rank
        self.world = world
        os.environ["LOCAL_RANK"] = str(self.rank)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        if world > 1:
            torch.distributed.init_process_group(
                "gloo", init_method=f"file://{init_file}", rank=self.rank, world_size=world
            )
        self.shapes = shapes(mb, tensors)
        self.layout = layout

    def _barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    @endpoint
    async def put(self, key: str, rounds: int) -> list[float]:
        sd = make_sd(self.shapes, self.layout, self.world, self.rank, True)
        times = []
        for _ in range(rounds):
            self._barrier()
            t = time.perf_counter()
            await ts.put_state_dict(sd, key)
            times.append(time.perf_counter() - t)
        return times

    @endpoint
    async def get(self, key: str, rounds: int) -> list[float]:
        into = make_sd(self.shapes, self.layout, self.world, self.rank, False)
        times = []
        for _ in range(rounds):
            for t in into.values():
                (t.to_local() if hasattr(t, "to_local") else t).zero_()
            self._barrier()
            t = time.perf_counter()
            await ts.get_state_dict(key, into)
            times.append(time.perf_counter() - t)
        for i, t in enumerate(into.values()):
            local = t.to_local() if hasattr(t, "to_local") else t
            assert bool((local == float(i + 1)).all()), f"torchstore get {key}: wrong bytes"
        return times

    @endpoint
    async def done(self) -> None:
        if self.world > 1:
            torch.distributed.destroy_process_group()


def _slowest(values) -> list[float]:
    per_rank = [v for _, v in values.items()]
    return [max(r[i] for r in per_rank) for i in range(len(per_rank[0]))]


async def _mesh(n: int, tmp: str, name: str, mb: int, tensors: int, layout: str):
    procs = this_host().spawn_procs(per_host={"procs": n})
    return procs.spawn(name, Worker, n, os.path.join(tmp, name), mb, tensors, layout)


async def run(mb: int, tensors: int, rounds: int) -> dict[str, list[float]]:
    await ts.initialize()
    out: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        writer = await _mesh(1, tmp, "writer", mb, tensors, "full")
        out["put"] = _slowest(await writer.put.call("sd", rounds + 1))
        reader = await _mesh(1, tmp, "reader", mb, tensors, "full")
        out["get"] = _slowest(await reader.get.call("sd", rounds + 1))
        fsdp = await _mesh(4, tmp, "fsdp", mb, tensors, "fsdp")
        out["fsdp put"] = _slowest(await fsdp.put.call("fsdp", 1))
        tp = await _mesh(2, tmp, "tp", mb, tensors, "tp")
        out["reshard"] = _slowest(await tp.get.call("fsdp", rounds + 1))
        await fsdp.done.call()
        await tp.done.call()
    await ts.shutdown()
    return out


def main() -> None:
    mb, tensors, rounds, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    assert math.prod(shapes(mb, tensors)[0]) > 0, "state dict too small"
    result = asyncio.run(run(mb, tensors, rounds))
    with open(out, "w") as f:
        json.dump({"torch": torch.__version__, "rows": result}, f)


if __name__ == "__main__":
    main()
