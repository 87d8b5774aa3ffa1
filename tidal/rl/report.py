"""What the user of an RL run sees: a line per step and per evaluation, metrics.jsonl,
TensorBoard when enabled, and at the end rl.png with a summary line.

Lifecycle: the trainer's rank 0 makes one `Report`, passes `report.log` to the loop (one
record per step, one per evaluation), and calls `finish()` then `close()`.

Before any role starts, `tidal rl` (and `python -m tidal.rl.grpo`) reads the run folder
(`check_run_folder`): a finished run there is reported from its metrics.jsonl (nothing runs,
nothing is overwritten), and a resume to a step the run already reached is refused with one
line.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from statistics import fmean
from typing import Any

from tidal.models.profiling import span
from tidal.rl.config import RLConfig
from tidal.rl.loss import Advantages
from tidal.rl.rollout import RolloutBatch
from tidal.train.metrics import MetricsLogger

Log = Callable[[str], None]

STEP_FIELDS = (
    "step",
    "reward_mean",
    "reward_std",
    "response_len_mean",
    "entropy",
    "clip_frac",
    "groups_dropped",
    "samples",
    "samples_per_generator",
    "tokens_per_s_gen",
    "tokens_per_s_train",
    "train_pad_frac",
    "sync_trainer_s",
    "sync_generator_s",
)
"""Fields of every step record (and "kl" when loss.kl_coef > 0, "tis_weight_mean" and
"tis_capped_frac" with loss.tis_cap)."""
ASYNC_FIELDS = (
    "staleness_hist",
    "stale_samples_dropped",
    "stale_dropped_frac",
    "stale_samples_dropped_total",
    "version_min",
    "version_max",
    "samples_trained",
    "trainer_idle_frac",
    "generator_idle_frac",
    "weight_swaps_in_flight",
    "prefetch_hit_rate",
    "prefetch_needed",
    "batches_overlapped",
)
"""Fields a step record of async mode adds (with the loss's correction figures:
"tis_weight_mean" and "tis_capped_frac", or "is_masked_frac")."""


class Report:
    def __init__(self, cfg: RLConfig, *, first_step: int, resumed: bool, log: Log = print) -> None:
        self.cfg, self.log_line = cfg, log
        self.dir = Path(cfg.job.output_dir)
        self.logger = MetricsLogger(
            self.dir,
            tensorboard=cfg.metrics.tensorboard,
            resume_step=first_step if resumed else None,
            stream=_LineSink(log),
        )
        self.steps: list[dict[str, Any]] = []
        """This process's step records (the summary reads the whole run's from the file)."""
        self.grader_errors = 0

    def log(self, record: dict[str, Any]) -> None:
        """Write one record (a step's or an evaluation's) and print its line."""
        if "eval_pass1" in record:
            line = (
                f"eval  step {record['step']:>4}: pass@1 {100 * record['eval_pass1']:5.1f}% "
                f"({record['eval_correct']}/{record['eval_total']} held-out, greedy, "
                f"{record['eval_s']:.0f}s)"
            )
        else:
            self.steps.append(record)
            self.grader_errors += record.get("grader_errors", 0)
            steps = self.cfg.rl.steps
            kl = f" kl {record['kl']:.4f}" if record.get("kl") is not None else ""
            # Dynamic sampling (loss.drop_equal_groups): a group whose samples all got the
            # same reward has zero advantages, so it is not trained on.
            dropped = (
                f"dropped {record['groups_dropped']}/{record['groups']} groups (all-same reward) "
                if self.cfg.loss.drop_equal_groups
                else ""
            )
            line = (
                f"step {record['step']:>4}/{steps} reward {record['reward_mean']:.3f} "
                f"(std {record['reward_std']:.3f}) len {record['response_len_mean']:.0f} "
                f"entropy {_num(record['entropy'])}{kl} clip {_num(record['clip_frac'])} "
                f"{dropped}gen {record['tokens_per_s_gen']:,.0f} tok/s train "
                f"{record['tokens_per_s_train']:,.0f} tok/s sync "
                f"{1000 * record['sync_trainer_s']:.0f}/{1000 * record['sync_generator_s']:.0f}ms"
            )
            if "staleness_hist" in record:
                hit = record["prefetch_hit_rate"]
                line += (
                    f" | stale dropped {record['stale_samples_dropped']} lag "
                    f"{record['staleness_hist']} idle {record['trainer_idle_frac']:.2f}/"
                    f"{record['generator_idle_frac']:.2f} prefetch hit "
                    f"{'-' if hit is None else f'{hit:.2f}'}"
                )
            if record.get("grader_errors"):
                line += (
                    f" | grader raised {record['grader_errors']}x: {record.get('grader_error', '')}"
                )
        self.logger.log(record, line)
        if len(self.steps) == 1 and "eval_pass1" not in record:
            self.log_line(first_step_line(record, self.cfg.rl.steps))

    def finish(self) -> dict[str, Any]:
        """The summary line and rl.png, both of the whole run as metrics.jsonl holds it
        (`run_records`): a run that resumed an earlier one past its end (a larger rl.steps)
        plots and sums up the earlier steps too. Returns the summary's numbers."""
        steps, evals = run_records(self.dir)
        summary = summarize(steps, evals)
        text = summary_line(summary)
        if self.cfg.metrics.plot:
            path = self.dir / "rl.png"
            title = f"{self.cfg.job.name}: " + text.replace("; ", "\n")
            plot(steps, evals, path, title=title)
            summary["plot"] = str(path)
        self.log_line(text)
        if "plot" in summary:
            self.log_line(f"plot: {summary['plot']}")
        self.log_line(f"metrics: {self.dir / 'metrics.jsonl'}")
        if self.grader_errors:
            self.log_line(
                f"the grader raised {self.grader_errors} time(s); those samples got "
                "reward 0 (the first error is in metrics.jsonl)"
            )
        return summary

    def close(self) -> None:
        self.logger.close()


