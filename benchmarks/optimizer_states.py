"""bf16 optimizer states against fp32 ones: memory and loss on the same run.

Trains the same config twice from the same seed, with `optimizer.state_dtype=fp32` (the
baseline, torch's AdamW) and `bf16` (tidal's AdamWBF16States), and prints for each the bytes
of optimizer state, the bytes of parameters + gradients + optimizer state, the loss every
`--every` steps and the final validation loss, then the ratios bf16 / fp32 and the largest
loss difference (and, on arithmetic data, the held-out exact match of both). Default: the
`sft_addition` config (the debug model on generated addition), on CPU.

    python benchmarks/optimizer_states.py                       # sft_addition, its 300 steps
    python benchmarks/optimizer_states.py --config debug --steps 60 --set training.batch_size=8

The memory figures are exact tensor bytes (8 bytes per parameter of fp32 moments, 4 of bf16),
not process RSS, which on CPU moves by more than the saving for a model this small.
"""

from __future__ import annotations

import argparse
import json
import math


def run(config: str, state_dtype: str, steps: int, every: int, extra: list[str]) -> dict:
    import torch

    from tidal.train.config_parse import apply_overrides
    from tidal.train.configs import get_config
    from tidal.train.optim import optimizer_state_bytes, set_lr, wsd_multiplier
    from tidal.train.trainer import Trainer

    cfg = apply_overrides(
        get_config(config),
        [
            "--optimizer.state_dtype",
            state_dtype,
            "--training.steps",
            str(steps),
            "--metrics.val_every",
            str(steps),
            "--sample.max_new_tokens",
            "0",
            "--job.output_dir",
            f"outputs/bench_optimizer_states_{state_dtype}",
            *extra,
        ],
    )
    trainer = Trainer(cfg, log=lambda *a: None)
    losses = []
    for _ in range(steps):
        trainer.step += 1
        set_lr(
            trainer.optimizer,
            cfg.optimizer.lr * wsd_multiplier(trainer.step, steps, cfg.lr_scheduler),
        )
        batches, n_tokens, _ = trainer.next_batches()
        losses.append(float(trainer.train_step(batches, n_tokens).loss))
    params = sum(p.numel() * p.element_size() for p in trainer.params)
    state = optimizer_state_bytes(trainer.optimizer)
    moments = {
        str(v.dtype)
        for s in trainer.optimizer.state.values()
        for k, v in s.items()
        if k != "step" and isinstance(v, torch.Tensor)
    }
    accuracy = None
    if cfg.data.dataset == "arithmetic" and trainer.data.chat is not None:
        from tidal.train.data.arithmetic import generate
        from tidal.train.evaluate import exact_match

        problems = generate(cfg.data.path, 300, split="val", seed=1234)
        accuracy = exact_match(trainer.model, trainer.data.chat, problems).accuracy
    return {
        "state_dtype": state_dtype,
        "accuracy": accuracy,
        "moment_dtypes": sorted(moments),
        "n_params": sum(p.numel() for p in trainer.params),
        "optimizer_state_bytes": state,
        "training_state_bytes": 2 * params + state,  # parameters, gradients, optimizer state
        "losses": losses,
        "val_loss": trainer.validate(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="sft_addition")
    p.add_argument("--steps", type=int, default=0, help="0: the config's training.steps")
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    extra = [x for kv in args.set for x in ("--" + kv.split("=", 1)[0], kv.split("=", 1)[1])]
    if not args.steps:
        from tidal.train.configs import get_config

        args.steps = get_config(args.config).training.steps
    base = run(args.config, "fp32", args.steps, args.every, extra)
    mine = run(args.config, "bf16", args.steps, args.every, extra)
    mib = 2**20
    print(f"config {args.config}, {args.steps} steps, {base['n_params']:,} parameters")
    print(f"{'':28s} {'fp32 states':>14s} {'bf16 states':>14s} {'ratio':>7s}")
    for key in ("optimizer_state_bytes", "training_state_bytes"):
        a, b = base[key], mine[key]
        print(f"{key + ' (MiB)':28s} {a / mib:14.2f} {b / mib:14.2f} {b / a:7.3f}")
    print(
        f"{'moment dtypes':28s} {','.join(base['moment_dtypes']):>14s} "
        f"{','.join(mine['moment_dtypes']):>14s}"
    )
    for i in range(args.every - 1, args.steps, args.every):
        a, b = base["losses"][i], mine["losses"][i]
        print(f"{f'loss at step {i + 1}':28s} {a:14.4f} {b:14.4f} {b / a:7.3f}")
    if base["val_loss"] is not None and mine["val_loss"] is not None:
        a, b = base["val_loss"], mine["val_loss"]
        print(f"{'val loss at the end':28s} {a:14.4f} {b:14.4f} {b / a:7.3f}")
    if base["accuracy"] is not None:
        a, b = base["accuracy"], mine["accuracy"]
        print(f"{'held-out exact match':28s} {100 * a:13.1f}% {100 * b:13.1f}%")
    worst = max(
        abs(b - a) / a for a, b in zip(base["losses"], mine["losses"], strict=True) if a > 0
    )
    print(f"largest relative loss difference over all steps: {100 * worst:.2f}%")
    assert all(math.isfinite(x) for x in mine["losses"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fp32": base, "bf16": mine}, f, indent=2)


if __name__ == "__main__":
    main()
