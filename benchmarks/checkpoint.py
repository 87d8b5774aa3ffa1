"""Checkpoint save and load times of tidal against torchtitan on the same model, in one run.

Trains `--flavor` (default llama3_1b: 1.5B parameters, so 18 GB of fp32 weights and AdamW
state) on one device with batch 4 x 4096 in bf16, and saves a full checkpoint `--saves` times
with each `checkpoint.async_mode` (each mode in its own process, into its own folder): after
step `--first` (default `--interval`), then every `--interval` steps; after the last save it
trains on until that save's write has finished. Every step ends by waiting for the device's
compute stream, as the trainer's read of the loss does, so what training waits for on the
device counts (the pinned copy's event before the next optimizer step too), while the copy on
its side stream overlaps the next forward and backward as in training; `--sync device` waits
for every stream instead, the copy included, in the step that saves. An ordinary step is the
median of the steps before the first save (the first two left out). Per mode it prints, for
the saves after the first (steady state):

- the save as the step sees it ("step sees"): the wall time that the steps from the save
  until its background write has finished (at least the save's own step) took beyond as many
  ordinary steps, less the time the save waited for the previous save (next item), with the
  noise of that figure (one standard deviation, from the ordinary steps' spread);
- "waited": the time the save spent waiting for the previous save to finish writing (one save
  is in flight at a time, in tidal and torchtitan alike). It is nonzero only when saves come
  faster than they are written (`--interval` steps shorter than the write); then each save
  waits about write time minus interval whatever the checkpointer does, the figure is not a
  steady state, and the script says so;
- the save call (the training thread's time in `save()`) and the total save time, from the
  call until the checkpoint is complete on disk;
- the first save apart: its call (the pinned mode allocates and pins its staging buffers there)
  and what the step sees of it;
- for the pinned mode, the device-to-host copy time of the same bytes into the same pinned
  buffers measured in the same process while nothing else runs, and the ratio step sees / copy
  (target: <= 1.2x);
- the load time of the newest checkpoint into the running model (page cache warm: the file
  was just written).

With `--torchtitan DIR` (the `.anchors/` folder from shared/anchors/prepare.sh) torchtitan
0.2.2 then runs the same model through `DIR/torchtitan_baseline.sh` with `--checkpoint.enable`
in each of `--torchtitan-modes` (torchtitan saves at every multiple of `--interval` and at its
last step, which is `(--saves + 1) * --interval`), and its step logs and "Finished
saving/loading" lines give the same figures (a save's window: the `--interval` steps after
it, a wait for the previous save included), side by side, with the ratios tidal / torchtitan
of what the steps saw in all.

    python benchmarks/checkpoint.py --modes disabled,async_with_pinned_mem --first 30 \\
        --interval 150 --saves 2                                       # tidal, one GPU
    python benchmarks/checkpoint.py --modes none --torchtitan .anchors --interval 150 \\
        --saves 2 --torchtitan-modes async_with_pinned_mem             # torchtitan only
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


def _sync(device, how: str = "device") -> None:
    """Wait for the device: all of its streams, or (`how="stream"`) the compute stream only,
    as the trainer's read of the loss does."""
    import torch

    if device.type != "cuda":
        return
    if how == "stream":
        torch.cuda.current_stream(device).synchronize()
    else:
        torch.cuda.synchronize(device)


def save_steps(args) -> list[int]:
    """The steps after which tidal saves: `--first`, then every `--interval` steps."""
    first = args.first or args.interval
    return [first + k * args.interval for k in range(args.saves)]