def first_step_line(record: dict[str, Any], steps: int) -> str:
    """How long this run's first step took (from the loop's start: the first publish, the
    rollouts, the update) and the time the steps left would take at that pace."""
    seconds, left = record["elapsed_s"], steps - record["step"]
    line = (
        f"step {record['step']} took {seconds:.1f}s (generation {record['gen_s']:.1f}s, "
        f"training {record['train_s']:.1f}s)"
    )
    if left > 0:
        rest = seconds * left
        pace = f"{rest / 60:.0f} min" if rest >= 120 else f"{rest:.0f}s"
        line += f"; the {left} steps left: about {pace} at that pace, evaluations apart"
    return line


def summarize(steps: list[dict[str, Any]], evals: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's numbers from a run's step records and its evaluation records (in step
    order): pass@1 at the first and last evaluation, the reward at both ends, the time."""
    summary: dict[str, Any] = {
        "steps": len(steps),
        "grader_errors": sum(r.get("grader_errors", 0) for r in steps),
    }
    if evals:
        first, last = evals[0], evals[-1]
        summary.update(
            pass1_before=first["eval_pass1"],
            pass1_after=last["eval_pass1"],
            version_before=first["step"],
            version_after=last["step"],
        )
    if steps:
        # A step's reward is noisy (16 prompts): the ends are means over up to 10 steps.
        k = max(1, min(10, len(steps) // 2))
        summary["reward_window"] = k
        summary["reward_first"] = fmean(r["reward_mean"] for r in steps[:k])
        summary["reward_last"] = fmean(r["reward_mean"] for r in steps[-k:])
        summary["elapsed_s"] = steps[-1]["elapsed_s"]
    return summary


def check_run_folder(cfg: RLConfig, *, prog: str, log: Log = print) -> bool:
    """What `job.output_dir` allows this run, decided before any role starts, from the folder
    alone: its newest complete policy checkpoint is the step a run there resumes from. Returns
    True for a run already finished there (step rl.steps reached): its figures are printed from
    its metrics.jsonl, after a first line beginning with `prog` (the command that was run:
    "tidal rl", "python -m tidal.rl.grpo"), and nothing runs or is overwritten. False: this
    run starts, fresh or resuming.

    Raises:
        ValueError: the folder is a file, cannot be created or is in use by another run; it
            holds an earlier run that this one cannot resume (no checkpoints); or its run
            already passed rl.steps (a resume goes on to a later step only).
    """
    from tidal.train.checkpoint.layout import scan
    from tidal.train.checkpoint.plan import checkpoint_folder
    from tidal.train.config import CheckpointConfig
    from tidal.train.run_folder import RunLock, check_fresh, check_output_dir

    out = check_output_dir(cfg.job.output_dir)
    RunLock(out).release()  # another run still writing here: RunFolderError, naming it
    reached = None
    if cfg.checkpoint.enable:
        # The trainer's own checkpoint folder (trainer_config keeps the default folder).
        done = scan(checkpoint_folder(CheckpointConfig(), out)).complete
        reached = max(done, default=None)
    check_fresh(out, resuming=reached is not None, checkpointing=cfg.checkpoint.enable)
    if reached is None or reached < cfg.rl.steps:
        return False
    if reached > cfg.rl.steps:
        check_resume_step(cfg, reached)  # raises, naming both steps
    steps, evals = run_records(out)
    log(
        f"{prog}: the run in {out} is finished (step {reached} of rl.steps={cfg.rl.steps}); "
        "nothing to run, nothing overwritten. Its figures:"
    )
    log(summary_line(summarize(steps, evals)))
    if (out / "rl.png").is_file():
        log(f"plot: {out / 'rl.png'}")
    log(f"metrics: {out / 'metrics.jsonl'}")
    log(
        f"to train it further, give --rl.steps above {reached}; for a new run, another "
        "--job.output_dir"
    )
    return True


def run_records(output_dir: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The step records and the evaluation records (one per version, the last written; in
    step order) of the run in `output_dir`, from its metrics.jsonl as the run stands: the
    steps an earlier run wrote and a resume did not redo are in, the redone ones only once
    (tidal.train.run_folder.read_records). ([], []) without a metrics.jsonl."""
    from tidal.train.run_folder import read_records

    records = read_records(output_dir)
    evals = {r["step"]: r for r in records if "eval_pass1" in r}
    return [r for r in records if "reward_mean" in r], [r for _, r in sorted(evals.items())]


def check_resume_step(cfg: RLConfig, reached: int) -> None:
    """A run that resumes at step `reached` must have steps left to run.

    Raises:
        ValueError: `reached` is rl.steps (the run is finished) or past it."""
    where = f"job.output_dir {cfg.job.output_dir} holds a run at step {reached}"
    if reached > cfg.rl.steps:
        raise ValueError(
            f"{where}, past rl.steps={cfg.rl.steps}: a resume goes on to a later step; give "
            f"--rl.steps above {reached} to continue it, or another --job.output_dir"
        )
    if reached == cfg.rl.steps:
        raise ValueError(
            f"{where}, its last (rl.steps={cfg.rl.steps}): the run is finished; give "
            f"--rl.steps above {reached} to continue it, or another --job.output_dir"
        )


def summary_line(s: dict[str, Any]) -> str:
    parts = []
    if "pass1_before" in s:
        d = 100 * (s["pass1_after"] - s["pass1_before"])
        parts.append(
            f"held-out pass@1 {100 * s['pass1_before']:.1f}% (version "
            f"{s['version_before']}) -> {100 * s['pass1_after']:.1f}% (version "
            f"{s['version_after']}), {d:+.1f} points"
        )
    if "reward_first" in s:
        k, n = s.get("reward_window", 1), s["steps"]
        ends = f" (means of steps 1-{k} and {n - k + 1}-{n})" if k > 1 else ""
        parts.append(
            f"reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}{ends} over "
            f"{n} steps in {s['elapsed_s']:.0f}s"
        )
    return "; ".join(parts) or "no steps run"


def plot(steps: list[dict], evals: list[dict], path: Path, *, title: str = "") -> None:
    """reward_mean and eval_pass1 against step, in one PNG; for an environment with tools
    (records with `tool_calls_mean`), tool calls per trajectory too, on a right-hand axis:
    the training samples' per step and the held-out greedy ones' at each eval.

    Raises:
        ImportError: matplotlib is missing (pip install 'tidal[plot]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "metrics.plot=true needs matplotlib: pip install 'tidal[plot]' (or "
            "--metrics.plot false)"
        ) from e
    fig, ax = plt.subplots(figsize=(7, 4))
    x, reward = [r["step"] for r in steps], [r["reward_mean"] for r in steps]
    ax.plot(x, reward, label="reward (mean of the step)", color="tab:blue", alpha=0.35)
    if len(steps) >= 5:
        k = 5
        smooth = [fmean(reward[max(0, i - k + 1) : i + 1]) for i in range(len(reward))]
        ax.plot(x, smooth, label=f"reward ({k}-step running mean)", color="tab:blue")
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval_pass1"] for r in evals],
            "o-",
            label="held-out pass@1 (greedy)",
            color="tab:orange",
        )
    ax.set_xlabel("step (policy version)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    calls = [(r["step"], r["tool_calls_mean"]) for r in steps if "tool_calls_mean" in r]
    if calls and any(n for _, n in calls):
        right = ax.twinx()
        right.plot(*zip(*calls, strict=True), label="tool calls / trajectory", color="tab:green")
        held = [
            (r["step"], r["eval_tool_calls_mean"]) for r in evals if "eval_tool_calls_mean" in r
        ]
        if held:
            right.plot(
                *zip(*held, strict=True),
                "s--",
                label="tool calls / trajectory (held-out)",
                color="tab:green",
            )
        top = max(n for _, n in [*calls, *held])
        right.set_ylim(-0.02 * top, 1.02 * max(top, 1.0))
        right.set_ylabel("tool calls per trajectory")
        more_h, more_l = right.get_legend_handles_labels()
        handles, labels = handles + more_h, labels + more_l
    ax.legend(handles, labels, loc="lower right", fontsize=8)
    if title:
        ax.set_title(title, fontsize=8, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _num(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


class _LineSink:
    """A text stream that hands whole lines to a log function (MetricsLogger prints to a
    stream)."""

    def __init__(self, log: Log) -> None:
        self._log = log

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line:
                self._log(line)
        return len(text)

    def flush(self) -> None:
        pass


CORRECTION_METRICS = ("tis_weight_mean", "tis_capped_frac", "is_masked_frac")
"""The loss's per-token correction figures, in a step's record when the correction is on."""


def step_record(
    cfg: RLConfig,
    step: int,
    rollout: RolloutBatch,
    adv: Advantages | None,
    metrics: dict[str, float],
) -> dict[str, Any]:
    """The algorithm's figures of step `step` (docs/rl.md, "What the user sees"): the
    rollout's rewards, lengths and rates, the loss's metrics (`metrics`: {} when nothing was
    trained) and the groups kept by dynamic sampling (`adv`: None when none was)."""
    lens = rollout.completion_mask.sum(1).float()
    return {
        "step": step,
        "reward_mean": float(rollout.rewards.mean()),
        "reward_std": float(rollout.rewards.std()) if rollout.num_samples > 1 else 0.0,
        "response_len_mean": float(lens.mean()),
        "entropy": metrics.get("entropy"),
        **({"kl": metrics.get("kl")} if cfg.loss.kl_coef > 0 else {}),
        "clip_frac": metrics.get("clip_frac"),
        "ratio_max": metrics.get("ratio_max"),
        "ratio_min": metrics.get("ratio_min"),
        "ratio_mean": metrics.get("ratio_mean"),
        **{k: v for k, v in metrics.items() if k in CORRECTION_METRICS},
        "logprob_diff_max": metrics.get("logprob_diff_max"),
        "logprob_diff_mean": metrics.get("logprob_diff_mean"),
        **{k: v for k, v in metrics.items() if k.startswith("moe_")},  # MoE policies
        "loss": metrics.get("loss"),
        "groups_dropped": adv.dropped_groups if adv is not None else 0,
        "groups": adv.groups if adv is not None else 0,
        "samples": rollout.num_samples,
        "format_ok_rate": float(rollout.format_ok.float().mean()),
        "truncated_rate": float(rollout.truncated.float().mean()),
        # multi-turn trajectories: the sampled (trained) tokens; the rest are observations
        **(
            {"sampled_len_mean": float(rollout.loss_mask.sum(1).float().mean())}
            if rollout.loss_mask is not None
            else {}
        ),
    }


def eval_record(version: int, result: dict[str, Any]) -> dict[str, Any]:
    """The record of an evaluation (`tidal.rl.experience.evaluate`'s result) of `version`;
    an environment's (`evaluate_env`) adds its turns and tool calls per trajectory."""
    return {
        "step": version,
        "eval_pass1": result["pass1"],
        "eval_correct": result["correct"],
        "eval_total": result["total"],
        "eval_s": result["seconds"],
        **{f"eval_{k}": result[k] for k in ("turns_mean", "tool_calls_mean") if k in result},
    }


def env_figures(parts: list[RolloutBatch]) -> dict[str, Any]:
    """A step's environment figures (tidal/rl/envs: the driver's counts in each batch's meta),
    {} for tasks: turns and tool calls per trajectory, tool errors and trajectories cut by
    the context (sums), and `retokenized` when an environment counts it."""
    if not parts or not all("turns" in p.meta for p in parts):
        return {}
    n = max(sum(p.num_samples for p in parts), 1)
    return {
        "turns_mean": sum(p.meta["turns"] for p in parts) / n,
        "tool_calls_mean": sum(p.meta["tool_calls"] for p in parts) / n,
        "tool_errors": sum(p.meta["tool_errors"] for p in parts),
        "context_truncated": sum(p.meta["context_truncated"] for p in parts),
        # an environment played from outside (tidal/rl/envs/verifiers.py): turns cut where
        # the next prompt did not extend the sampled ids
        **(
            {"retokenized": sum(p.meta.get("retokenized", 0) for p in parts)}
            if any("retokenized" in p.meta for p in parts)
            else {}
        ),
    }


SPANS = {
    "trainer_idle_s": "rl/wait_rollouts",
    "train_s": "rl/train_step",
    "sync_trainer_s": "rl/publish_weights",
    "idle_s": "rl/wait",
    "sync_s": "rl/load_weights",
    "gen_s": "rl/generate",
    "eval_s": "rl/eval",
}
"""The profiler range of each `Timer` name (`span`: tidal/models/profiling.py); a name not
listed gets rl/<name>. The waits' ranges start with rl/wait (benchmarks/rl_timeline.py counts
them as idle)."""


class Timer:
    """Named durations, summed until taken: `with timer("train_s"): ...` adds the block's
    wall time to "train_s"; `timer.take()` returns the sums (0.0 for a name not timed since)
    and starts over. While a profiler records, each block is a range in its trace too
    (`SPANS`).

    Example::

        timer = Timer()
        with timer("gen_s"):
            groups = generator.generate(prompts, params)
        record |= timer.take("gen_s", "train_s")
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with span(SPANS.get(name) or f"rl/{name.removesuffix('_s')}"):
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def take(self, *names: str) -> dict[str, float]:
        """The sums of `names` (in that order), which start over from 0."""
        return {name: self.seconds.pop(name, 0.0) for name in names}
