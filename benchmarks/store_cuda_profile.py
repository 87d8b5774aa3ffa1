"""Where a memory="cuda" put and get spend their time, on one GPU: store_sync.py's 3 GB state
dict of 114 tensors, writer and reader in two processes; medians of 20 rounds with the
controller inside the writer's process, then in a process of its own, then cProfile of both
sides (the 20 longest functions each).

    python benchmarks/store_cuda_profile.py
    python benchmarks/store_cuda_profile.py --views   # the reader gets views (copy=False)
"""

import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from store_sync import make_sd

import tidal.store


def ctl(conn):
    s = tidal.store.connect(keep=1)
    conn.send(s.address)
    conn.recv()
    s.close()


def reader(conn, addr, prof, views):
    into = make_sd(False, device="cuda")
    s = tidal.store.connect(addr)
    tidal.store.warm_up_cuda()  # its copy kernel built before the first get, as at a start
    conn.send("up")
    pr = cProfile.Profile()
    times = []
    n = 0
    while True:
        v = conn.recv()
        if v is None:
            break
        n += 1
        if prof and n > 5:
            pr.enable()
        t = time.perf_counter()
        if views:
            got = s.get_state_dict("p", version=v, copy=False)
            times.append(time.perf_counter() - t)
            del got  # released before the next put
        else:
            s.get_state_dict("p", into=into, version=v)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        pr.disable()
        conn.send(times[-1])
    if prof:
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(22)
        conn.send(out.getvalue())
    else:
        conn.send("")
    s.close()


def ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def run(separate, prof, views):
    ctx = mp.get_context("spawn")
    cp = None
    if separate:
        a0, b0 = ctx.Pipe()
        cp = ctx.Process(target=ctl, args=(b0,))
        cp.start()
        addr = a0.recv()
        store = tidal.store.connect(addr)
    else:
        store = tidal.store.connect(keep=1)
        addr = store.address
    sd = make_sd(False, fill=1.0, device="cuda")
    tidal.store.warm_up_cuda()
    a, b = ctx.Pipe()
    p = ctx.Process(target=reader, args=(b, addr, prof, views))
    p.start()
    assert a.recv() == "up"
    pr = cProfile.Profile()
    puts, gets = [], []
    for v in range(25):
        if prof and v >= 5:
            pr.enable()
        t = time.perf_counter()
        store.put_state_dict(sd, "p", version=v, memory="cuda")
        torch.cuda.synchronize()
        puts.append(time.perf_counter() - t)
        pr.disable()
        a.send(v)
        gets.append(a.recv())
    a.send(None)
    rprof = a.recv()
    p.join()
    print(
        f"== controller {'separate process' if separate else 'embedded in writer'}"
        f"{', zero-copy get' if views else ''}"
        f"{' (cProfile on)' if prof else ''}: put median {ms(statistics.median(puts[5:]))}, "
        f"get {ms(statistics.median(gets[5:]))}, min put {ms(min(puts[5:]))} "
        f"get {ms(min(gets[5:]))}",
        flush=True,
    )
    if prof:
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(22)
        print("-- writer profile\n" + out.getvalue()[-4000:])
        print("-- reader profile\n" + rprof[-4000:])
    store.close()
    if cp:
        a0.send(None)
        cp.join()


if __name__ == "__main__":
    x = torch.empty(1, device="cuda")
    views = "--views" in sys.argv[1:]
    run(False, False, views)
    run(True, False, views)
    run(False, True, views)