def attribute(step_s: list[float], saves: list[dict], first: int) -> float:
    """Fill each save record with what the steps saw of it; returns the ordinary step time.

    `step_s[i]` is the wall time of step i + 1. A save record holds `step` (the step that
    saved), `done_step` (the last step of its window: the step at whose end its write was
    seen finished, or the step before the next save when that save had to wait for it),
    `wait_s` (the time its own step spent waiting for the previous save) and `call_s`. Adds
    `window_steps`, `blocked_s` (the window's time beyond as many ordinary steps: everything
    the steps saw, the wait included), `stall_s` (blocked_s less wait_s: what this save
    itself cost the steps) and `noise_s` (one standard deviation of blocked_s when the save
    costs nothing: the spread of that many ordinary steps and of the baseline). The baseline
    is the median of the steps before the first save, so a hiccup (a garbage collection, a
    slow step) inside the window counts against the save, never in its favour.
    """
    quiet = step_s[2 : first - 1]  # steps 3 .. first - 1: after warm-up, before any save
    assert quiet, f"--first {first} leaves no ordinary steps before the first save (needs >= 4)"
    ordinary = statistics.median(quiet)
    spread = statistics.stdev(quiet) if len(quiet) > 1 else 0.0
    for s in saves:
        window = step_s[s["step"] - 1 : s["done_step"]]
        n = len(window)
        s["window_steps"] = n
        s["blocked_s"] = sum(window) - n * ordinary
        s["stall_s"] = s["blocked_s"] - s["wait_s"]
        s["noise_s"] = spread * (n + n * n / len(quiet)) ** 0.5
    return ordinary


def run_tidal(args, mode: str) -> dict:
    """One mode, in this process: train, save `args.saves` times, load, copy once."""
    import numpy as np

    from tidal.models.flavors import get_flavor
    from tidal.train.checkpoint import checksum, plan_load
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
    at = save_steps(args)
    # After the last save, train on until its write has finished, up to this many steps.
    max_steps = at[-1] + args.max_tail
    cfg = Config(
        job=JobConfig(name=f"ckpt_{mode}", output_dir=str(out), device=args.device),
        model=ModelConfig(flavor=args.flavor),
        training=TrainingConfig(steps=max_steps, batch_size=args.batch, seq_len=args.seq),
        lr_scheduler=SchedulerConfig(warmup_steps=5),
        metrics=MetricsConfig(val_every=0),
        sample=SampleConfig(max_new_tokens=0),
        checkpoint=CheckpointConfig(
            enable=True,
            interval=10**9,
            keep_latest_k=2,
            async_mode=mode,
            checksums=not args.no_checksums,
        ),
    )
    vocab = get_flavor(args.flavor).vocab_size
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (max_steps + 2) * args.batch * args.seq + 1)
    loader = PackedLoader(tokens, np.array([0]), seq_len=args.seq, batch_size=args.batch, seed=0)
    tok = SimpleNamespace(vocab_size=vocab, bos_id=0, eos_id=1)
    trainer = Trainer(
        cfg, data=DataBundle(tokenizer=tok, train=loader, val=None), log=lambda *a: None
    )
    ckpt, device = trainer.checkpoint, trainer.device
    if ckpt.staging is not None and args.pinned_writer == "thread":
        from tidal.train.checkpoint.staging import PinnedStaging

        # The writer before the writer process: DCP's FileSystemWriter on the save's thread,
        # from pinned buffers of the trainer's own.
        ckpt.writer, ckpt.staging = None, PinnedStaging(device)

    def written(record: dict, last_step: int) -> None:
        ckpt.wait()  # returns at once when called after done(); raises if the save failed
        record.update(done_step=last_step, total_s=ckpt.stats.total_s, bytes=ckpt.stats.bytes)

    step_s: list[float] = []
    saves: list[dict] = []
    step = 0
    while step < max_steps:
        step += 1
        start = time.perf_counter()
        trainer.step = step
        set_lr(trainer.optimizer, cfg.optimizer.lr)
        batches, n_tokens, _ = trainer.next_batches()
        trainer.train_step(batches, n_tokens)
        if step in at:
            wait_s = 0.0
            if saves and "done_step" not in saves[-1]:
                # Still writing: this save must wait for it. The wait is this step's time,
                # reported apart; the previous save's window ends with the step before.
                wait = time.perf_counter()
                written(saves[-1], step - 1)
                wait_s = time.perf_counter() - wait
                saves[-1]["overran"] = True
            call = time.perf_counter()
            ckpt.save(step)
            saves.append({"step": step, "call_s": time.perf_counter() - call, "wait_s": wait_s})
        _sync(device, args.sync)
        step_s.append(time.perf_counter() - start)
        if saves and "done_step" not in saves[-1]:
            if ckpt.pending is None or ckpt.pending.done():
                written(saves[-1], step)
        if len(saves) == len(at) and "done_step" in saves[-1]:
            break
    if "done_step" not in saves[-1]:  # --max-tail ran out: the rest of the write is not seen
        written(saves[-1], step)
        saves[-1]["cut"] = True
    ordinary = attribute(step_s, saves, at[0])

    # The pinned mode: the device-to-host copy of the same bytes into the same buffers, alone.
    copy_s = None
    if ckpt.staging is not None:
        flat = ckpt._flat(step, model_only=False)
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

    plan = plan_load(
        cfg.checkpoint,
        out,
        trainer.args,
        args.flavor,
        total_steps=max_steps + 1,
        log=lambda *a: None,
    )
    assert plan is not None
    start = time.perf_counter()
    ckpt.load(plan)
    _sync(device)
    load_s = time.perf_counter() - start
    # The CRC32 of every saved chunk (a part of each save's total, and about the same again
    # inside the load, which checks what it reads), timed alone on the folder just loaded.
    start = time.perf_counter()
    checksum.compute(plan.path)
    checksum_s = time.perf_counter() - start
    trainer.close()
    shutil.rmtree(out, ignore_errors=True)
    steady = saves[1:] or saves

    def mean(key: str) -> float:
        return statistics.fmean(s[key] for s in steady)

    return {
        "system": "tidal",
        "mode": mode,
        "device": str(device),
        "bytes": saves[-1]["bytes"],
        "ordinary_step_s": ordinary,
        "interval_s": args.interval * ordinary,
        "stall_s": mean("stall_s"),
        "noise_s": mean("noise_s"),
        "wait_s": mean("wait_s"),
        "blocked_s": mean("blocked_s"),
        "call_s": mean("call_s"),
        "total_s": mean("total_s"),
        "first_stall_s": saves[0]["stall_s"],
        "first_call_s": saves[0]["call_s"],
        "first_total_s": saves[0]["total_s"],
        "saves": saves,
        "copy_s": copy_s,
        "load_s": load_s,
        "checksum_s": checksum_s,
        "pinned_writer": args.pinned_writer if copy_s is not None else None,
        "sync": args.sync,
    }


