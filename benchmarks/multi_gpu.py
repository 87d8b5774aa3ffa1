"""Multi-GPU parity and throughput in one call, on one machine with N GPUs.

Parity: trains `--flavor` (default llama3_1b) for `--steps` (default 20) steps in
deterministic mode on the same global batches (a learnable synthetic token stream, fixed
seed) under several
layouts, each from the same initial weights (tidal initializes every parameter from a
generator seeded by (seed, parameter name), whatever the sharding: the seed is the seed
checkpoint), and prints each layout's per-step loss difference against FSDP over all N GPUs:

    fsdp        dp_shard=N                     (the reference)
    hsdp        dp_replicate=2, dp_shard=N/2
    tp2_fsdp    tp=2, dp_shard=N/2
    pp2_fsdp    pp=2 (1F1B), dp_shard=N/2
    cp2_fsdp    cp=2, dp_shard=N/2

Throughput: runs benchmarks/train_throughput.py on N ranks for FSDP N and FSDP x TP 2, both
compiled, and with `--torchtitan DIR` torchtitan 0.2.2 on the same layouts.

    python benchmarks/multi_gpu.py --gpus 8 --torchtitan .anchors
    python benchmarks/multi_gpu.py --gpus 2 --device cpu --flavor tiny --seq 64 --steps 4 \
        --global-batch 8 --skip-throughput                    # smoke test on CPU (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def layouts(n: int) -> dict[str, list[str]]:
    half = max(1, n // 2)
    return {
        "fsdp": [f"parallelism.dp_shard={n}"],
        "hsdp": ["parallelism.dp_replicate=2", f"parallelism.dp_shard={half}"],
        "tp2_fsdp": ["parallelism.tp=2", f"parallelism.dp_shard={half}"],
        "pp2_fsdp": [
            "parallelism.pp=2",
            f"parallelism.dp_shard={half}",
            "parallelism.pp_schedule=1F1B",
            "parallelism.pp_microbatches=2",
        ],
        "cp2_fsdp": ["parallelism.cp=2", f"parallelism.dp_shard={half}"],
    }


def dp_degree(overrides: list[str], n: int) -> int:
    d = dict(kv.split("=", 1) for kv in overrides)
    return n // (
        int(d.get("parallelism.tp", 1))
        * int(d.get("parallelism.pp", 1))
        * int(d.get("parallelism.cp", 1))
    )


def markov_tokens(vocab: int, n: int, successors: int = 4, seed: int = 0):
    """A learnable token stream: each token is followed by one of `successors` fixed random
    tokens. Uniformly random tokens carry no signal, and a 20-step parity run on them turned
    chaotic by step 12 (benchmarks/trainer.md); on this stream the loss falls from ln(vocab)
    towards ln(successors), as on real text."""
    import numpy as np

    rng = np.random.default_rng(seed)
    table = rng.integers(0, vocab, (vocab, successors))
    choice = rng.integers(0, successors, n)
    out = np.empty(n, dtype=np.int64)
    out[0] = 0
    for i in range(1, n):
        out[i] = table[out[i - 1], choice[i]]
    return out


def worker(args) -> None:
    import numpy as np

    from tidal.models.flavors import get_flavor
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

    info = DistInfo.from_env()
    overrides = layouts(args.gpus)[args.worker]
    dp = dp_degree(overrides, args.gpus)
    out = Path(args.out) / args.worker
    cfg = Config(
        job=JobConfig(name=args.worker, output_dir=str(out), device=args.device),
        model=ModelConfig(flavor=args.flavor),
        training=TrainingConfig(
            steps=args.steps,
            batch_size=args.global_batch // dp,
            seq_len=args.seq,
            deterministic=True,
            seed=0,
        ),
        lr_scheduler=SchedulerConfig(warmup_steps=2),
        metrics=MetricsConfig(log_every=1, val_every=0),
        sample=SampleConfig(max_new_tokens=0),
    )
    cfg = apply_overrides(cfg, [f"--{kv}" for kv in overrides])
    vocab = get_flavor(args.flavor).vocab_size
    tokens = markov_tokens(vocab, (args.steps + 1) * args.global_batch * args.seq + 1)

    def data(dp_rank: int, dp_world: int) -> DataBundle:
        loader = PackedLoader(
            tokens,
            np.array([0]),
            seq_len=args.seq,
            batch_size=args.global_batch // dp_world,
            seed=0,
            dp_rank=dp_rank,
            dp_world=dp_world,
        )
        from types import SimpleNamespace

        tok = SimpleNamespace(vocab_size=vocab, bos_id=0, eos_id=1)
        return DataBundle(tokenizer=tok, train=loader, val=None)

    trainer = Trainer(cfg, data=data, dist_info=info)
    try:
        trainer.train()
    finally:
        trainer.close()


def run_parity(args) -> dict[str, list[float]]:
    losses = {}
    for name in layouts(args.gpus):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.gpus}",
            __file__,
            "--worker",
            name,
            *sys.argv[1:],
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        metrics = Path(args.out) / name / "metrics.jsonl"
        if proc.returncode or not metrics.exists():
            print(f"{name}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        losses[name] = [json.loads(x)["loss"] for x in metrics.read_text().splitlines()]
        print(
            f"{name:10s} loss step 1 {losses[name][0]:.4f} -> step {len(losses[name])} "
            f"{losses[name][-1]:.4f}",
            flush=True,
        )
    ref = losses.get("fsdp")
    if ref:
        print(f"\nparity against fsdp over {len(ref)} steps (max |loss - loss_fsdp|):")
        for name, got in losses.items():
            if name != "fsdp":
                diff = max(abs(a - b) for a, b in zip(got, ref, strict=True))
                print(f"  {name:10s} {diff:.2e}")
    return losses


def run_throughput(args) -> None:
    """FSDP over all GPUs and FSDP x TP 2, compiled, each beside torchtitan on the same layout
    (train_throughput.py prints both and the per-device ratios)."""
    script = str(HERE / "train_throughput.py")
    base = [
        sys.executable,
        script,
        "--ranks",
        str(args.gpus),
        "--modes",
        "compile",
        "--device",
        args.device,
        "--flavor",
        args.flavor,
    ]
    titan = ["--torchtitan", args.torchtitan] if args.torchtitan else []
    print("\n== throughput: FSDP over all GPUs, compiled", flush=True)
    subprocess.run(base + titan)
    print("\n== throughput: FSDP x TP 2, compiled", flush=True)
    # Local batch 4 per dp rank, as torchtitan's config has it.
    tp_titan = titan + ["--torchtitan-args=--parallelism.tensor_parallel_degree 2"]
    subprocess.run(base + ["--set", "parallelism.tp=2"] + (tp_titan if titan else []))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gpus", type=int, required=True, help="ranks per run (GPUs)")
    p.add_argument("--flavor", default="llama3_1b")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step, all ranks")
    p.add_argument("--device", default="cuda")
    p.add_argument("--torchtitan", default=None)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--out", default=tempfile.mkdtemp(prefix="tidal_multi_gpu_"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    sys.argv += ["--out", args.out]
    run_parity(args)
    if not args.skip_throughput:
        run_throughput(args)


if __name__ == "__main__":
    main()
