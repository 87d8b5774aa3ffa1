"""GRPO in one process: the whole RL loop, top to bottom, over library pieces.

    python -m tidal.rl.grpo --config rl_addition [--section.field VALUE ...]

One trainer (a tidal.train Trainer) and one generator (tidal.generate.Generator, with its own copy
of the model) in this process: no store, no subprocesses. Each step runs

    task -> generate -> grade -> advantages -> loss -> optimizer step -> load weights -> log/eval

It takes the configs of `tidal rl` (tidal/rl/configs.py) and the same overrides, and it is
the same algorithm as `tidal rl` in sync mode, built by the same functions
(tidal/rl/build.py) and seeded alike: tests/rl/test_grpo.py checks that both give the same
rewards and losses step by step. `tidal rl` runs these steps as processes coupled through
the store (tidal/rl/distributed/), which adds what processes need: publishing the weights,
membership, liveness, the asynchronous schedule; this file is where to read the algorithm.

Where it departs from the GRPO paper (the defaults of tidal.rl.loss.LossConfig, whose
docstring has the why): no KL term (`loss.kl_coef` 0), the loss averaged over the step's
tokens (DAPO's token-mean) with clip-higher, and groups whose samples all got the same
reward dropped (they carry no signal). One optimizer step per batch: the PPO ratio is taken
against the generator's log-probs, so it is 1 up to the two models' rounding (exactly 1 in
batch-invariant mode).

What it writes: a line per step and per evaluation, <output_dir>/metrics.jsonl (the same
fields as `tidal rl`'s, docs/rl.md) and rl.png at the end; checkpoints when enabled, from
which a rerun resumes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from tidal.rl.build import (
    build_generator,
    build_trainer,
    check_routing_replay,
    check_task_text,
    make_policy,
    make_task,
    reference_weights,
    trainer_weights,
    warm_up_generator,
)
from tidal.rl.config import RLConfig
from tidal.rl.experience import Grader, Policy, eval_versions, evaluate, sample_batch
from tidal.rl.loss import group_advantages
from tidal.rl.report import (
    Report,
    Timer,
    check_run_folder,
    env_figures,
    eval_record,
    step_record,
)
from tidal.rl.rollout import RolloutBatch
from tidal.rl.tasks.base import Problem, Task
from tidal.rl.trainer_inputs import PolicyLoss, set_step_lr, train_on_rollout
from tidal.rl.warmstart import policy_args, prepare_policy, resolve_policy
from tidal.train.cpu_kernels import apply_cpu_kernels

Log = Callable[[str], None]

PROG = "python -m tidal.rl.grpo"
"""The command that runs this file: its lines and errors begin with it."""


def generate_and_grade(
    policy: Policy, task: Task, grader: Grader, cfg: RLConfig, step: int
) -> list[RolloutBatch]:
    """Batch `step`, sampled from the policy's current version (step - 1) and graded: each
    of the `generator.count` generators' share of the prompts, seeded as `tidal rl`'s
    generator g seeds its share (rollout.seed, step, g)."""
    return [
        sample_batch(
            policy,
            task,
            grader,
            cfg,
            seeds=(cfg.rollout.seed, step, g),
            n_prompts=cfg.prompts_of(g),
            meta={"generator": g},
        )
        for g in range(cfg.generator.count)
    ]


def load_weights(policy: Policy, trainer: Any, version: int) -> None:
    """The trainer's weights into the generator's own copy, in place: what publishing
    through the store and reading it back does across processes."""
    policy.generator.load_weights(trainer_weights(trainer), version=version)


def evaluate_policy(
    policy: Policy, grader: Grader, problems: list[Problem], cfg: RLConfig, version: int, log: Log
) -> dict[str, Any]:
    """pass@1 of greedy decoding on the held-out `problems`, as generator 0 of `tidal rl`
    scores it."""
    result = evaluate(
        policy,
        grader,
        problems,
        max_new_tokens=cfg.rollout.max_new_tokens,
        log=log,
        label=f"eval of policy version {version}",
    )
    return eval_record(version, result)


def figures(
    parts: list[RolloutBatch],
    grader: Grader,
    tokens: int,
    positions: int,
    seconds: dict[str, float],
) -> dict[str, Any]:
    """A step's figures besides the algorithm's, as `tidal rl` reports them: samples per
    generator, grader errors, speeds and the time of each part (`seconds`; in one process
    one copy of the weights is both roles' sync time)."""
    out: dict[str, Any] = {
        "samples_per_generator": [p.num_samples for p in parts],
        "grader_errors": sum(p.meta["grader_errors"] for p in parts),
        "tokens_per_s_gen": sum(p.meta["gen_tokens"] for p in parts) / max(seconds["gen_s"], 1e-9),
        "tokens_per_s_train": tokens / max(seconds["train_s"], 1e-9) if tokens else 0.0,
        "train_pad_frac": 1.0 - tokens / positions if positions else 0.0,
        "sync_trainer_s": seconds["sync_s"],
        "sync_generator_s": seconds["sync_s"],
        "gen_s": seconds["gen_s"],
        "train_s": seconds["train_s"],
        **env_figures(parts),
    }
    if out["grader_errors"]:
        out["grader_error"] = grader.first_error
    return out


def train(cfg: RLConfig, trainer: Any, policy: Policy, task: Task, *, log: Log) -> dict[str, Any]:
    """Steps trainer.step + 1 .. rl.steps (a resumed run starts past its checkpoint), then
    the summary; returns the summary's numbers."""
    first, steps = trainer.step, cfg.rl.steps
    evals = [v for v in eval_versions(steps, cfg.rl.eval_every) if v >= first]
    # With a correction the PPO ratio is taken against the trainer's own policy at the
    # step's start (this step's forward, detached): one optimizer step per batch.
    loss = PolicyLoss(cfg.loss, old_is_current=cfg.loss.corrects)
    reference = reference_weights(trainer, cfg)
    grader, timer = Grader(task), Timer()
    held_out = task.eval_set(cfg.task.eval_problems, seed=cfg.task.eval_seed)
    report = Report(cfg, first_step=first, resumed=first > 0, log=log)
    profiler = trainer.profiler  # --profiler.enable: one trace of both roles' steps
    try:
        profiler.start(first + 1)
        start = time.perf_counter()
        with timer("sync_s"):
            load_weights(policy, trainer, first)
        for step in range(first + 1, steps + 1):
            profiler.step_begin(step)
            if step - 1 in evals:
                report.log(evaluate_policy(policy, grader, held_out, cfg, step - 1, log))
            with timer("gen_s"):  # task -> generate -> grade
                parts = generate_and_grade(policy, task, grader, cfg, step)
            rollout = RolloutBatch.concat(parts)
            adv = group_advantages(rollout.rewards, rollout.group_ids, cfg.loss)
            lr = set_step_lr(trainer, cfg, step)
            with timer("train_s"):  # loss -> optimizer step
                metrics, tokens, positions = train_on_rollout(
                    trainer,
                    rollout,
                    adv,
                    loss,
                    micro_batch_size=cfg.trainer.micro_batch_size,
                    reference=reference,
                )
            trainer.step = step
            with timer("sync_s"):  # the new version into the generator
                load_weights(policy, trainer, step)
            trainer.checkpoint.maybe_save(step, steps)
            seconds = timer.take("gen_s", "train_s", "sync_s")
            record = step_record(cfg, step, rollout, adv, metrics)
            record |= figures(parts, grader, tokens, positions, seconds)
            report.log(record | {"lr": lr, "elapsed_s": time.perf_counter() - start})
            profiler.step_done(step)
        if steps in evals:
            report.log(evaluate_policy(policy, grader, held_out, cfg, steps, log))
        trainer.checkpoint.finish()
        return report.finish()
    finally:
        profiler.stop()
        report.close()


def check_one_process(cfg: RLConfig) -> None:
    """What this loop runs: the synchronous schedule, generators of one rank.

    Raises:
        ValueError: naming the field to change (or `tidal rl`, which runs it)."""
    if cfg.rl.mode != "sync":
        raise ValueError(
            f"rl.mode={cfg.rl.mode}: grpo.py runs the synchronous loop; the asynchronous one "
            "needs processes (tidal rl --rl.mode async)"
        )
    degrees = {cfg.generator.tp_of(i) for i in range(cfg.generator.count)}
    if degrees != {1}:
        raise ValueError(
            f"generator.tp={cfg.generator.tp}: grpo.py runs its generator on one rank; "
            "tensor-parallel generators run under tidal rl"
        )


def run(cfg: RLConfig, *, log: Log = print) -> dict[str, Any]:
    """The whole run: the warm start (trained once and cached, if the policy needs one), the
    trainer and the generator, then `train`. Returns the summary's numbers.

    Raises:
        ValueError, FileNotFoundError: bad input (the message names the field)."""
    check_one_process(cfg)
    if check_run_folder(cfg, prog=PROG, log=log):  # finished: its figures printed, no run
        return {}
    task = make_task(cfg)
    check_routing_replay(cfg, policy_args(cfg, log=log))
    prepare_policy(cfg, log=log)
    src = resolve_policy(cfg, log=log)
    check_task_text(cfg, src, task)
    trainer = build_trainer(cfg, src, log=log)
    try:
        generator = build_generator(cfg, src)
        warm_up_generator(generator, cfg, 0, log=log)
        log(
            f"grpo: {src.describe}; steps {trainer.step + 1}..{cfg.rl.steps}, "
            f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} samples a step, "
            f"trainer on {trainer.device}, generator on {generator.device}"
        )
        return train(cfg, trainer, make_policy(cfg, src, generator), task, log=log)
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m tidal.rl.grpo --config NAME [--print-config] [--section.field VALUE ...]`:
    the configs and overrides of `tidal rl`. Bad input prints one line and exits with 2."""
    from tidal.rl.configs import RL_CONFIGS, get_rl_config
    from tidal.train.config_parse import apply_overrides, help_text, to_json

    parser = argparse.ArgumentParser(
        prog=PROG,
        add_help=False,
        description="GRPO in one process (the algorithm of `tidal rl`, sync mode).",
    )
    parser.add_argument(
        "--config", default="rl_addition", help=f"one of {sorted(RL_CONFIGS)}, or MODULE:FUNCTION"
    )
    parser.add_argument("--print-config", action="store_true", help="print the config and exit")
    parser.add_argument("-h", "--help", action="store_true", help="list every config field")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        if ":" in args.config and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        if os.environ.get("TIDAL_CACHE_DIR"):  # as `tidal rl`: the default of policy.cache_dir
            overrides = ["--policy.cache_dir", os.environ["TIDAL_CACHE_DIR"], *overrides]
        cfg = apply_overrides(get_rl_config(args.config), overrides)
        if args.help or args.print_config:
            print(help_text(cfg, args.config) if args.help else to_json(cfg))
            return 0
        apply_cpu_kernels(cfg.job)
        run(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