# -- torchtitan ------------------------------------------------------------------------------

STEP_RE = re.compile(r"step:\s*(\d+).*?tps:\s*([\d,]+)")
SAVE_RE = re.compile(r"Finished saving the checkpoint.*?in\s*([\d.]+)\s*seconds")
BG_RE = re.compile(r"Finish saving the checkpoint in the background process in ([\d.]+) seconds")
LOAD_RE = re.compile(r"Finished loading the checkpoint in\s*([\d.]+)\s*seconds")
TT_FLAVORS = {"llama3_1b": "1B", "llama3_8b": "8B", "debug": "debugmodel"}


def run_torchtitan(args) -> list[dict]:
    """The same model with torchtitan's checkpointer: one run per mode of
    `--torchtitan-modes`, then, when `disabled` is among them, one that resumes from the
    synchronous run's folder (its load time)."""
    flavor = TT_FLAVORS.get(args.flavor, args.flavor)
    steps = (args.saves + 1) * args.interval
    tokens = args.batch * args.seq
    folder = Path(args.folder)
    modes = [m for m in args.torchtitan_modes.split(",") if m]
    common = (
        f"--model.flavor {flavor} --training.local_batch_size {args.batch} "
        f"--training.seq_len {args.seq} --metrics.log_freq 1 --checkpoint.enable "
        f"--checkpoint.keep_latest_k 2 --checkpoint.no_last_save_model_only"
    )
    runs = []
    for mode in modes:
        # torchtitan saves at step % interval == 0 (and, synchronously, at its last step,
        # after the last window).
        runs.append(
            f"{common} --training.steps {steps} --checkpoint.interval {args.interval} "
            f"--checkpoint.async_mode {mode} --job.dump_folder {folder / f'tt_{mode}'}"
        )
    if "disabled" in modes:
        runs.append(
            f"{common} --training.steps {steps + 1} --checkpoint.interval {10**6} "
            f"--job.dump_folder {folder / 'tt_disabled'}"
        )  # resumes: the load time
    env = dict(os.environ, RUNS="\n".join(runs), TAILN="4", T=str(args.torchtitan_timeout))
    script = Path(args.torchtitan) / "torchtitan_baseline.sh"
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    results = []
    names = [*modes, "load"] if "disabled" in modes else modes
    for i, mode in enumerate(names, start=1):
        path = Path(f"/tmp/torchtitan_run_{i}.log")
        log = re.sub(r"\x1b\[[0-9;]*m", "", path.read_text() if path.exists() else "")
        if mode == "load":
            loads = [float(x) for x in LOAD_RE.findall(log)]
            if loads and results and "error" not in results[0]:
                results[0]["load_s"] = loads[-1]
            continue
        times = {
            int(m.group(1)): tokens / float(m.group(2).replace(",", ""))
            for m in STEP_RE.finditer(log)
        }
        calls = [float(x) for x in SAVE_RE.findall(log)][: args.saves]  # not the last step's
        if len(times) < steps or not calls:
            tail = (log or proc.stdout + proc.stderr)[-3000:]
            print(f"torchtitan {mode}: step or save logs not found; tail:\n{tail}", flush=True)
            results.append({"system": "torchtitan", "mode": mode, "error": "no logs"})
            continue
        # Steps 3 .. interval: the save after step `interval` comes after its log line.
        quiet = [times[s] for s in range(3, args.interval + 1)]
        ordinary, spread = statistics.median(quiet), statistics.stdev(quiet)
        blocked = []
        for k in range(1, args.saves + 1):
            s = k * args.interval  # saved after step s's log line: seen by steps s+1 ...
            window = [times[t] for t in range(s + 1, min(s + args.interval, steps) + 1)]
            blocked.append(sum(window) - len(window) * ordinary)
        n = args.interval
        background = [float(x) for x in BG_RE.findall(log)][: args.saves]
        steady = blocked[1:] or blocked
        results.append(
            {
                "system": "torchtitan",
                "mode": mode,
                "ordinary_step_s": ordinary,
                "first_stall_s": blocked[0],
                "blocked_s": statistics.fmean(steady),
                "noise_s": spread * (n + n * n / len(quiet)) ** 0.5,
                "first_call_s": calls[0],
                "call_s": statistics.fmean(calls[1:] or calls),
                "total_s": statistics.fmean(background[1:] or background) if background else None,
            }
        )
        if mode != "disabled":  # the synchronous run's folder is resumed by the load run
            shutil.rmtree(folder / f"tt_{mode}", ignore_errors=True)
    shutil.rmtree(folder / "tt_disabled", ignore_errors=True)
    return results


def fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['system']:10s} {r['mode']:22s} error: {r['error']}"

    def s(key):
        v = r.get(key)
        return f"{v:7.3f}s" if v is not None else "    n/a "

    if "stall_s" in r:  # tidal: the wait for the previous save apart
        sees = f"step sees {s('stall_s')} +-{r['noise_s']:.3f} (waited {s('wait_s')}, "
    else:  # torchtitan: a wait for the previous save, if any, included
        sees = f"step sees {s('blocked_s')} +-{r['noise_s']:.3f} ("
    line = (
        f"{r['system']:10s} {r['mode']:22s} {sees}call {s('call_s')})  total "
        f"{s('total_s')}  first save: call {s('first_call_s')}, step sees "
        f"{s('first_stall_s')}  load {s('load_s')}  ordinary step "
        f"{s('ordinary_step_s')}"
    )
    if r.get("bytes"):
        line += f"  {r['bytes'] / 1e9:.2f} GB"
    if r.get("checksum_s") is not None:
        line += f"  (crc32 of it {r['checksum_s']:.2f}s)"
    return line


def report_pinned(r: dict) -> None:
    """The target's line: what the step sees of a steady-state pinned save against the
    device-to-host copy of its bytes; and why the figure is not a steady state if it is not."""
    ratio, gb = r["stall_s"] / r["copy_s"], r["bytes"] / 1e9
    noise = r["noise_s"] / r["copy_s"]
    overran = any(x.get("overran") for x in r["saves"])
    if overran:
        verdict = "not a steady state (below)"
    elif ratio + noise <= 1.2:
        verdict = "met"
    elif ratio - noise > 1.2:
        verdict = "NOT met"
    else:
        verdict = "not resolved: the noise spans the target"
    print(
        f"\npinned save ({r['pinned_writer']} writer, --sync {r['sync']}): the step sees "
        f"{r['stall_s']:.3f}s +-{r['noise_s']:.3f}; the device-to-host copy of its "
        f"{gb:.2f} GB alone takes {r['copy_s']:.3f}s ({gb / r['copy_s']:.1f} GB/s); ratio "
        f"{ratio:.2f}x +-{noise:.2f} (target <= 1.2x): {verdict}"
    )
    print(
        f"  first save (allocates and pins {gb:.2f} GB of staging): call "
        f"{r['first_call_s']:.3f}s, the step sees {r['first_stall_s']:.3f}s"
    )
    if overran:
        print(
            f"  NOT a steady state: saves came faster than they were written (--interval is "
            f"{r['interval_s']:.1f}s of steps; the writes took {r['first_total_s']:.1f}s "
            f"first, then {r['total_s']:.1f}s), so a save also waited for the previous one, "
            f"{r['wait_s']:.3f}s on average (any checkpointer waits about write minus "
            f"interval); with the wait the step sees {r['blocked_s']:.3f}s, "
            f"{r['blocked_s'] / r['copy_s']:.1f}x the copy. Use a longer --interval."
        )
    if r["saves"][-1].get("cut"):
        print(
            "  the last save's write outlasted --max-tail steps: the steps after them did "
            "not see the rest of it"
        )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--flavor", default="llama3_1b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--interval",
        type=int,
        default=150,
        help="steps between saves (longer than a save's write, for a steady state; "
        "torchtitan also saves first after this many steps)",
    )
    p.add_argument(
        "--first",
        type=int,
        default=None,
        help="tidal: the step of the first save (default --interval); the steps "
        "before it (from the third) give the ordinary step time",
    )
    p.add_argument("--saves", type=int, default=2)
    p.add_argument(
        "--sync",
        choices=("stream", "device"),
        default="stream",
        help="what a step waits for at its end: the compute stream, as the trainer "
        "does, or every stream of the device (the staging copy too)",
    )
    p.add_argument(
        "--max-tail",
        type=int,
        default=None,
        help="tidal: at most this many steps after the last save while its write "
        "goes on (default 4 x --interval)",
    )
    p.add_argument("--modes", default=",".join(MODES), help="tidal's modes, or none")
    p.add_argument(
        "--pinned-writer",
        choices=("process", "thread"),
        default="process",
        help="who writes the pinned mode's bytes: the writer process (tidal's "
        "default) or, to compare, a thread of the trainer as before",
    )
    p.add_argument(
        "--no-checksums",
        action="store_true",
        help="save and load without CRC32 checksums (checkpoint.checksums false)",
    )
    p.add_argument("--folder", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--torchtitan", default=None, help="the .anchors folder; omit to skip")
    p.add_argument(
        "--torchtitan-modes",
        default=",".join(MODES),
        help="torchtitan's modes (with disabled, a run that loads its checkpoint)",
    )
    p.add_argument("--torchtitan-timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--json", default=None, help="write all results to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.folder = args.folder or tempfile.mkdtemp(prefix="tidal_ckpt_bench_")
    args.max_tail = args.max_tail if args.max_tail is not None else 4 * args.interval
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

    pinned = next(
        (r for r in results if r["mode"] == "async_with_pinned_mem" and "error" not in r), None
    )
    if pinned is not None:
        report_pinned(pinned)
    if args.torchtitan:
        print()
        for r in run_torchtitan(args):
            results.append(r)
            print(fmt(r), flush=True)
        print(
            "\nratios tidal / torchtitan (lower is better; step sees: all the steps saw, "
            "a wait for the previous save included, on both sides):"
        )
        by = {(r["system"], r["mode"]): r for r in results if "error" not in r}
        for mode in MODES:
            a, b = by.get(("tidal", mode)), by.get(("torchtitan", mode))
            if not (a and b):
                continue
            parts = []
            for key, name in (("blocked_s", "step sees"), ("total_s", "total"), ("load_s", "load")):
                if a.get(key) and b.get(key):
                    parts.append(f"{name} {a[key] / b[key]:.2f}x")
            print(f"  {mode:22s} " + ", ".join(parts))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if "--folder" not in sys.argv:
        shutil.rmtree(args.folder, ignore_errors=True)


if __name__ == "__main__":
    main()
