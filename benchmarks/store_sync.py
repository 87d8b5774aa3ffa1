"""Weight sync on one host: tidal.store put (one process) + get (another process) of a
Llama-3-1.5B-shaped bf16 state dict, against the easy path (DCP save + load, safetensors
save + load, both through /dev/shm) and the machine's memcpy bandwidth (torch ``copy_`` of
the same bytes into warm memory), all measured in this run.

    python benchmarks/store_sync.py            # 3.0 GB, Llama-3 1.5B shape
    python benchmarks/store_sync.py --gb1      # ~1 GB variant for small machines
    python benchmarks/store_sync.py --device cuda                  # GPU models, host slots
    python benchmarks/store_sync.py --device cuda --memory cuda    # GPU slots, CUDA IPC

Targets (issue 3): tidal >= 10x faster than DCP; tidal end-to-end >= 50% of memcpy.

Each round measures, one after the other on the same tensors: memcpy; put then a get into
the reader's own tensors (two copies); put then a zero-copy get (``copy=False``: the reader
gets read-only views of the store's memory, one copy in all); and a streamed sync, where the
reader's ``get(..., wait=)`` is in flight before the put starts and copies each tensor as it
lands. Figures are medians over the warm rounds (round 0 and 1 touch fresh segments).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch
import torch.multiprocessing as mp

import tidal.store
from tidal.store import testing


def make_sd(small: bool, fill: float = 0.0, device: str = "cpu") -> dict[str, torch.Tensor]:
    dim, ffn = 2048, 8192
    vocab, layers = (64000, 4) if small else (128256, 16)
    shapes = {"tok_embeddings.weight": (vocab, dim), "output.weight": (vocab, dim)}
    for i in range(layers):
        p = f"layers.{i}."
        for n, s in [
            ("attention.wq", (dim, dim)),
            ("attention.wk", (512, dim)),
            ("attention.wv", (512, dim)),
            ("attention.wo", (dim, dim)),
            ("feed_forward.w1", (ffn, dim)),
            ("feed_forward.w2", (dim, ffn)),
            ("feed_forward.w3", (ffn, dim)),
        ]:
            shapes[p + n + ".weight"] = s
    return {k: torch.full(s, fill, dtype=torch.bfloat16, device=device) for k, s in shapes.items()}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def stamp(sd: dict[str, torch.Tensor], v: int) -> None:
    """Mark version v cheaply: first and last element of each tensor."""
    for i, t in enumerate(sd[k] for k in sorted(sd)):
        t.view(-1)[0] = float((v * 7 + i) % 200)
        t.view(-1)[-1] = float((v * 3 + i) % 200)


def check(sd: dict[str, torch.Tensor], v: int) -> None:
    for i, t in enumerate(sd[k] for k in sorted(sd)):
        assert t.view(-1)[0].item() == float((v * 7 + i) % 200), "wrong bytes"
        assert t.view(-1)[-1].item() == float((v * 3 + i) % 200), "wrong bytes"


def reader(conn, address: str, small: bool, root: str, device: str) -> None:
    into = make_sd(small, device=device)  # the generator's own model memory, already touched
    store = tidal.store.connect(address)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        kind, v = msg
        if kind == "stream":
            # A generator waiting for the trainer's next version: the get is in flight before
            # the put starts and copies each tensor as soon as it lands; report when done.
            conn.send("ready")
            store.get_state_dict("policy", into=into, version=v, wait=60)
            sync(device)
            end = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
            check(into, v)
            conn.send(end)
            continue
        t = time.perf_counter()
        if kind == "tidal":
            store.get_state_dict("policy", into=into, version=v)
            sync(device)
            took = time.perf_counter() - t
            check(into, v)
        elif kind == "view":
            views = store.get_state_dict("policy", version=v, copy=False)
            took = time.perf_counter() - t
            check(views, v)
            del views  # releases the version: its slots go back to the writer's ring
        elif kind == "dcp":
            import torch.distributed.checkpoint as dcp

            dcp.load(into, checkpoint_id=os.path.join(root, "dcp"))
            sync(device)
            took = time.perf_counter() - t
        elif kind == "safetensors":
            from safetensors.torch import load_file

            loaded = load_file(os.path.join(root, "model.safetensors"), device=device)
            for k, dst in into.items():
                dst.copy_(loaded[k])
            del loaded
            sync(device)
            took = time.perf_counter() - t
        conn.send(took)
    store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb1", action="store_true", help="~1 GB variant (4 layers, 64k vocab)")
    ap.add_argument("--iters", type=int, default=6, help="tidal put+get rounds")
    ap.add_argument("--root", default="/dev/shm", help="file system for the DCP/safetensors path")
    ap.add_argument("--skip-easy", action="store_true", help="skip DCP and safetensors")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda"), help="where both models live"
    )
    ap.add_argument(
        "--memory",
        default="host",
        choices=("host", "cuda"),
        help="where the store keeps the bytes: host shared memory, or the writer's GPU "
        "memory read through CUDA IPC (--device cuda)",
    )
    args = ap.parse_args()
    if args.memory == "cuda" and args.device != "cuda":
        ap.error("--memory cuda needs --device cuda")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

    sd = make_sd(args.gb1, fill=1.0, device=args.device)
    gb = nbytes(sd) / 1e9
    print(
        f"state dict: {len(sd)} tensors, {gb:.2f} GB bf16 on {args.device}; "
        f"torch threads {torch.get_num_threads()}"
    )

    # memcpy: host copy_ of the same bytes into warm memory, whatever the models' device.
    host = sd if args.device == "cpu" else make_sd(args.gb1, fill=1.0)
    dst = make_sd(args.gb1)
    # A zero-copy get hands CPU views to the reader; for CUDA models the get is the copy.
    kinds = ("tidal", "view") if args.device == "cpu" else ("tidal",)
    results: dict[str, dict[str, float]] = {}

    root = os.path.join(args.root, f"tidal-bench-{os.getpid()}")
    os.makedirs(root, exist_ok=True)
    store = tidal.store.connect(keep=1)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=reader, args=(child, store.address, args.gb1, root, args.device))
    proc.start()
    child.close()  # so that recv raises EOFError if the reader dies instead of hanging
    try:
        rounds: dict[str, list[tuple[float, float]]] = {"tidal": [], "view": []}
        memcpy, streamed, dev_memcpy = [], [], []
        dev_dst = make_sd(args.gb1, device="cuda") if args.device == "cuda" else {}
        v = 0
        for r in range(args.iters):
            t = time.perf_counter()
            for k, src in host.items():
                dst[k].copy_(src)
            memcpy.append(time.perf_counter() - t)
            line = f"  round {r}: memcpy {memcpy[-1]:.3f} s"
            if args.device == "cuda":  # and the device's own copy_ of the same bytes
                torch.cuda.synchronize()
                t = time.perf_counter()
                for k, src in sd.items():
                    dev_dst[k].copy_(src)
                torch.cuda.synchronize()
                dev_memcpy.append(time.perf_counter() - t)
                line += f" (device {dev_memcpy[-1]:.4f} s)"
            for kind in kinds:
                stamp(sd, v)
                t = time.perf_counter()
                store.put_state_dict(sd, "policy", version=v, memory=args.memory)
                sync(args.device)
                put_s = time.perf_counter() - t
                parent.send((kind, v))
                rounds[kind].append((put_s, parent.recv()))
                line += f" | {kind}: put {put_s:.3f} get {rounds[kind][-1][1]:.3f}"
                v += 1
            stamp(sd, v)
            parent.send(("stream", v))
            assert parent.recv() == "ready"
            # Writers report progress only for a version a reader waits for: start the put
            # once the reader's wait reached the (embedded) controller.
            while not testing.readers_waiting(store, "policy", v):
                time.sleep(0.0005)
            t = time.perf_counter()
            store.put_state_dict(sd, "policy", version=v, memory=args.memory)
            streamed.append(parent.recv() - t)
            v += 1
            print(line + f" | streamed {streamed[-1]:.3f} s", flush=True)
        # The first rounds touch fresh shared memory (a ring of keep + 1 = 2 slots per
        # tensor); later rounds are the steady state of a training loop.
        warm = slice(2, None) if args.iters > 2 else slice(None)
        memcpy_s = statistics.median(memcpy[warm])
        for kind, name in (("tidal", "tidal"), ("view", "tidal zero-copy get")):
            if not rounds[kind]:
                continue
            results[name] = {
                "put_s": statistics.median(p for p, _ in rounds[kind][warm]),
                "get_s": statistics.median(g for _, g in rounds[kind][warm]),
            }
        results["tidal (first round)"] = {
            "put_s": rounds["tidal"][0][0],
            "get_s": rounds["tidal"][0][1],
        }
        stream_s = statistics.median(streamed[warm])
        if not args.skip_easy:
            import torch.distributed.checkpoint as dcp

            t = time.perf_counter()
            dcp.save(sd, checkpoint_id=os.path.join(root, "dcp"))
            sync(args.device)
            save_s = time.perf_counter() - t
            parent.send(("dcp", 0))
            results["DCP via " + args.root] = {"put_s": save_s, "get_s": parent.recv()}
            shutil.rmtree(os.path.join(root, "dcp"))
            try:
                from safetensors.torch import save_file
            except ImportError:
                print("  note: safetensors is not installed; skipping that baseline")
            else:
                t = time.perf_counter()
                save_file(sd, os.path.join(root, "model.safetensors"))
                sync(args.device)
                save_s = time.perf_counter() - t
                parent.send(("safetensors", 0))
                results["safetensors via " + args.root] = {"put_s": save_s, "get_s": parent.recv()}
        parent.send(None)
        proc.join()
    finally:
        if proc.is_alive():
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)
        store.close()

    memcpy_gbps = gb / memcpy_s
    tidal_s = results["tidal"]["put_s"] + results["tidal"]["get_s"]
    print(f"\nmemcpy (torch copy_, same bytes, median of the warm rounds): {memcpy_s:.3f} s = "
          f"{memcpy_gbps:.2f} GB/s")  # fmt: skip
    print(f"{'path':28s} {'put/save s':>10s} {'get/load s':>10s} {'total s':>8s} "
          f"{'GB/s':>6s} {'tidal x':>8s}")  # fmt: skip
    for name, r in results.items():
        total = r["put_s"] + r["get_s"]
        print(f"{name:28s} {r['put_s']:10.3f} {r['get_s']:10.3f} {total:8.3f} "
              f"{gb / total:6.2f} {total / tidal_s:8.1f}")  # fmt: skip
    e2e = gb / tidal_s
    print(
        f"\ntidal end-to-end, get into the reader's tensors (two copies) {e2e:.2f} GB/s = "
        f"{e2e / memcpy_gbps:.0%} of memcpy (target >= 50%)"
    )
    zc = results.get("tidal zero-copy get")
    if zc is not None:
        zc_gbps = gb / (zc["put_s"] + zc["get_s"])
        print(
            f"tidal end-to-end, zero-copy get (copy=False: one copy) {zc_gbps:.2f} GB/s = "
            f"{zc_gbps / memcpy_gbps:.0%} of memcpy (target >= 50%)"
        )
    print(
        f"tidal streamed (reader waiting with get(..., wait=)) {stream_s:.3f} s = "
        f"{gb / stream_s:.2f} GB/s = {gb / stream_s / memcpy_gbps:.0%} of memcpy (target >= 50%)"
    )
    if dev_memcpy:
        dev_gbps = gb / statistics.median(dev_memcpy[warm])
        print(
            f"device copy_ of the same bytes {dev_gbps:.1f} GB/s; tidal end-to-end "
            f"{e2e:.1f} GB/s = {e2e / dev_gbps:.1%} of it, {e2e / memcpy_gbps:.0%} of host memcpy"
        )
    get_bw = gb / results["tidal"]["get_s"]
    print(
        f"tidal get alone (the reader's only blocking step when put_async overlaps training) "
        f"{get_bw:.2f} GB/s = {get_bw / memcpy_gbps:.0%} of memcpy"
    )
    dcp_key = "DCP via " + args.root
    if dcp_key in results:
        dcp_total = results[dcp_key]["put_s"] + results[dcp_key]["get_s"]
        print(f"tidal vs DCP: {dcp_total / tidal_s:.1f}x faster (target >= 10x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"GB": gb, "memcpy_s": memcpy_s, "streamed_s": stream_s,
                       "results": results, "rounds": rounds, "memcpy_rounds": memcpy,
                       "streamed_rounds": streamed}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
