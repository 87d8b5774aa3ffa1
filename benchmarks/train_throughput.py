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

Float8: `--float8 tensorwise` (or rowwise) adds, for each mode, a float8 run of tidal
(`quantize.float8`, the output layer in bf16 unless `--float8-output`) and, with
`--torchtitan`, torchtitan's own float8 on the same shapes (`--model.converters
quantize.linear.float8 --quantize.linear.float8.recipe_name R`, with `--quantize.linear.float8.
filter_fqns output` when the output stays bf16). It then prints tidal float8 / torchtitan
float8, tidal float8 / tidal bf16 and torchtitan float8 / torchtitan bf16. torchao 0.18.0 must
be importable (the wheel that prepare.sh packs into .anchors/wheels):

    pip install --no-index --no-deps --target .anchors/ao .anchors/wheels/torchao-0.18.0-*.whl
    PYTHONPATH=.anchors/ao:$PWD python benchmarks/train_throughput.py --modes compile \
        --float8 tensorwise --torchtitan .anchors --json float8.json
    PYTHONPATH=.anchors/ao:$PWD python benchmarks/train_throughput.py --device cpu --flavor tiny \
        --batch 2 --seq 64 --steps 4 --warmup 1 --log-every 1 --modes eager \
        --float8 tensorwise                                              # smoke test on CPU

Other float8 settings go through `--set`, e.g. `--set quantize.float8_min_dim=1024` to keep
the small K/V projections of llama3_1b (2048 -> 512) in bf16.

Mixture of experts (benchmarks/trainer.md, "MoE against torchtitan"): with an MoE flavor
(`--flavor qwen3_moe_1b`: 0.98B parameters, 0.45B active, 64 experts of width 256, 8 per
token) and `--torchtitan DIR`, torchtitan's own Qwen 3 MoE model runs at the same shape, built
from tidal's flavor by benchmarks/torchtitan_moe.py (registered as torchtitan flavor
`tidal_qwen3_moe_1b`). Before the runs it prints both configurations field by field, both
parameter counts (equal), active parameters and training FLOPs per token (both count the k
routed experts of each token, not all of them: the MFU of both is of the active parameters),
and the behaviours that differ. torchtitan 0.2.2 has no auxiliary load-balancing loss, so
tidal's MoE runs here use the aux-loss-free expert bias as torchtitan does
(`model.moe_load_balance=bias`; `--set model.moe_load_balance=aux_loss` overrides it).
`--profile-moe` then runs a few eager tidal steps under torch.profiler and prints where the
time goes: router, dispatch/combine, expert GEMMs, attention, the rest (benchmarks/
moe_profile.py).

    python benchmarks/train_throughput.py --flavor qwen3_moe_1b --steps 20 --warmup 10 \
        --torchtitan .anchors --profile-moe --json moe.json              # on one GPU
    python benchmarks/train_throughput.py --device cpu --flavor debug_moe --batch 2 --seq 64 \
        --steps 3 --warmup 1 --log-every 1 --modes eager --profile-moe \
        --profile-steps 1                                                # smoke test on CPU
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


def is_moe(flavor: str) -> bool:
    """Whether `flavor` is a mixture of experts."""
    from tidal.models.flavors import get_flavor

    return get_flavor(flavor).moe is not None


def moe_load_balance(args) -> str:
    """The load balancing of tidal's MoE runs: bias, as torchtitan's (it has no auxiliary
    loss), unless `--set model.moe_load_balance=...` says otherwise."""
    values = [kv.split("=", 1)[1] for kv in args.set if kv.startswith("model.moe_load_balance=")]
    return values[-1] if values else "bias"


def build_trainer(args, mode: str):
    """tidal's Trainer for one run of `mode` on random tokens; returns (trainer, run folder,
    DistInfo)."""
    import numpy as np

    from tidal.parallel.launch import DistInfo
    from tidal.train.config import (
        Config,
        JobConfig,
        MetricsConfig,
        ModelConfig,
        QuantizeConfig,
        SampleConfig,
        SchedulerConfig,
        TrainingConfig,
    )
    from tidal.train.config_parse import apply_overrides
    from tidal.train.data import DataBundle, PackedLoader
    from tidal.train.trainer import Trainer

    out = tempfile.mkdtemp(prefix=f"tidal_bench_{mode.replace('+', '_')}_")
    base, float8 = split_mode(mode)
    cfg = Config(
        job=JobConfig(name=f"bench_{mode}", output_dir=out, device=args.device),
        model=ModelConfig(flavor=args.flavor),
        training=TrainingConfig(
            steps=args.steps,
            batch_size=args.batch,
            seq_len=args.seq,
            compile=base == "compile",
            max_norm=1.0,
        ),
        quantize=QuantizeConfig(
            float8=args.float8 if float8 else "none", float8_output=args.float8_output
        ),
        lr_scheduler=SchedulerConfig(warmup_steps=5),
        metrics=MetricsConfig(log_every=args.log_every, val_every=0),
        sample=SampleConfig(max_new_tokens=0),
    )
    from tidal.models.flavors import get_flavor

    dist_info = DistInfo.from_env()
    balance = [f"model.moe_load_balance={moe_load_balance(args)}"] if is_moe(args.flavor) else []
    overrides = balance + args.set
    cfg = apply_overrides(
        cfg, [f"--{kv.split('=', 1)[0]}={kv.split('=', 1)[1]}" for kv in overrides]
    )
    vocab = get_flavor(args.flavor).vocab_size
    rng = np.random.default_rng(dist_info.rank)  # random tokens: every rank its own
    n_steps = max(args.steps, PROFILE_WARMUP + args.profile_steps)
    n_tokens = (n_steps + 2) * args.batch * args.seq + 1
    tokens = rng.integers(0, vocab, n_tokens, dtype=np.int64)
    loader = PackedLoader(tokens, np.array([0]), seq_len=args.seq, batch_size=args.batch, seed=0)
    data = DataBundle(
        tokenizer=SimpleNamespace(vocab_size=vocab, bos_id=0, eos_id=1), train=loader, val=None
    )
    return Trainer(cfg, data=data, dist_info=dist_info), out, dist_info


def run_tidal(args, mode: str) -> dict | None:
    trainer, out, dist_info = build_trainer(args, mode)
    try:
        trainer.train()
    finally:
        trainer.close()
    if not dist_info.is_main:
        return None
    records = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    steady = [r for r in records if r["step"] > args.warmup] or records[-1:]
    mean = lambda k: sum(r[k] for r in steady) / len(steady) if steady[0][k] is not None else None  # noqa: E731
    result = {
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
    if "moe_load_max" in records[-1]:  # an MoE: the busiest expert's load over the mean
        result["moe_load_max"] = mean("moe_load_max")
    return result


def run_profile(args) -> dict | None:
    """`--profile-moe`: eager steps of tidal under torch.profiler, time by category."""
    from moe_profile import profile_steps

    trainer, _, dist_info = build_trainer(args, "eager")
    try:
        times = profile_steps(trainer, warmup=PROFILE_WARMUP, steps=args.profile_steps)
    finally:
        trainer.close()
    return {"device": trainer.device.type, "steps": args.profile_steps, "times_us": times}


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


FLOAT8 = "+float8"
"""Suffix of a mode run with float8 linear layers (`--float8`): "compile+float8"."""


def split_mode(mode: str) -> tuple[str, bool]:
    """ "compile+float8" -> ("compile", True); "eager" -> ("eager", False)."""
    return mode.removesuffix(FLOAT8), mode.endswith(FLOAT8)


def all_modes(args) -> list[str]:
    """The runs of each system: every mode in bf16, then (with --float8) in float8."""
    return args.modes + ([m + FLOAT8 for m in args.modes] if args.float8 else [])


def torchtitan_float8_flags(args) -> str:
    """torchtitan's converter flags for the same float8 recipe and output-layer choice."""
    flags = "--model.converters quantize.linear.float8 --quantize.linear.float8.recipe_name "
    flags += args.float8
    if not args.float8_output:
        flags += " --quantize.linear.float8.filter_fqns output"
    return flags


def run_torchtitan(args) -> list[dict]:
    if is_moe(args.flavor):  # torchtitan's Qwen 3 MoE at the flavor's shape
        import torchtitan_moe

        return torchtitan_moe.run(args, parse_torchtitan, moe_load_balance(args))
    flags = {"eager": "--model.flavor 1B", "compile": "--model.flavor 1B --compile.enable"}
    runs = {}
    for mode in all_modes(args):
        base, float8 = split_mode(mode)
        extra = torchtitan_float8_flags(args) if float8 else ""
        runs[mode] = " ".join(x for x in (flags[base], extra, args.torchtitan_args) if x)
    env = dict(os.environ, RUNS="\n".join(runs.values()), TAILN="40", NGPU=str(args.ranks))
    script = Path(args.torchtitan) / "torchtitan_baseline.sh"
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    results = []
    for i, mode in enumerate(runs, start=1):
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
        elif a in ("--torchtitan", "--torchtitan-args", "--torchtitan-timeout"):
            skip = True
        elif not a.startswith("--torchtitan"):
            out.append(a)
    return out


def fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['system']:10s} {r['mode']:14s} error: {r['error']}"
    mfu = f"{100 * r['mfu']:5.1f}%" if r.get("mfu") is not None else "  n/a"
    if r.get("ranks", 1) > 1:
        mfu += f"  ({r['tokens_per_s_per_device']:,.0f} tok/s per device, {r['ranks']} ranks)"
    load = f"  expert load max {r['moe_load_max']:.2f}" if "moe_load_max" in r else ""
    return (
        f"{r['system']:10s} {r['mode']:14s} {r['tokens_per_s']:>10,.0f} tok/s  MFU {mfu}  "
        f"peak {r['peak_memory_gib']:6.2f} GiB  final loss {r['final_loss']:.3f}{load}"
    )


def per_device(r: dict) -> float:
    """tokens/s per device: torchtitan logs that ("tps"); tidal's per-device figure is the
    global one over the world size, the same quantity."""
    return r.get("tokens_per_s_per_device") or r["tokens_per_s"]


def print_ratios(args, results: list[dict]) -> None:
    """tidal / torchtitan per mode, and with --float8 each system's float8 / its bf16."""
    by = {(r["system"], r["mode"]): r for r in results if "error" not in r}

    def ratio(label: str, a: dict | None, b: dict | None) -> None:
        if a and b:
            print(
                f"  {label:34s} tokens/s {per_device(a) / per_device(b):.3f}x   "
                f"peak memory {a['peak_memory_gib'] / b['peak_memory_gib']:.3f}x"
            )

    if args.torchtitan:
        print(
            "\nratios tidal / torchtitan per device (throughput higher is better, memory "
            "lower is better):"
        )
        for mode in all_modes(args):
            ratio(mode, by.get(("tidal", mode)), by.get(("torchtitan", mode)))
    if args.float8:
        print(
            f"\nfloat8 ({args.float8}) against the same system and mode without it (bf16 on a GPU):"
        )
        for system in ("tidal", "torchtitan") if args.torchtitan else ("tidal",):
            for mode in args.modes:
                ratio(
                    f"{system} {mode}{FLOAT8} / {mode}",
                    by.get((system, mode + FLOAT8)),
                    by.get((system, mode)),
                )


PROFILE = "profile"
"""The worker mode of `--profile-moe`."""
PROFILE_WARMUP = 2
"""Steps `--profile-moe` runs before the recorded ones."""


def run_worker(args, launcher: list[str], mode: str) -> dict | None:
    """One tidal run of `mode` in its own process; its RESULT, or None (its output printed)."""
    cmd = launcher + [__file__, "--worker", mode] + worker_args(sys.argv[1:])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.tidal_timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        print(f"tidal {mode}: stopped after {args.tidal_timeout} s:\n{out[-2000:]}", flush=True)
        return None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        print(f"tidal {mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}", flush=True)
        return None
    return json.loads(lines[-1][7:])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (`argv`, default sys.argv[1:]); `--modes` split into a list."""
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
    p.add_argument(
        "--float8",
        default=None,
        choices=("tensorwise", "rowwise"),
        help="also run every mode with float8 linear layers (tidal and torchtitan)",
    )
    p.add_argument(
        "--float8-output",
        action="store_true",
        help="with --float8: the output layer in float8 too (default: kept in bf16)",
    )
    p.add_argument("--torchtitan", default=None, help="the .anchors folder; omit to skip")
    p.add_argument(
        "--torchtitan-args",
        default="",
        help="extra torchtitan flags for the same layout as --set, e.g. "
        "'--parallelism.tensor_parallel_degree 2'",
    )
    p.add_argument(
        "--torchtitan-timeout",
        type=int,
        default=300,
        help="seconds each torchtitan run of an MoE flavor may take",
    )
    p.add_argument(
        "--tidal-timeout",
        type=int,
        default=None,
        help="seconds each tidal run may take (default: no limit)",
    )
    p.add_argument(
        "--profile-moe",
        action="store_true",
        help="after the runs, profile eager tidal steps: time in router, dispatch/combine, "
        "expert GEMMs, attention, the rest (benchmarks/moe_profile.py)",
    )
    p.add_argument("--profile-steps", type=int, default=3, help="steps --profile-moe records")
    p.add_argument("--json", default=None, help="write all results to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    if args.torchtitan and args.float8 and is_moe(args.flavor):
        p.error("--float8 is not compared against torchtitan for an MoE flavor")
    return args


def main() -> None:
    args = parse_args()
    # NVLink multicast stays off on shared multi-GPU hosts (inherited by every run below).
    for var, value in (
        ("NCCL_NVLS_ENABLE", "0"),
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
        ("NVSHMEM_DISABLE_NVLS", "1"),
    ):
        os.environ.setdefault(var, value)
    if args.worker:
        result = run_profile(args) if args.worker == PROFILE else run_tidal(args, args.worker)
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
        return

    results = []
    if args.torchtitan and is_moe(args.flavor):
        import torchtitan_moe

        torchtitan_moe.install(Path(args.torchtitan).resolve())
        print(torchtitan_moe.compare(args.flavor, args.seq, moe_load_balance(args)), flush=True)
    for mode in all_modes(args):
        launcher = [sys.executable]
        if args.ranks > 1:
            launcher += [
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={args.ranks}",
            ]
        result = run_worker(args, launcher, mode)
        results.append(result or {"system": "tidal", "mode": mode, "error": "no result"})
        print(fmt(results[-1]), flush=True)
    if args.torchtitan:
        for r in run_torchtitan(args):
            results.append(r)
            print(fmt(r), flush=True)
    print_ratios(args, results)
    if args.profile_moe:
        from moe_profile import table

        profile = run_worker(args, [sys.executable], PROFILE)
        if profile is not None:
            print("\n" + table(profile["times_us"], profile["steps"], profile["device"]))
            results.append({"system": "tidal", "mode": PROFILE, **profile})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
