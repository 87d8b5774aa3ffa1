"""The same state dict read through each store transport, in one run: shared memory, TCP and
NIXL (forced on this host with ``transport="nixl"``; skipped with the reason when NIXL is not
installed), against memcpy of the same bytes.

    python benchmarks/store_transports.py                 # 512 MB bf16, 16 tensors, CPU
    python benchmarks/store_transports.py --mb 256 --iters 3
    python benchmarks/store_transports.py --device cuda   # readers' tensors on the GPU

A store in this process holds the state dict (put once); a reader in a fresh process per
transport gets it into its own tensors ``--iters`` times after one warm-up get (which opens
what the transport keeps: mappings, connections, NIXL registrations); medians are printed.
Targets (issue 35): NIXL >= 2x TCP, and >= 50% of memcpy at 512 MB.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

import tidal.store
from tidal.store.transports import nixl


def make_sd(mb: int, fill: float, device: str = "cpu") -> dict[str, torch.Tensor]:
    n = max(1, mb // 32)
    rows = (mb << 20) // n // (2 * 4096)
    return {
        f"layers.{i}.w": torch.full((rows, 4096), fill, dtype=torch.bfloat16, device=device)
        for i in range(n)
    }


def reader(conn, address: str, transport: str, mb: int, iters: int, device: str) -> None:
    try:
        into = make_sd(mb, 0.0, device)  # the reader's own memory, touched
        store = tidal.store.connect(address, transport=transport)  # type: ignore[arg-type]
        times = []
        for i in range(iters + 1):
            for t in into.values():
                t.zero_()
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            store.get_state_dict("sd", into=into, version=0)
            if device == "cuda":
                torch.cuda.synchronize()
            if i:  # the first get opens what the transport keeps
                times.append(time.perf_counter() - start)
            assert all(bool((t == 1.0).all()) for t in into.values()), "wrong bytes"
        store.close()
        conn.send(("ok", statistics.median(times)))
    except Exception as e:  # reported as the row's result
        conn.send(("error", f"{type(e).__name__}: {e}"))


def run(ctx, *args) -> tuple[str, object]:
    parent, end = ctx.Pipe()
    proc = ctx.Process(target=reader, args=(end, *args))
    proc.start()
    end.close()
    try:
        if not parent.poll(600):
            return "error", "no result within 600 s"
        return parent.recv()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def memcpy_s(mb: int) -> float:
    src, dst = make_sd(mb, 1.0), make_sd(mb, 0.0)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        for k, s in src.items():
            dst[k].copy_(s)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="readers' tensors")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    sd = make_sd(args.mb, 1.0)
    gb = sum(t.numel() * 2 for t in sd.values()) / 1e9
    print(f"{gb:.3f} GB bf16 in {len(sd)} tensors; readers' tensors on {args.device}")
    rows: dict[str, float | str] = {}
    with tidal.store.connect(keep=1) as store:
        store.put_state_dict(sd, "sd", version=0)
        rows["memcpy"] = memcpy_s(args.mb)
        for transport in ("shm", "tcp", "nixl"):
            if transport == "nixl" and not nixl.available():
                rows[transport] = "not installed (pip install 'tidal[nixl]')"
                continue
            status, value = run(ctx, store.address, transport, args.mb, args.iters, args.device)
            rows[transport] = value if status == "ok" else f"failed: {value}"  # type: ignore[assignment]
    mc = rows["memcpy"]
    assert isinstance(mc, float)
    print(f"\n{'path':8s} {'seconds':>9s} {'GB/s':>7s} {'of memcpy':>9s}")
    for name, s in rows.items():
        if isinstance(s, float):
            print(f"{name:8s} {s:9.4f} {gb / s:7.2f} {mc / s:9.0%}")
        else:
            print(f"{name:8s} {s}")
    n, t = rows.get("nixl"), rows.get("tcp")
    if isinstance(n, float) and isinstance(t, float):
        print(f"\nNIXL {t / n:.2f}x TCP (target >= 2x), {mc / n:.0%} of memcpy (target >= 50%)")


if __name__ == "__main__":
    main()
