"""Run a function on N spawned CPU ranks (gloo) and collect what each returns."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.multiprocessing as mp

from tidal.parallel.launch import destroy_process_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": result}, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"rank{rank}.pt"))
        raise
    finally:
        # fn's meshes and models are gone with its frame: free their process groups now,
        # not during interpreter shutdown (see tidal.parallel.launch.destroy_process_group).
        destroy_process_group()


def run_ranks(world: int, fn, *args, tmp_path) -> list:
    """fn(rank, world, *args) on `world` processes; returns the list of results by rank."""
    out_dir = tmp_path / f"ranks_{fn.__name__}_{free_port()}"
    out_dir.mkdir()
    try:
        mp.start_processes(
            _entry,
            args=(world, free_port(), fn, args, str(out_dir)),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
    except Exception as e:
        errors = []
        for r in range(world):
            path = out_dir / f"rank{r}.pt"
            if path.exists():
                res = torch.load(path, weights_only=False)
                if "error" in res:
                    errors.append(f"rank {r}:\n{res['error']}")
        raise AssertionError("\n".join(errors) or str(e)) from None
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False)["ok"] for r in range(world)]
