"""tidal RL side by side with a peer, one GPU: tidal sync, tidal async (max_staleness 1 and 4)
and TRL's GRPOTrainer on the same SmolLM2-135M-shaped model, task, reward and batch.

Every run uses the `rl_addition_135m` config: 1-3 digit addition, 16 prompts x 8 samples x up
to 128 new tokens a step, the same learning rate and schedule. The model is warm-started in
the same command: the first tidal run trains the SFT warm start from scratch on the GPU (a
fresh cache folder), the others reuse it, and it is exported with tidal's DCP -> Hugging Face
conversion for TRL (benchmarks/rl_trl.py, fed the prompts tidal's generator draws at each
step, their token ids checked equal).

Printed for each run: steps/hour, generated tokens/s, seconds per step, held-out pass@1 before
and after, the trainer's idle share, and the time to reach the tidal sync run's final pass@1
where a run reaches it. Step times leave out held-out evaluation (each run evaluates the same
200 problems greedily every 10 steps; tidal's generator does it in the loop, TRL's in a
callback), and the first step (warm-up); s/step is their mean, printed with the median and
the slowest step (a mean above the median: outliers, such as compiles inside steps). Then
the ratios against the targets:

- tidal sync >= 10x TRL's steps/hour (TRL measured 3.39 s/step, 1,061 steps/hour, at this
  batch on a random-init model of this shape: ../shared/anchors/trl_grpo.py);
- tidal async >= 1.3x tidal sync, with the trainer idle <= 15% of its wall time;
- async reaches the sync run's final pass@1.

The reward curves of all runs go to one PNG (`--png`).

Runs named `..._mps` are the same runs with `--rl.mps true`: `tidal rl` starts a CUDA MPS
daemon for their roles alone (tidal/rl/distributed/mps.py). On one GPU without MPS the
trainer's and the generator's processes time-slice the GPU: their kernels never run at the
same time, so the asynchronous loop can only overlap their host-side gaps. Under MPS their
kernels may share the GPU's SMs at once; the `s4_t50` and `s4_t30` runs also cap the trainer
at 50% and 30% of the SMs (`--trainer.sm_percent`), leaving the rest to the generator's decode
kernels. Measured on
an H200 (benchmarks/rl.md), MPS alone changed the async run by under 1% and slowed the
sync run by 11%, so the MPS runs are left out unless named.

    python benchmarks/rl_peer.py --png rl_peer.png --json rl_peer.json   # one GPU
    python benchmarks/rl_peer.py --only sync s4 s4_t50 --no-trl          # an SM split under MPS
    python benchmarks/rl_peer.py --only sync sync_bi --no-trl   # batch-invariant mode's cost
    python benchmarks/rl_peer.py --smoke --no-trl         # CPU, tiny sizes (tested)
    python benchmarks/rl_peer.py --config rl_addition --only sync s4 --no-trl   # the CPU demo
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = "rl_addition_135m"
TRL_STEP_S_ANCHOR = 3.39
"""TRL's seconds per step at this batch, random init (../shared/anchors/trl_grpo.py)."""


