"""tidal.store side by side with torchstore (the seed talk's store) on the same state dict, in
one run, with the same process layout: put, get into the reader's tensors, and a resharded
get (FSDP 4 -> TP 2), cold (the first call of a fresh process) and warm (the median of
rounds 6 to ``--rounds``: a steady put reuses its slots), with the ratio per row
(target, issue 35: tidal >= 2x torchstore on every row).

    python benchmarks/store_peer.py --torchstore-src DIR        # 512 MB fp32, 16 tensors
    python benchmarks/store_peer.py --torchstore-src DIR --mb 128 --rounds 5
    python benchmarks/store_peer.py --skip-torchstore             # the tidal side alone

Layout, both sides: the store in processes of its own (tidal: ``tidal store serve``, its
controller and volume in one process; torchstore: ``ts.initialize()``, its controller and
one storage volume as monarch actors, shared-memory transport), a writer process, then a
reader process (a fresh one: its first get is the cold row), then 4 FSDP writer ranks
(Shard(0)) and 2 TP reader ranks (Shard(1)), gloo groups for the DTensors. Each rank times
its own calls; a round counts its slowest rank.

torchstore runs in an environment of its own (``--peer-env``, made by this script if
missing, never the project's): torch 2.9.0, ``torchmonarch==0.4.1`` and ``portpicker`` from
PyPI, and torchstore's source (``--torchstore-src``, a checkout of meta-pytorch/torchstore;
put on its PYTHONPATH). Why not ``pip install torchstore``: the PyPI release (0.1.2)
pins ``torchmonarch==0.1.2``, whose native module links ``libcuda.so.1`` and cannot be
imported on a machine without an NVIDIA driver ("ImportError: libcuda.so.1: cannot open
shared object file"), and does not run on newer monarch (0.7.0: "Controller mixes both
async and sync endpoints"). torchstore's source pins monarch 0.4.1, whose native module
needs no CUDA. The torchstore side is benchmarks/store_peer_torchstore.py, run by that
environment's python; it reports through a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import venv

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
COLS = 4096
# Rounds before the warm ones: a tidal put reaches its steady time from its 7th on (serve
# keeps 2 versions, and each commit reserves the next put's slots: puts 0-5 still take
# fresh ones; 2-core VM: puts 3-5 0.09-0.11 s, 6-8 0.033-0.036 s, memcpy 0.030 s).
WARMUP = 6
PEER_PACKAGES = ["torch==2.9.0", "torchmonarch==0.4.1", "portpicker", "pygtrie"]


def shapes(mb: int, tensors: int) -> list[tuple[int, int]]:
    """The same as store_peer_torchstore.shapes (both sides must agree)."""
    rows = (mb << 20) // tensors // (4 * COLS)
    rows -= rows % 8
    return [(rows, COLS)] * tensors


def make_sd(shape_list, layout: str, world: int, fill: bool) -> dict:
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


# ---------------------------------------------------------------- the tidal side


def tidal_rank(
    rank: int, world: int, role: str, address: str, init: str, args: tuple, out: str
) -> None:
    """One writer or reader rank; writes its times to ``out.<rank>`` (JSON)."""
    import torch.distributed as dist

    import tidal.store

    mb, tensors, rounds, layout, key = args
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    sd = make_sd(shapes(mb, tensors), layout, world, role == "put")
    times = []
    with tidal.store.connect(address) as store:
        for i in range(rounds):
            if role == "get":
                for t in sd.values():
                    (t.to_local() if hasattr(t, "to_local") else t).zero_()
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            if role == "put":
                store.put_state_dict(sd, key, version=i)
            else:
                store.get_state_dict(key, into=sd)
            times.append(time.perf_counter() - t0)
    if role == "get":
        for i, t in enumerate(sd.values()):
            local = t.to_local() if hasattr(t, "to_local") else t
            assert bool((local == float(i + 1)).all()), f"tidal get {key}: wrong bytes"
    if world > 1:
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(times, f)


def tidal_group(world: int, role: str, address: str, tmp: str, args: tuple) -> list[float]:
    name = f"{role}-{args[3]}-{world}"
    out = os.path.join(tmp, name)
    mp.spawn(
        tidal_rank,
        args=(world, role, address, os.path.join(tmp, name + ".init"), args, out),
        nprocs=world,
    )
    per_rank = []
    for r in range(world):
        with open(f"{out}.{r}") as f:
            per_rank.append(json.load(f))
    return [max(r[i] for r in per_rank) for i in range(len(per_rank[0]))]


def run_tidal(
    mb: int, tensors: int, rounds: int, settle: float, serve_args: tuple[str, ...] = ()
) -> dict[str, list[float]]:
    cmd = [sys.executable, "-m", "tidal.store", "serve", *serve_args]
    serve = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert serve.stdout is not None
        address = serve.stdout.readline().split()[4]
        time.sleep(settle)  # a server started ahead of its first put, as usual
        out: dict[str, list[float]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            full = (mb, tensors, rounds + 1, "full", "sd")
            out["put"] = tidal_group(1, "put", address, tmp, full)
            out["get"] = tidal_group(1, "get", address, tmp, full)
            out["fsdp put"] = tidal_group(4, "put", address, tmp, (mb, tensors, 1, "fsdp", "f"))
            out["reshard"] = tidal_group(2, "get", address, tmp, (*full[:3], "tp", "f"))
        return out
    finally:
        serve.terminate()
        serve.wait(60)


# ---------------------------------------------------------------- the torchstore side


def peer_python(env: str, install: bool) -> str:
    """The python of torchstore's environment, made (and its packages installed) if
    missing and ``install``."""
    py = os.path.join(env, "bin", "python")
    if os.path.exists(py):
        return py
    if not install:
        raise SystemExit(f"no environment at {env} (drop --no-install to make one)")
    print(f"making {env}: {' '.join(PEER_PACKAGES)} (a few GB: torch pulls CUDA wheels)")
    venv.create(env, with_pip=True)
    subprocess.run([py, "-m", "pip", "install", "-q", *PEER_PACKAGES], check=True)
    return py


def run_torchstore(
    py: str, src: str, mb: int, tensors: int, rounds: int
) -> dict[str, list[float]] | str:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "torchstore.json")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, src]))
        code = "import store_peer_torchstore as m; m.main()"  # argv[1:5] follow "-c"
        proc = subprocess.run(
            [py, "-c", code, str(mb), str(tensors), str(rounds), out],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
            cwd=tmp,
        )
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            return "failed: " + " | ".join(tail)
        with open(out) as f:
            return json.load(f)["rows"]


# ---------------------------------------------------------------- report


def cold_warm(times: list[float]) -> tuple[float, float | None]:
    """The first round, and the median of rounds ``WARMUP`` on (None if too few)."""
    warm = times[WARMUP:]
    return times[0], statistics.median(warm) if warm else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=512, help="state dict size, fp32")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=12, help="rounds after the cold one")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after serve starts")
    ap.add_argument("--torchstore-src", default=None, help="a torchstore checkout")
    ap.add_argument("--peer-env", default=os.path.expanduser("~/.cache/tidal/torchstore-env"))
    ap.add_argument("--no-install", action="store_true", help="never make --peer-env")
    ap.add_argument("--skip-torchstore", action="store_true")
    args = ap.parse_args()
    gb = sum(r * c * 4 for r, c in shapes(args.mb, args.tensors)) / 1e9
    print(f"{gb:.3f} GB fp32 in {args.tensors} tensors; {os.cpu_count()} CPUs, {args.rounds} warm")
    peer: dict[str, list[float]] | str = "skipped (--skip-torchstore)"
    if not args.skip_torchstore:
        if not args.torchstore_src:
            raise SystemExit(
                "give --torchstore-src DIR (a torchstore checkout) or --skip-torchstore"
            )
        py = peer_python(args.peer_env, not args.no_install)
        peer = run_torchstore(py, args.torchstore_src, args.mb, args.tensors, args.rounds)
    ours = run_tidal(args.mb, args.tensors, args.rounds, args.settle)
    print(
        f"\n{'row':28s} {'tidal s':>8s} {'GB/s':>6s} {'torchstore s':>12s} {'GB/s':>6s} "
        f"{'ratio':>6s}"
    )
    for row, label in (
        ("put", "put"),
        ("get", "get into own tensors"),
        ("reshard", "get FSDP4 -> TP2"),
        ("fsdp put", "put, 4 FSDP ranks"),
    ):
        t = cold_warm(ours[row])
        p = cold_warm(peer[row]) if isinstance(peer, dict) else (None, None)
        for kind, a, b in (("cold", t[0], p[0]), ("warm", t[1], p[1])):
            if a is None:
                continue
            line = f"{label + ', ' + kind:28s} {a:8.4f} {gb / a:6.2f}"
            if b is not None:
                line += f" {b:12.4f} {gb / b:6.2f} {b / a:5.1f}x"
            print(line)
    if isinstance(peer, str):
        print(f"\ntorchstore: {peer}")


if __name__ == "__main__":
    main()
