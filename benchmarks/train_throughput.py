"""Training throughput of tidal against torchtitan on the same shapes, in one run.

Trains `--flavor` (default llama3_1b: dim 2048, 16 layers, vocab 128256, 1.5B parameters) with
batch 4 x 4096, AdamW, bf16 mixed precision and no activation checkpointing on random tokens,
eager and with per-block torch.compile, each mode in its own process so peak memory is its
own. Prints tokens/s, MFU and peak memory per mode. With `--torchtitan DIR` (the `.anchors/`
folder made by shared/anchors/prepare.sh) it then runs torchtitan's trainer on the same shapes
(`DIR/torchtitan_baseline.sh`), parses its step logs and prints both sets of figures and the
ratios tidal / torchtitan.

    python benchmarks/train_throughput.py --torchtitan .anchors          # on one GPU
    python benchmarks/train_throughput.py --device cpu --flavor debug --batch 2 --seq 256 \
        --steps 6 --warmup 2                                             # smoke test on CPU

Figures are the mean over the log windows after `--warmup` steps (torchtitan: its log lines
for the same steps). `--ranks N` runs each mode on N ranks through torchrun (tokens/s are then
global, with a per-device figure), and `--set section.field=value` passes any tidal config
override, e.g. `--ranks 8 --set parallelism.tp=2` for FSDP 4 x TP 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace


def run_tidal(args, mode: str) -> dict | None:
    import numpy as np

    from tidal.parallel.launch import DistInfo
    from tidal.train.config import (
        Config,
        JobConfig,
        MetricsConfig,
        ModelConfig,
        SampleConfig,
        SchedulerConfig,
        TrainingConfig,
    )
    from tidal.train.config_parse import apply_overrides
    from tidal.train.data import DataBundle, PackedLoader
    from tidal.train.trainer import Trainer

    out = tempfile.mkdtemp(prefix=f"tidal_bench_{mode}_")
    cfg = Config(
        job=JobConfig(name=f"bench_{mode}", output_dir=out, device=args.device),
        model=ModelConfig(flavor=args.flavor),
        training=TrainingConfig(
            steps=args.steps,
            batch_size=args.batch,
            seq_len=args.seq,
            compile=mode == "compile",
            max_norm=1.0,
        ),
        lr_scheduler=SchedulerConfig(warmup_steps=5),
        metrics=MetricsConfig(log_every=args.log_every, val_every=0),
        sample=SampleConfig(max_new_tokens=0),
    )
    from tidal.models.flavors import get_flavor

    dist_info = DistInfo.from_env()
    cfg = apply_overrides(
        cfg, [f"--{kv.split('=', 1)[0]}={kv.split('=', 1)[1]}" for kv in args.set]
    )
    vocab = get_flavor(args.flavor).vocab_size
    rng = np.random.default_rng(dist_info.rank)  # random tokens: every rank its own
    n_tokens = (args.steps + 2) * args.batch * args.seq + 1
    tokens = rng.integers(0, vocab, n_tokens, dtype=np.int64)
    loader = PackedLoader(tokens, np.array([0]), seq_len=args.seq, batch_size=args.batch, seed=0)
    data = DataBundle(
        tokenizer=SimpleNamespace(vocab_size=vocab, bos_id=0, eos_id=1), train=loader, val=None
    )
    trainer = Trainer(cfg, data=data, dist_info=dist_info)
    try:
        trainer.train()
    finally:
        trainer.close()
    if not dist_info.is_main:
        return None
    records = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    steady = [r for r in records if r["step"] > args.warmup] or records[-1:]
    mean = lambda k: sum(r[k] for r in steady) / len(steady) if steady[0][k] is not None else None  # noqa: E731
    return {
        "system": "tidal",
        "mode": mode,
        "ranks": dist_info.world_size,
        "tokens_per_s": mean("tokens_per_s"),
        "tokens_per_s_per_device": mean("tokens_per_s_per_device"),
        "mfu": mean("mfu"),
        "tflops": mean("tflops"),
        "peak_memory_gib": max(r["peak_memory_gib"] for r in records),
        "final_loss": records[-1]["loss"],
        "steps_measured": [r["step"] for r in steady],
    }


STEP_RE = re.compile(
    r"step:\s*(\d+).*?loss:\s*([\d.]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?"
    r"tflops:\s*([\d.,]+).*?mfu:\s*([\d.]+)%"
)


def parse_torchtitan(log: str, warmup: int) -> dict | None:
    rows = []
    for line in log.splitlines():
        m = STEP_RE.search(re.sub(r"\x1b\[[0-9;]*m", "", line))  # strip colours
        if m:
            rows.append([float(g.replace(",", "")) for g in m.groups()])
    if not rows:
        return None
    steady = [r for r in rows if r[0] > warmup] or rows[-1:]
    n = len(steady)
    return {
        "tokens_per_s": sum(r[3] for r in steady) / n,
        "mfu": sum(r[5] for r in steady) / n / 100,
        "tflops": sum(r[4] for r in steady) / n,
        "peak_memory_gib": max(r[2] for r in rows),
        "final_loss": rows[-1][1],
        "steps_measured": [int(r[0]) for r in steady],
    }


def run_torchtitan(args) -> list[dict]:
    runs = {"eager": "--model.flavor 1B", "compile": "--model.flavor 1B --compile.enable"}
    runs = {m: f"{r} {args.torchtitan_args}".strip() for m, r in runs.items()}
    env = dict(
        os.environ, RUNS="\n".join(runs[m] for m in args.modes), TAILN="40", NGPU=str(args.ranks)
    )
    script = Path(args.torchtitan) / "torchtitan_baseline.sh"
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    results = []
    for i, mode in enumerate(args.modes, start=1):
        log_path = Path(f"/tmp/torchtitan_run_{i}.log")
        log = log_path.read_text() if log_path.exists() else ""
        parsed = parse_torchtitan(log, args.warmup)
        if parsed is None:
            tail = (log or proc.stdout + proc.stderr)[-3000:]
            print(f"torchtitan {mode}: no step logs parsed; tail of its log:\n{tail}", flush=True)
            results.append({"system": "torchtitan", "mode": mode, "error": "no step logs"})
        else:
            results.append({"system": "torchtitan", "mode": mode, **parsed})
    return results


def worker_args(argv: list[str]) -> list[str]:
    """The command line minus the torchtitan flags (and their values), for tidal's runs."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--torchtitan", "--torchtitan-args"):
            skip = True
        elif not a.startswith("--torchtitan"):
            out.append(a)
    return out


def fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['system']:10s} {r['mode']:8s} error: {r['error']}"
    mfu = f"{100 * r['mfu']:5.1f}%" if r.get("mfu") is not None else "  n/a"
    if r.get("ranks", 1) > 1:
        mfu += f"  ({r['tokens_per_s_per_device']:,.0f} tok/s per device, {r['ranks']} ranks)"
    return (
        f"{r['system']:10s} {r['mode']:8s} {r['tokens_per_s']:>10,.0f} tok/s  MFU {mfu}  "
        f"peak {r['peak_memory_gib']:6.2f} GiB  final loss {r['final_loss']:.3f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--flavor", default="llama3_1b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the averages")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--device", default="auto")
    p.add_argument("--modes", default="eager,compile")
    p.add_argument("--ranks", type=int, default=1, help="ranks (GPUs) per run, via torchrun")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="extra tidal config override, e.g. --set parallelism.tp=2",
    )
    p.add_argument("--torchtitan", default=None, help="the .anchors folder; omit to skip")
    p.add_argument(
        "--torchtitan-args",
        default="",
        help="extra torchtitan flags for the same layout as --set, e.g. "
        "'--parallelism.tensor_parallel_degree 2'",
    )
    p.add_argument("--json", default=None, help="write all results to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.modes = args.modes.split(",")
    # NVLink multicast stays off on shared multi-GPU hosts (inherited by every run below).
    for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):  # fmt: skip
        os.environ.setdefault(var, value)
    if args.worker:
        result = run_tidal(args, args.worker)
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
        return

    results = []
    for mode in args.modes:
        launcher = [sys.executable]
        if args.ranks > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone",
                         f"--nproc_per_node={args.ranks}"]  # fmt: skip
        cmd = launcher + [__file__, "--worker", mode] + worker_args(sys.argv[1:])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"tidal {mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}", flush=True)
            results.append({"system": "tidal", "mode": mode, "error": f"exit {proc.returncode}"})
        else:
            results.append(json.loads(lines[-1][7:]))
        print(fmt(results[-1]), flush=True)
    if args.torchtitan:
        for r in run_torchtitan(args):
            results.append(r)
            print(fmt(r), flush=True)
        # torchtitan logs tokens/s per device ("tps"); tidal's per-device figure is the
        # global one over the world size, the same quantity.
        print("\nratios tidal / torchtitan per device (throughput higher is better, memory "
              "lower is better):")  # fmt: skip
        by = {(r["system"], r["mode"]): r for r in results}
        for mode in args.modes:
            a, b = by.get(("tidal", mode)), by.get(("torchtitan", mode))
            if a and b and "error" not in a and "error" not in b:
                tps = a["tokens_per_s_per_device"] or a["tokens_per_s"]
                print(
                    f"  {mode:8s} tokens/s {tps / b['tokens_per_s']:.3f}x   "
                    f"peak memory {a['peak_memory_gib'] / b['peak_memory_gib']:.3f}x"
                )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