def _rl_bench():
    spec = importlib.util.spec_from_file_location("rl_bench", HERE / "rl.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def work_times(steps: list[dict], evals: list[dict], key: str = "elapsed_s") -> list[float]:
    """Each step's seconds, the held-out evaluations inside it left out: the evaluation of
    version v runs before the rollouts of step v + 1 are generated, inside that step."""
    eval_s = {e["step"]: e.get("eval_s", 0.0) for e in evals}
    out, before = [], 0.0
    for r in steps:
        span = r[key] - before
        before = r[key]
        out.append(max(span - eval_s.get(r["step"] - 1, 0.0), 0.0))
    return out


def summarize(
    name: str,
    steps: list[dict],
    evals: list[dict],
    step_s: list[float],
    gen_tokens: list[float],
    target: float | None,
) -> dict:
    """The figures of one run from its per-step records (the first step left out)."""
    warm = step_s[1:] or step_s
    mean_s = sum(warm) / len(warm)
    gen = gen_tokens[1:] or gen_tokens
    fig = {
        "name": name,
        "steps": len(steps),
        "step_s": mean_s,
        # A mean well above the median: slow outliers (first-use compiles or captures).
        "step_s_median": statistics.median(warm),
        "step_s_max": max(warm),
        "steps_per_hour": 3600 / max(mean_s, 1e-9),
        "gen_tokens_per_s": sum(gen) / max(sum(warm), 1e-9),
        "pass1_before": evals[0]["eval_pass1"] if evals else None,
        "pass1_after": evals[-1]["eval_pass1"] if evals else None,
        "rewards": [r.get("reward_mean") for r in steps],
        "evals": [(e["step"], e["eval_pass1"]) for e in evals],
    }
    if target is not None:  # the work time until the first evaluation at or above target
        done = {r["step"]: t for r, t in zip(steps, itertools.accumulate(step_s), strict=True)}
        hit = [e["step"] for e in evals if e["eval_pass1"] >= target - 1e-9]
        fig["time_to_target_s"] = done.get(hit[0], 0.0) if hit else None
    return fig


def tidal_run(bench, name: str, config: str, extra: list[str], out: Path, timeout: float) -> dict:
    fig = bench.run(name, ["--config", config, *extra], out, timeout=timeout)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    fig["records"] = records
    return fig


def tidal_summary(fig: dict, target: float | None) -> dict:
    steps = [r for r in fig["records"] if "reward_mean" in r]
    evals = [r for r in fig["records"] if "eval_pass1" in r]
    gen = [r["tokens_per_s_gen"] * r["gen_s"] for r in steps]
    out = summarize(fig["name"], steps, evals, work_times(steps, evals), gen, target)
    out["trainer_idle_frac"] = fig["trainer_idle_frac"]
    out["sync_trainer_ms"] = 1000 * fig["sync_trainer_s"]
    out["sync_generator_ms"] = 1000 * fig["sync_generator_s"]
    return out


def export_for_trl(config: str, overrides: list[str], folder: Path) -> Path:
    """The SFT warm start as a Hugging Face folder, and the run's prompts as JSON."""
    from tidal.rl.build import make_task
    from tidal.rl.configs import get_rl_config
    from tidal.rl.experience import request_seed
    from tidal.rl.warmstart import resolve_policy
    from tidal.train.checkpoint.hf import dcp_to_hf
    from tidal.train.config_parse import apply_overrides

    cfg = apply_overrides(get_rl_config(config), overrides)
    src = resolve_policy(cfg, log=lambda _: None)
    assert src.checkpoint is not None, "the SFT warm start was not trained"
    dcp_to_hf(
        src.checkpoint, folder / "hf", args=src.args, tokenizer=src.tokenizer, log=lambda _: None
    )
    task, r = make_task(cfg), cfg.rollout

    def render(problems) -> tuple[list[str], list[list[int]], list]:
        ids = [src.encoder.prompt_ids([{"role": "user", "content": p.prompt}]) for p in problems]
        text = [src.tokenizer.decode(x, skip_special_tokens=False) for x in ids]
        return text, ids, [p.reference for p in problems]

    train = []
    for step in range(1, cfg.rl.steps + 1):
        stream = task.problems("train", seed=request_seed(r.seed, step, 0))
        train += [next(stream) for _ in range(r.prompts_per_step)]
    train_text, train_ids, train_refs = render(train)
    eval_text, _, eval_refs = render(task.eval_set(cfg.task.eval_problems, seed=cfg.task.eval_seed))
    run = {
        "task": cfg.task.name,
        "task_params": cfg.task.params,
        "steps": cfg.rl.steps,
        "prompts_per_step": r.prompts_per_step,
        "group_size": r.group_size,
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "lr": cfg.optimizer.lr,
        "warmup_steps": cfg.lr_scheduler.warmup_steps,
        "eval_every": cfg.rl.eval_every,
        "stop_ids": sorted(src.encoder.stop_ids),
        "train_text": train_text,
        "train_ids": train_ids,
        "train_refs": train_refs,
        "eval_text": eval_text,
        "eval_refs": eval_refs,
    }
    path = folder / "problems.json"
    path.write_text(json.dumps(run))
    return path


def trl_run(folder: Path, timeout: float) -> dict | None:
    out = folder / "trl.json"
    cmd = [
        sys.executable,
        str(HERE / "rl_trl.py"),
        "--hf",
        str(folder / "hf"),
        "--problems",
        str(folder / "problems.json"),
        "--json",
        str(out),
    ]
    print("== trl: " + " ".join(cmd[1:]), flush=True)
    try:
        p = subprocess.run(cmd, timeout=timeout, text=True, capture_output=True)
    except subprocess.TimeoutExpired:
        print(f"   TRL was stopped after {timeout:.0f}s")
        return None
    for line in p.stdout.splitlines():
        if line.startswith("trl "):
            print("   " + line)
    if p.returncode != 0:
        print("\n".join((p.stdout + p.stderr).splitlines()[-25:]))
        print(f"   TRL exited with status {p.returncode}")
        return None
    return json.loads(out.read_text())


def report(figs: list[dict]) -> None:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    print(
        f"{'run':<16}{'s/step':>8}{'median':>8}{'max':>7}{'steps/h':>9}{'gen tok/s':>11}"
        f"{'pass@1':>16}{'to target':>11}{'trainer idle':>14}"
    )
    for f in figs:
        reach = f.get("time_to_target_s")
        idle = f.get("trainer_idle_frac")
        print(
            f"{f['name']:<16}{f['step_s']:>8.3f}{f.get('step_s_median', f['step_s']):>8.3f}"
            f"{f.get('step_s_max', f['step_s']):>7.2f}{f['steps_per_hour']:>9,.0f}"
            f"{f['gen_tokens_per_s']:>11,.0f}"
            f"{pct(f['pass1_before']) + ' -> ' + pct(f['pass1_after']):>16}"
            f"{'-' if reach is None else f'{reach:.0f}s':>11}"
            f"{'-' if idle is None else f'{100 * idle:.0f}%':>14}"
        )
    by = {f["name"]: f for f in figs}
    sync = by.get("tidal sync")
    if sync and "trl" in by:
        r = sync["steps_per_hour"] / by["trl"]["steps_per_hour"]
        print(f"tidal sync / TRL steps/hour: {r:.1f}x (target >= 10x)")
    if sync:
        r = sync["steps_per_hour"] / (3600 / TRL_STEP_S_ANCHOR)
        print(f"tidal sync / TRL's anchor (random init, 1,061 steps/hour): {r:.1f}x")
    # Each async run against the faster sync run (with or without MPS), so MPS is credited
    # only where it helps the asynchronous loop.
    syncs = [f for f in (sync, by.get("tidal sync +MPS")) if f]
    best = max(syncs, key=lambda f: f["steps_per_hour"]) if syncs else None
    for a in [f for f in figs if f["name"].startswith("tidal async")] if best else []:
        ok = a["pass1_after"] is not None and a["pass1_after"] >= best["pass1_after"]
        print(
            f"{a['name']} / {best['name']} steps/hour: "
            f"{a['steps_per_hour'] / best['steps_per_hour']:.2f}x (target >= 1.3x); "
            f"trainer idle {100 * a['trainer_idle_frac']:.0f}% (target <= 15%); final "
            f"pass@1 {'reaches' if ok else 'misses'} {best['name']}'s"
        )


def plot(figs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for f in figs:
        rewards = [r for r in f["rewards"] if r is not None]
        ax.plot(range(1, len(rewards) + 1), rewards, label=f["name"])
        bx.plot(*zip(*f["evals"], strict=True), marker="o", label=f["name"])
    ax.set(xlabel="step", ylabel="mean reward of the step's samples", title="reward")
    bx.set(xlabel="step", ylabel="held-out pass@1 (greedy)", title="held-out pass@1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--config",
        default=CONFIG,
        help=f"the RL config of every run (default {CONFIG}; rl_addition is the CPU demo's)",
    )
    p.add_argument("--steps", type=int, default=0, help="RL steps (0: the config's)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes")
    p.add_argument(
        "--only",
        nargs="*",
        choices=RUNS,
        default=list(DEFAULT_RUNS),
        help=f"runs to do (default: {' '.join(DEFAULT_RUNS)})",
    )
    p.add_argument("--no-trl", action="store_true", help="leave TRL out")
    p.add_argument(
        "--work",
        help="keep the runs in this folder (default: a temporary one); a "
        "run whose result is there already is read, not run again",
    )
    p.add_argument("--json", help="write the figures and every run's records here")
    p.add_argument("--png", help="write the reward and pass@1 curves here")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("overrides", nargs="*", help="after --: config overrides for every run")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tidal-rl-peer-") as tmp:
        folder = Path(args.work or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        raw = collect(args, folder)
        figs, target = [], None
        for key, result in raw.items():
            if key == "trl":
                steps = result["steps"]
                samples = result["samples_per_step"]
                gen = [(r.get("response_len_mean") or 0.0) * samples for r in steps]
                fig = summarize(
                    "trl", steps, result["evals"], [r["step_s"] for r in steps], gen, target
                )
                fig["prompt_id_mismatches"] = result["prompt_id_mismatches"]
            else:
                fig = tidal_summary(result, target)
                if key == "sync":
                    target = fig["pass1_after"]
                    fig = tidal_summary(result, target)
            figs.append(fig)
        report(figs)
        if "trl" in raw:
            bad = raw["trl"]["prompt_id_mismatches"]
            print(f"TRL prompts whose ids differ from tidal's: {bad}")
        if args.png:
            plot(figs, Path(args.png))
        if args.json:
            Path(args.json).write_text(json.dumps({"figures": figs, "runs": raw}, indent=1))


_ASYNC = ["--rl.mode", "async", "--loss.tis_cap", "2.0"]
_S4 = [*_ASYNC, "--rl.max_staleness", "4"]
_MPS = ["--rl.mps", "true"]
_BI = ["--generator.batch_invariant", "true"]
RUNS = {
    "sync": ("tidal sync", ["--rl.mode", "sync"]),
    "sync_bi": ("tidal sync, batch-invariant", ["--rl.mode", "sync", *_BI]),
    "s1": ("tidal async s1", [*_ASYNC, "--rl.max_staleness", "1"]),
    "s4": ("tidal async s4", _S4),
    "s4_two": ("tidal async s4, 2 batches in flight", [*_S4, "--rl.batches_in_flight", "2"]),
    "sync_mps": ("tidal sync +MPS", ["--rl.mode", "sync", *_MPS]),
    "s4_mps": ("tidal async s4 +MPS", [*_S4, *_MPS]),
    "s4_t50": (
        "tidal async s4 +MPS, trainer 50% of SMs",
        [*_S4, *_MPS, "--trainer.sm_percent", "50"],
    ),
    "s4_t30": (
        "tidal async s4 +MPS, trainer 30% of SMs",
        [*_S4, *_MPS, "--trainer.sm_percent", "30"],
    ),
    "trl": ("trl", []),
}
"""The runs: name and the overrides of `rl_addition_135m` (TRL: its own script). Those with
`rl.mps` share the GPU through an MPS daemon (left out of `--smoke`, on the CPU). s4_two
decodes two batches at once (rl.batches_in_flight 2), the others one at a time. sync_bi is the
sync run in batch-invariant mode (generator.batch_invariant: the generator's log-probs equal
the trainer's bitwise; TIDAL_BI_TRITON=1 runs the mode's Triton kernels on CUDA)."""

DEFAULT_RUNS = ("sync", "s1", "s4", "trl")


def collect(args: argparse.Namespace, folder: Path) -> dict[str, dict]:
    """Every chosen run's raw result, run now or read from `folder`, in RUNS order."""
    common = ["--policy.cache_dir", str(folder / "cache"), *args.overrides]
    if args.steps:
        common += ["--rl.steps", str(args.steps)]
    if args.smoke:
        common += [
            "--generator.device",
            "cpu",
            "--generator.dtype",
            "fp32",
            "--job.device",
            "cpu",
            "--task.eval_problems",
            "8",
            "--metrics.plot",
            "false",
            "--rollout.prompts_per_step",
            "2",
            "--rollout.group_size",
            "4",
            "--rollout.max_new_tokens",
            "16",
            "--rl.eval_every",
            "2",
            "--policy.sft_overrides",
            "model.flavor=tiny training.steps=20",
            "--trainer.compile",
            "false",
            "--generator.compile_scope",
            "step",
        ]
        common += [] if args.steps else ["--rl.steps", "3"]
    bench = _rl_bench()
    raw: dict[str, dict] = {}
    for key, (name, extra) in RUNS.items():
        saved = folder / f"result-{key}.json"
        if saved.exists():
            raw[key] = json.loads(saved.read_text())
            continue
        on_gpu_only = _MPS[0] in extra
        if key not in args.only or (key == "trl" and args.no_trl) or (on_gpu_only and args.smoke):
            continue
        if key != "trl":
            try:
                result = tidal_run(
                    bench, name, args.config, [*extra, *common], folder / key, args.timeout
                )
            except SystemExit as e:  # one failed run: the others still run and report
                print(f"   {e}")
                continue
        elif importlib.util.find_spec("trl") is None:
            print("TRL is not installed (pip install trl): its run is left out")
            continue
        else:
            run = json.loads(export_for_trl(args.config, common, folder).read_text())
            result = trl_run(folder, args.timeout)
            if result is None:
                continue
            result["samples_per_step"] = run["prompts_per_step"] * run["group_size"]
        saved.write_text(json.dumps(result))
        raw[key] = result
    return raw


if __name__ == "__main__":
    main()
