"""Run a function on N CPU ranks (gloo) and collect what each returns (`run_ranks`), start
N processes as `torch.multiprocessing.spawn` does (`spawn`), or make one `Process`.

The processes are forked from multiprocessing's fork server, which imports torch and the
trainer once per test session (`PRELOAD`): a rank then starts in well under a second, where a
spawned one imported torch and tidal anew (several seconds per launch on 2 cores, and the suite
launches processes some 50 times). A fork server's child is a fresh fork of that
single-threaded server (not of the test process, whose threads and process groups it does not
inherit); it gets the test's environment as it is at the launch (`_in_env` sets it), as a
spawned one would.

The ranks rendezvous through a TCPStore that `run_ranks` holds in the test process on a port
the kernel picked (port 0), as torchrun's agent does (`TORCHELASTIC_USE_AGENT_STORE`: every
rank connects as a client). Picking a free port, closing it and letting rank 0 bind it later
raced with any other process on the machine (CI saw `EADDRINUSE` on rank 0's store once).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import tempfile
import traceback
from datetime import timedelta
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tidal.parallel.launch import destroy_process_group

PRELOAD = ["torch", "torch.distributed", "tidal.train.trainer"]
"""Imported once by the fork server before its first fork (its children share them)."""
multiprocessing.set_forkserver_preload(PRELOAD)  # no effect once the server has started


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
        TORCHELASTIC_USE_AGENT_STORE="True",  # the store is run_ranks': connect to it
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
    out_dir = tempfile.mkdtemp(prefix=f"ranks_{fn.__name__}_", dir=tmp_path)
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=5)
    )
    try:
        spawn(_entry, (world, store.port, fn, args, out_dir), world)
    except Exception as e:
        errors = []
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if os.path.exists(path):
                res = torch.load(path, weights_only=False)
                if "error" in res:
                    errors.append(f"rank {r}:\n{res['error']}")
        raise AssertionError("\n".join(errors) or str(e)) from None
    finally:
        del store  # the server stops with its last reference
    return [
        torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)["ok"]
        for r in range(world)
    ]
