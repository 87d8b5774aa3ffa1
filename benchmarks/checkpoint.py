"""Checkpoint save and load times of tidal against torchtitan on the same model, in one run.

Trains `--flavor` (default llama3_1b: 1.5B parameters, so 18 GB of fp32 weights and AdamW
state) on one device with batch 4 x 4096 in bf16, and saves a full checkpoint every
`--interval` steps with each `checkpoint.async_mode` (each mode in its own process, into its own
folder). Per mode it prints:

- the save as the step sees it: the wall time that the steps from a save until its background
  write has finished (at least one step) took beyond as many ordinary steps (the median step
  before the first save); every step is synchronized with the device, so device-side waits
  count;
- the total save time, from the call until the checkpoint is complete on disk;
- for the pinned mode, the device-to-host copy time of the same bytes into the same pinned
  buffers measured in the same process while nothing else runs, and the ratio blocked / copy
  (target: <= 1.2x). The first pinned save also allocates and pins the buffers; it is reported
  apart and left out of the steady-state figure;
- the load time of the newest checkpoint into the running model (page cache warm: the file
  was just written).

With `--torchtitan DIR` (the `.anchors/` folder from shared/anchors/prepare.sh) torchtitan
0.2.2 then runs the same model and schedule through `DIR/torchtitan_baseline.sh` with
`--checkpoint.enable` in each async mode, and its step logs and "Finished saving/loading"
lines give the same figures, side by side, with the ratios tidal / torchtitan.

    python benchmarks/checkpoint.py --torchtitan .anchors              # one GPU
    python benchmarks/checkpoint.py --modes none --torchtitan .anchors # torchtitan only
    python benchmarks/checkpoint.py --modes async_with_pinned_mem --saves 2 \\
        --pinned-writer thread                       # the pinned mode's old in-process writer
    python benchmarks/checkpoint.py --flavor debug --device cpu --batch 2 --seq 128 \\
        --interval 6 --saves 2                                         # smoke test on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

MODES = ("disabled", "async", "async_with_pinned_mem")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_tidal(args, mode: str) -> dict:
    """One mode, in this process: train, save `args.saves` times, load, copy once."""
    import numpy as np

    from tidal.models.flavors import get_flavor
    from tidal.train.checkpoint import plan_load
    from tidal.train.config import (
        CheckpointConfig,
        Config,
        JobConfig,
        MetricsConfig,
        ModelConfig,
        SampleConfig,
        SchedulerConfig,
        TrainingConfig,
    )
    from tidal.train.data import DataBundle, PackedLoader
    from tidal.train.optim import set_lr
    from tidal.train.trainer import Trainer

    out = Path(args.folder) / f"tidal_{mode}"
    shutil.rmtree(out, ignore_errors=True)
    steps = (args.saves + 1) * args.interval  # saves after steps interval, 2 interval, ...
    cfg = Config(
        job=JobConfig(name=f"ckpt_{mode}", output_dir=str(out), device=args.device),
        model=ModelConfig(flavor=args.flavor),
        training=TrainingConfig(steps=steps, batch_size=args.batch, seq_len=args.seq),
        lr_scheduler=SchedulerConfig(warmup_steps=5),
        metrics=MetricsConfig(val_every=0),
        sample=SampleConfig(max_new_tokens=0),
        checkpoint=CheckpointConfig(
            enable=True, interval=10**9, keep_latest_k=2, async_mode=mode
        ),  # fmt: skip
    )
    vocab = get_flavor(args.flavor).vocab_size
    tokens = np.random.default_rng(0).integers(0, vocab, (steps + 2) * args.batch * args.seq + 1)
    loader = PackedLoader(tokens, np.array([0]), seq_len=args.seq, batch_size=args.batch, seed=0)
    tok = SimpleNamespace(vocab_size=vocab, bos_id=0, eos_id=1)
    trainer = Trainer(cfg, data=DataBundle(tokenizer=tok, train=loader, val=None),
                      log=lambda *a: None)  # fmt: skip
    ckpt, device = trainer.checkpoint, trainer.device
    if ckpt.staging is not None and args.pinned_writer == "thread":
        from tidal.train.checkpoint.staging import PinnedStaging

        # The writer before the writer process: DCP's FileSystemWriter on the save's thread,
        # from pinned buffers of the trainer's own.
        ckpt.writer, ckpt.staging = None, PinnedStaging(device)

    step_s, saves = [], []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        trainer.step = step
        set_lr(trainer.optimizer, cfg.optimizer.lr)
        batches, n_tokens, _ = trainer.next_batches()
        trainer.train_step(batches, n_tokens)
        if step % args.interval == 0 and len(saves) < args.saves:
            if saves and "done_step" not in saves[-1]:  # still writing: this save waits
                ckpt.wait()
                saves[-1].update(done_step=step, total_s=ckpt.stats.total_s,
                                 bytes=ckpt.stats.bytes)  # fmt: skip
            call = time.perf_counter()
            ckpt.save(step)
            saves.append({"step": step, "call_s": time.perf_counter() - call})
        _sync(device)
        step_s.append(time.perf_counter() - start)
        if saves and "done_step" not in saves[-1]:
            if ckpt.pending is None or ckpt.pending.done():
                ckpt.wait()  # returns at once; raises if the save failed
                saves[-1].update(done_step=step, total_s=ckpt.stats.total_s,
                                 bytes=ckpt.stats.bytes)  # fmt: skip
    ckpt.finish()
    if "done_step" not in saves[-1]:
        saves[-1].update(done_step=steps, total_s=ckpt.stats.total_s, bytes=ckpt.stats.bytes)

    ordinary = statistics.median(step_s[2 : args.interval - 1])  # before the first save
    for s in saves:
        window = step_s[s["step"] - 1 : s["done_step"]]
        s["blocked_s"] = sum(window) - len(window) * ordinary
        s["window_steps"] = len(window)

    # The pinned mode: the device-to-host copy of the same bytes into the same buffers, alone.
    copy_s = None
    if ckpt.staging is not None:
        flat = ckpt._flat(steps, model_only=False)
        copies = []
        for _ in range(3):
            start = time.perf_counter()
            ckpt.staging.stage(flat)
            if ckpt.staging.cuda:
                ckpt.staging.wait_copied()
            else:
                ckpt.staging.run_host_copy()
            copies.append(time.perf_counter() - start)
            ckpt.staging.wait_before_update()
        copy_s = statistics.median(copies)
        del flat

    plan = plan_load(cfg.checkpoint, out, trainer.args, args.flavor, total_steps=steps + 1,
                     log=lambda *a: None)  # fmt: skip
    assert plan is not None
    start = time.perf_counter()
    ckpt.load(plan)
    _sync(device)
    load_s = time.perf_counter() - start
    trainer.close()
    shutil.rmtree(out, ignore_errors=True)
    steady = saves[1:] or saves
    return {
        "system": "tidal",
        "mode": mode,
        "device": str(device),
        "bytes": saves[-1]["bytes"],
        "ordinary_step_s": ordinary,
        "first_blocked_s": saves[0]["blocked_s"],
        "blocked_s": statistics.mean(s["blocked_s"] for s in steady),
        "call_s": statistics.mean(s["call_s"] for s in steady),
        "total_s": statistics.mean(s["total_s"] for s in steady),
        "window_steps": [s["window_steps"] for s in saves],
        "copy_s": copy_s,
        "load_s": load_s,
        "pinned_writer": args.pinned_writer if copy_s is not None else None,
    }


# -- torchtitan ------------------------------------------------------------------------------

STEP_RE = re.compile(r"step:\s*(\d+).*?tps:\s*([\d,]+)")
SAVE_RE = re.compile(r"Finished saving the checkpoint.*?in\s*([\d.]+)\s*seconds")
BG_RE = re.compile(r"Finish saving the checkpoint in the background process in ([\d.]+) seconds")
LOAD_RE = re.compile(r"Finished loading the checkpoint in\s*([\d.]+)\s*seconds")
TT_FLAVORS = {"llama3_1b": "1B", "llama3_8b": "8B", "debug": "debugmodel"}


def run_torchtitan(args) -> list[dict]:
    """The same schedule with torchtitan's checkpointer: one run per mode, then one that
    resumes from the synchronous run's folder (its load time)."""
    flavor = TT_FLAVORS.get(args.flavor, args.flavor)
    steps = (args.saves + 1) * args.interval
    tokens = args.batch * args.seq
    folder = Path(args.folder)
    common = (f"--model.flavor {flavor} --training.local_batch_size {args.batch} "
              f"--training.seq_len {args.seq} --metrics.log_freq 1 --checkpoint.enable "
              f"--checkpoint.keep_latest_k 2 --checkpoint.no_last_save_model_only")  # fmt: skip
    runs = []
    for mode in MODES:
        # torchtitan saves at step % interval == 0: the same steps as tidal's saves.
        runs.append(
            f"{common} --training.steps {steps} --checkpoint.interval {args.interval} "
            f"--checkpoint.async_mode {mode} --job.dump_folder {folder / f'tt_{mode}'}"
        )
    runs.append(
        f"{common} --training.steps {steps + 1} --checkpoint.interval {10**6} "
        f"--job.dump_folder {folder / 'tt_disabled'}"
    )  # resumes: the load time
    env = dict(os.environ, RUNS="\n".join(runs), TAILN="4", T=str(args.torchtitan_timeout))
    script = Path(args.torchtitan) / "torchtitan_baseline.sh"
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    results = []
    for i, mode in enumerate([*MODES, "load"], start=1):
        path = Path(f"/tmp/torchtitan_run_{i}.log")
        log = re.sub(r"\x1b\[[0-9;]*m", "", path.read_text() if path.exists() else "")
        if mode == "load":
            loads = [float(x) for x in LOAD_RE.findall(log)]
            if loads and results and "error" not in results[0]:
                results[0]["load_s"] = loads[-1]
            continue
        times = {int(m.group(1)): tokens / float(m.group(2).replace(",", ""))
                 for m in STEP_RE.finditer(log)}  # fmt: skip
        calls = [float(x) for x in SAVE_RE.findall(log)]
        if len(times) < steps or not calls:
            tail = (log or proc.stdout + proc.stderr)[-3000:]
            print(f"torchtitan {mode}: step or save logs not found; tail:\n{tail}", flush=True)
            results.append({"system": "torchtitan", "mode": mode, "error": "no logs"})
            continue
        ordinary = statistics.median(times[s] for s in range(3, args.interval + 1))
        blocked = []
        for k in range(1, args.saves + 1):
            s = k * args.interval  # saved after step s's log line: seen by steps s+1 ...
            window = [times[t] for t in range(s + 1, min(s + args.interval, steps) + 1)]
            blocked.append(sum(window) - len(window) * ordinary)
        background = [float(x) for x in BG_RE.findall(log)]
        steady = blocked[1:] or blocked
        results.append({
            "system": "torchtitan", "mode": mode, "ordinary_step_s": ordinary,
            "first_blocked_s": blocked[0], "blocked_s": statistics.mean(steady),
            "call_s": statistics.mean(calls[1:] or calls),
            "total_s": statistics.mean(background) if background else None,
        })  # fmt: skip
        if mode != "disabled":  # the synchronous run's folder is resumed by the load run
            shutil.rmtree(folder / f"tt_{mode}", ignore_errors=True)
    shutil.rmtree(folder / "tt_disabled", ignore_errors=True)
    return results


def fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['system']:10s} {r['mode']:22s} error: {r['error']}"

    def s(key):
        v = r.get(key)
        return f"{v:8.3f}s" if v is not None else "     n/a "

    line = (f"{r['system']:10s} {r['mode']:22s} step sees {s('blocked_s')} (first "
            f"{s('first_blocked_s')}, call {s('call_s')})  total {s('total_s')}  load "
            f"{s('load_s')}  ordinary step {s('ordinary_step_s')}")  # fmt: skip
    if r.get("bytes"):
        line += f"  {r['bytes'] / 1e9:.2f} GB"
    return line


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--flavor", default="llama3_1b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--interval", type=int, default=30, help="steps before the first save and between saves"
    )
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES), help="tidal's modes, or none")
    p.add_argument("--pinned-writer", choices=("process", "thread"), default="process",
                   help="who writes the pinned mode's bytes: the writer process (tidal's "
                   "default) or, to compare, a thread of the trainer as before")  # fmt: skip
    p.add_argument("--folder", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--torchtitan", default=None, help="the .anchors folder; omit to skip")
    p.add_argument("--torchtitan-timeout", type=int, default=600)
    p.add_argument("--json", default=None, help="write all results to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.folder = args.folder or tempfile.mkdtemp(prefix="tidal_ckpt_bench_")
    modes = [m for m in args.modes.split(",") if m and m != "none"]  # none: torchtitan only
    if args.worker:
        print("RESULT " + json.dumps(run_tidal(args, args.worker)), flush=True)
        return

    results = []
    for mode in modes:
        cmd = [sys.executable, __file__, "--worker", mode, *sys.argv[1:]]
        if "--folder" not in sys.argv:
            cmd += ["--folder", args.folder]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"tidal {mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}", flush=True)
            results.append({"system": "tidal", "mode": mode, "error": f"exit {proc.returncode}"})
        else:
            results.append(json.loads(lines[-1][7:]))
        print(fmt(results[-1]), flush=True)

    pinned = next((r for r in results if r["mode"] == "async_with_pinned_mem"
                   and "error" not in r), None)  # fmt: skip
    if pinned is not None:
        ratio = pinned["blocked_s"] / pinned["copy_s"]
        print(f"\npinned save ({pinned.get('pinned_writer')} writer): the step waits "
              f"{pinned['blocked_s']:.3f}s; the device-to-host copy of its "
              f"{pinned['bytes'] / 1e9:.2f} GB alone takes {pinned['copy_s']:.3f}s "
              f"({pinned['bytes'] / 1e9 / pinned['copy_s']:.1f} GB/s); ratio {ratio:.2f}x "
              f"(target <= 1.2x): {'met' if ratio <= 1.2 else 'NOT met'}")  # fmt: skip
    if args.torchtitan:
        print()
        for r in run_torchtitan(args):
            results.append(r)
            print(fmt(r), flush=True)
        print("\nratios tidal / torchtitan (lower is better):")
        by = {(r["system"], r["mode"]): r for r in results if "error" not in r}
        for mode in MODES:
            a, b = by.get(("tidal", mode)), by.get(("torchtitan", mode))
            if not (a and b):
                continue
            parts = []
            for key, name in (("blocked_s", "step sees"), ("total_s", "total"),
                              ("load_s", "load")):  # fmt: skip
                if a.get(key) and b.get(key):
                    parts.append(f"{name} {a[key] / b[key]:.2f}x")
            print(f"  {mode:22s} " + ", ".join(parts))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if "--folder" not in sys.argv:
        shutil.rmtree(args.folder, ignore_errors=True)


if __name__ == "__main__":
    main()
