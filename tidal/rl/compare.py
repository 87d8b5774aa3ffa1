"""Side by side, from their metrics.jsonl: RL runs' mode, steps/minute and held-out pass@1.

    python -m tidal.rl.compare outputs/rl_addition outputs/rl_addition_async

`make demo-async` ends with it: the demo's sync run against the same config in async mode.
Steps/minute counts the loop from its start to the last step (evaluations included, as the
run's own summary line does), so two runs of one config compare as they ran.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def run_figures(folder: str | Path) -> dict[str, Any]:
    """One run's figures: mode, steps, steps/minute, pass@1 at its first and last evaluation.

    Raises:
        FileNotFoundError: the folder has no metrics.jsonl.
        ValueError: it holds no RL step.
    """
    path = Path(folder) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: give the output_dir of a `tidal rl` run")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "reward_mean" in r]
    evals = sorted((r for r in records if "eval_pass1" in r), key=lambda r: r["step"])
    if not steps:
        raise ValueError(f"{path} holds no RL step")
    # Only the asynchronous loop reports the samples it dropped for staleness.
    mode = "async" if "stale_samples_dropped" in steps[-1] else "sync"
    minutes = steps[-1]["elapsed_s"] / 60
    return {
        "folder": str(folder),
        "mode": mode,
        "steps": len(steps),
        "steps_per_min": len(steps) / max(minutes, 1e-9),
        "pass1_before": evals[0]["eval_pass1"] if evals else None,
        "pass1_after": evals[-1]["eval_pass1"] if evals else None,
    }


def table(runs: list[dict[str, Any]]) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    lines = [f"{'run':<34}{'mode':<7}{'steps':>6}{'steps/min':>11}  held-out pass@1"]
    for r in runs:
        lines.append(
            f"{r['folder']:<34}{r['mode']:<7}{r['steps']:>6}{r['steps_per_min']:>11.2f}"
            f"  {pct(r['pass1_before'])} -> {pct(r['pass1_after'])}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tidal.rl.compare", description=__doc__.splitlines()[0]
    )
    p.add_argument("folders", nargs="+", help="output_dir of each run")
    args = p.parse_args(argv)
    try:
        print(table([run_figures(f) for f in args.folders]))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
