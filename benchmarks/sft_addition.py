"""SFT from scratch on generated addition: training time and held-out exact-match accuracy.

Trains the `sft_addition` config (the debug model, 5M parameters, on 1-4 digit addition with
worked carries; see docs/sft.md), then decodes greedily on `--problems` validation problems,
which no training sample shares, and counts the final answers (`#### N`) that are right.
Baseline: the same model before training (it gets none right). Prints the time of the data
set-up and of training, the accuracy by the longer operand's digit count, and a few answers.

    python benchmarks/sft_addition.py                       # about 4 min on an idle 2-core CPU
    python benchmarks/sft_addition.py --set training.steps=600 --set optimizer.state_dtype=bf16
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict


def accuracy_by_digits(problems, completions) -> dict[int, tuple[int, int]]:
    from tidal.train.data.arithmetic import parse_answer

    by: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for p, c in zip(problems, completions, strict=True):
        k = max(len(str(p.a)), len(str(p.b)))
        by[k][0] += parse_answer(c) == p.answer
        by[k][1] += 1
    return {k: (v[0], v[1]) for k, v in sorted(by.items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="sft_addition")
    p.add_argument("--problems", type=int, default=500, help="held-out problems to score")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    from tidal.train.config_parse import apply_overrides
    from tidal.train.configs import get_config
    from tidal.train.data import arithmetic
    from tidal.train.evaluate import exact_match
    from tidal.train.trainer import Trainer

    extra = [x for kv in args.set for x in ("--" + kv.split("=", 1)[0], kv.split("=", 1)[1])]
    cfg = apply_overrides(get_config(args.config), extra)
    assert cfg.data.dataset == "arithmetic", "the config must train on dataset=arithmetic"
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    setup_s = time.perf_counter() - t0
    assert trainer.data.chat is not None
    problems = arithmetic.generate(cfg.data.path, args.problems, split="val", seed=1234)
    before = exact_match(trainer.model, trainer.data.chat, problems[:50], max_new_tokens=64)
    trainer.model.train()
    t1 = time.perf_counter()
    last = trainer.train()
    train_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    after = exact_match(trainer.model, trainer.data.chat, problems)
    eval_s = time.perf_counter() - t2
    by = accuracy_by_digits(problems, after.completions)

    print(f"config {args.config} {' '.join(extra)}")
    print(
        f"data and model set-up {setup_s:.0f}s, training {train_s:.0f}s "
        f"({cfg.training.steps} steps, {last.get('tokens_per_s', 0):,.0f} tokens/s at the "
        f"end), evaluation {eval_s:.0f}s"
    )
    print(
        f"held-out exact match: untrained {100 * before.accuracy:.1f}% (of {before.total}), "
        f"trained {100 * after.accuracy:.1f}% ({after.correct}/{after.total})"
    )
    print("by digits: " + ", ".join(f"{k}: {c}/{n}" for k, (c, n) in by.items()))
    for prob, text in list(zip(problems, after.completions, strict=True))[:3]:
        print(f"--- {prob.prompt} (answer {prob.answer})\n{text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "setup_s": setup_s,
                    "train_s": train_s,
                    "eval_s": eval_s,
                    "accuracy": after.accuracy,
                    "untrained_accuracy": before.accuracy,
                    "by_digits": by,
                    "last": last,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
