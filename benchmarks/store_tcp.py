"""tidal.store over TCP loopback vs a plain socket moving the same bytes.

The parent process holds an embedded store with one bf16 tensor and also serves the same
bytes on a plain socket (4 MiB ``sendall`` pieces). A child process reads them (a) with
``store.get(into=...)`` forced onto TCP, for 1, 2 and 4 connections in flight, and (b) with
``recv_into`` on a plain socket into the same preallocated buffer. Median of the rounds.

    python benchmarks/store_tcp.py [--mb 1024] [--iters 5]

Target (issue 3): the store moves at least 50% of what the plain socket moves.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import torch
import torch.multiprocessing as mp

import tidal.store

PIECE = 4 << 20


def plain_server(listener: socket.socket, data: memoryview, rounds: int) -> None:
    conn, _ = listener.accept()
    with conn:
        for _ in range(rounds):
            conn.recv(1)  # the reader asks for a round
            for start in range(0, data.nbytes, PIECE):
                conn.sendall(data[start : start + PIECE])


def child(pipe, address: str, port: int, numel: int, iters: int) -> None:
    into = torch.zeros(numel, dtype=torch.bfloat16)
    out: dict[str, float] = {}
    for conns in (1, 2, 4):
        with tidal.store.connect(address, transport="tcp", connections=conns) as store:
            times = []
            for _ in range(iters + 1):
                t = time.perf_counter()
                store.get("w", into=into)
                times.append(time.perf_counter() - t)
            assert into[-1].item() == 3.0 and into[0].item() == 1.0, "wrong bytes"
            out[f"tidal.store tcp, {conns} conn"] = statistics.median(times[1:])
    buf = memoryview(into.view(torch.uint8).numpy())
    with socket.create_connection(("127.0.0.1", port)) as s:
        times = []
        for _ in range(iters + 1):
            t = time.perf_counter()
            s.sendall(b"g")
            got = 0
            while got < buf.nbytes:
                got += s.recv_into(buf[got : got + 4 * PIECE])
            times.append(time.perf_counter() - t)
        out["plain socket recv_into"] = statistics.median(times[1:])
    pipe.send(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    numel = args.mb * (1 << 20) // 2
    w = torch.ones(numel, dtype=torch.bfloat16)
    w[-1] = 3.0
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    th = threading.Thread(
        target=plain_server,
        args=(listener, memoryview(w.view(torch.uint8).numpy()), args.iters + 1),
        daemon=True,
    )
    th.start()
    with tidal.store.connect() as store:
        store.put("w", w)
        ctx = mp.get_context("spawn")
        parent, pipe = ctx.Pipe()
        p = ctx.Process(target=child, args=(pipe, store.address, port, numel, args.iters))
        p.start()
        pipe.close()  # recv raises EOFError if the child dies instead of hanging
        res = parent.recv()
        p.join()
    gb = numel * 2 / 1e9
    base = res["plain socket recv_into"]
    print(f"{gb:.2f} GB over TCP loopback, median of {args.iters} rounds")
    for name, t in res.items():
        print(f"{name:28s} {t:.3f} s  {gb / t:5.2f} GB/s  {base / t:5.0%} of plain socket")
    best = min(v for k, v in res.items() if k.startswith("tidal"))
    print(f"best tidal.store / plain socket: {base / best:.0%} (target >= 50%)")


if __name__ == "__main__":
    main()
