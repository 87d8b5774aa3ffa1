"""A cold one-shot sync through ``tidal store serve``: a fresh process puts a bf16 state dict
once (plain ``put_state_dict``, no reserve), another fresh process gets it once into its own
tensors, against memcpy of the same bytes and DCP save + load through /dev/shm by two fresh
processes, all in this run.

    python benchmarks/store_cold.py                  # 512 MB in 16 tensors, default pool
    python benchmarks/store_cold.py --pool-gb 0      # no pool: every page faulted in by the put
    python benchmarks/store_cold.py --runs 3

Targets (issue 35): the first put at >= 50% of memcpy; put + get >= 10x DCP.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

import torch
import torch.multiprocessing as mp


def make_sd(mb: int, tensor_mb: int, fill: float) -> dict[str, torch.Tensor]:
    n = max(1, mb // tensor_mb)
    rows = tensor_mb * (1 << 20) // (2 * 4096)
    return {f"layers.{i}.w": torch.full((rows, 4096), fill, dtype=torch.bfloat16) for i in range(n)}


def child(conn, role: str, address: str, mb: int, tensor_mb: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    import tidal.store

    sd = make_sd(mb, tensor_mb, 1.0 if role.startswith("put") else 0.0)  # touched memory
    t = time.perf_counter()
    if role == "put tidal":
        with tidal.store.connect(address) as store:
            t = time.perf_counter()  # the put alone (connect: one round trip, not timed)
            store.put_state_dict(sd, "cold", version=1)
    elif role == "get tidal":
        with tidal.store.connect(address) as store:
            t = time.perf_counter()
            store.get_state_dict("cold", into=sd, version=1)
    elif role == "put dcp":
        dcp.save(sd, checkpoint_id=path)
    else:
        dcp.load(sd, checkpoint_id=path)
    took = time.perf_counter() - t
    if role.startswith("get"):
        assert all(bool((v == 1.0).all()) for v in sd.values()), "wrong bytes"
    conn.send(took)


def run_child(ctx, role: str, *args) -> float:
    parent, end = ctx.Pipe()
    proc = ctx.Process(target=child, args=(end, role, *args))
    proc.start()
    end.close()
    try:
        if not parent.poll(300):
            raise TimeoutError(f"{role} took over 300 s")
        return parent.recv()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def memcpy_gbs(mb: int) -> float:
    src = torch.ones(mb << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return src.numel() / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=512, help="state dict size")
    ap.add_argument("--tensor-mb", type=int, default=32, help="size of each tensor")
    ap.add_argument("--pool-gb", type=float, default=None, help="serve's --pool-gb")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after serve starts")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--root", default="/dev/shm", help="file system for DCP")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    gb = sum(t.numel() * 2 for t in make_sd(args.mb, args.tensor_mb, 0.0).values()) / 1e9
    cmd = [sys.executable, "-m", "tidal.store", "serve"]
    if args.pool_gb is not None:
        cmd += ["--pool-gb", str(args.pool_gb)]
    print(f"{gb:.3f} GB bf16, {args.mb // args.tensor_mb} tensors; {' '.join(cmd[1:])}")
    print(
        f"{'run':>3} {'memcpy GB/s':>11} {'put s':>7} {'put GB/s':>8} {'of memcpy':>9} "
        f"{'get s':>7} {'DCP s':>7} {'tidal vs DCP':>12}"
    )
    for r in range(args.runs):
        serve = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        path = os.path.join(args.root, f"tidal-cold-dcp-{os.getpid()}")
        try:
            assert serve.stdout is not None
            address = serve.stdout.readline().split()[4]
            time.sleep(args.settle)  # a server started ahead of its first put, as usual
            mc = memcpy_gbs(args.mb)
            put = run_child(ctx, "put tidal", address, args.mb, args.tensor_mb, path)
            get = run_child(ctx, "get tidal", address, args.mb, args.tensor_mb, path)
        finally:
            serve.terminate()
            serve.wait(60)
        try:
            save = run_child(ctx, "put dcp", "", args.mb, args.tensor_mb, path)
            load = run_child(ctx, "get dcp", "", args.mb, args.tensor_mb, path)
        finally:
            shutil.rmtree(path, ignore_errors=True)
        print(
            f"{r:>3} {mc:11.2f} {put:7.3f} {gb / put:8.2f} {gb / put / mc:9.0%} "
            f"{get:7.3f} {save + load:7.3f} {(save + load) / (put + get):11.1f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
