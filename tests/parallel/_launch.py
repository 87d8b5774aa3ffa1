"""Run a function on N CPU ranks (gloo) and collect what each returns (`run_ranks`), start
N processes as `torch.multiprocessing.spawn` does (`spawn`), or make one `Process`.

The processes are forked from multiprocessing's fork server, which imports torch and the
trainer once per test session (`PRELOAD`): a rank then starts in well under a second, where a
spawned one imported torch and tidal anew (several seconds per launch on 2 cores, and the suite
launches processes some 50 times). A fork server's child is a fresh fork of that
single-threaded server (not of the test process, whose threads and process groups it does not
inherit); it gets the test's environment as it is at the launch (`_in_env` sets it), as a
spawned one would.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import socket
import traceback
from multiprocessing.process import BaseProcess

import torch
import torch.multiprocessing as mp

from tidal.parallel.launch import destroy_process_group

PRELOAD = ["torch", "torch.distributed", "tidal.train.trainer"]
"""Imported once by the fork server before its first fork (its children share them)."""
multiprocessing.set_forkserver_preload(PRELOAD)  # no effect once the server has started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_env(rank: int, env: dict, fn, *args) -> None:
    os.environ.clear()  # the launching test's environment, not the fork server's
    os.environ.update(env)
    fn(rank, *args)


def _target_in_env(env: dict, target, *args) -> None:
    _in_env(0, env, lambda _rank: target(*args))


def process(target, args: tuple = (), **kwargs) -> BaseProcess:
    """`multiprocessing.Process(target=target, args=args, ...)` of the fork server."""
    ctx = multiprocessing.get_context("forkserver")
    return ctx.Process(target=_target_in_env, args=(dict(os.environ), target, *args), **kwargs)


def spawn(fn, args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)`, forked from the fork server: runs
    fn(rank, *args) on each process, joins them and raises if any failed."""
    mp.start_processes(
        _in_env,
        args=(dict(os.environ), fn, *args),
        nprocs=nprocs,
        join=True,
        start_method="forkserver",
    )


def _entry(rank: int, world: int, port: int, fn, args, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    faulthandler.enable()  # a rank that crashes prints where, in the test's captured stderr
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
        spawn(_entry, (world, free_port(), fn, args, str(out_dir)), world)
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
