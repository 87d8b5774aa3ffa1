"""Process-group set-up for multi-rank runs.

Lifecycle: `torchrun --nproc_per_node N -m tidal train ...` (or `tidal train --nproc N`, which
execs torchrun) starts N processes with RANK, LOCAL_RANK, WORLD_SIZE and MASTER_ADDR/PORT in
their environment. The CLI reads them once with `DistInfo.from_env()` and hands the result to
the Trainer, which calls `init_process_group` (NCCL on CUDA, gloo on CPU) and tears it down
at the end. A single process without those variables runs with no process group at all.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DistInfo:
        """Read torchrun's RANK / LOCAL_RANK / WORLD_SIZE (single process when unset)."""
        src: Mapping[str, str] = os.environ if env is None else env
        return cls(
            rank=int(src.get("RANK", 0)),
            local_rank=int(src.get("LOCAL_RANK", 0)),
            world_size=int(src.get("WORLD_SIZE", 1)),
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# Flight Recorder settings: each group holds the names one setting has had across torch
# versions (torch 2.13 reads both the TORCH_FR_ and the older TORCH_NCCL_ names). A user who
# set any name of a group keeps it: tidal sets none of that group.
_FR_BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_FR_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
_FR_DUMP = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)


def enable_flight_recorder(
    folder: str | os.PathLike, entries: int, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Turn on PyTorch's NCCL Flight Recorder for the process groups made after this call:
    a ring buffer of the last `entries` collectives per rank, written to `folder`/rank_<R>
    when the watchdog sees a timeout or an error. Sets the variables in `environ`
    (os.environ by default) unless the user set them, creates `folder`, and returns what it
    set. ProcessGroupNCCL reads them when a group is created, so call it before
    `init_process_group`; they mean nothing to gloo."""
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    path = os.path.abspath(os.fspath(folder))
    os.makedirs(path, exist_ok=True)
    wanted = {_FR_BUFFER: str(entries), _FR_FILE: os.path.join(path, "rank_"), _FR_DUMP: "1"}
    set_here = {}
    for names, value in wanted.items():
        if any(name in env for name in names):
            continue
        for name in names:
            env[name] = set_here[name] = value
    return set_here


def init_process_group(info: DistInfo, device: torch.device) -> None:
    """Join the default process group (if world_size > 1 and not already joined)."""
    if info.world_size == 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None  # eager NCCL init on our GPU
    dist.init_process_group(
        backend, rank=info.rank, world_size=info.world_size, device_id=device_id
    )


def destroy_process_group() -> None:
    """Leave every process group and free their communicators now, not at interpreter exit.

    A ProcessGroup lives as long as anything refers to it: a DeviceMesh keeps its groups (in
    ``_pg_registry``), FSDP2 the ones it shards over, and torch's own caches of sharding
    plans keep meshes for the life of the process. A group still alive when the interpreter
    shuts down is destroyed during that shutdown, and a gloo group destroyed there aborts its
    process now and then (``terminate called without an active exception``, SIGABRT at exit:
    3 of 20 exits of a 2-rank job that kept its mesh, on the 2-core dev VM; 0 of 40 once the
    groups were freed before exit). So after leaving the groups this empties every mesh's
    registry of them and collects: the groups' worker threads are joined here, in a live
    interpreter. Callers drop their parallelized modules first (``Trainer.close`` does)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _empty_mesh_registries()  # in a frame of its own: it holds no object past its return
    for _ in range(4):  # finalizers of one pass (FSDP's hooks) leave garbage for the next
        if not gc.collect():
            break


def _empty_mesh_registries() -> None:
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        # type(), not isinstance(): the objects include dead weak proxies, which raise on
        # isinstance, and deprecated torch names, which warn.
        if type(obj) is DeviceMesh:
            registry = getattr(obj, "_pg_registry", None)  # fallback: none kept in a mesh
            if isinstance(registry, dict):
                registry.clear()
