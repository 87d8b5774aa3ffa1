"""RL configs and a task for the loop tests, loaded by every role process as
`--config tests/rl/loop_configs.py:NAME` (importing this file registers the task there too).

`digits`: any prompt; the reward is the share of digit characters among the first
`MAX_NEW` characters of the completion. A seed-initialized tiny model starts near the
vocabulary's share of digit tokens, and a few GRPO steps raise it: an easily learned reward."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tidal.rl.config import (
    GeneratorRoleConfig,
    LoopConfig,
    PolicyConfig,
    RLCheckpointConfig,
    RLConfig,
    RolloutConfig,
    TaskConfig,
    TrainerConfig,
)
from tidal.rl.loss import LossConfig
from tidal.rl.tasks.base import Grade, Problem, Task, register
from tidal.train.config import JobConfig, ModelConfig, OptimizerConfig, SchedulerConfig

MAX_NEW = 8


@register("digits")
@dataclass(kw_only=True)
class Digits(Task):
    raises: bool = False
    """The grader raises on every third call (the bad-grader test)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._calls = 0

    def problem(self, rng: random.Random) -> Problem:
        a, b = rng.randrange(1000), rng.randrange(1000)
        return Problem(f"What is {a} + {b}?", str(a + b))

    def grade(self, completion: str, reference: Any) -> Grade:
        self._calls += 1
        if self.raises and self._calls % 3 == 0:
            raise RuntimeError("grader bug on purpose")
        text = completion[: 4 * MAX_NEW]
        share = sum(c.isdigit() for c in text) / max(len(text), 1)
        return Grade(reward=share, answer=None, format_ok=True)


def tiny(out: str = "outputs/rl_test") -> RLConfig:
    return RLConfig(
        job=JobConfig(name="rl_test", output_dir=out, device="cpu"),
        policy=PolicyConfig(init="seed", tokenizer="sft:sft_addition"),
        model=ModelConfig(flavor="tiny", vocab_size=512),
        task=TaskConfig(name="digits", eval_problems=8),
        rollout=RolloutConfig(
            prompts_per_step=4, group_size=8, max_new_tokens=MAX_NEW, max_prompt_tokens=32
        ),  # fmt: skip
        loss=LossConfig(drop_equal_groups=False),
        optimizer=OptimizerConfig(lr=3e-2, weight_decay=0.0),
        lr_scheduler=SchedulerConfig(warmup_steps=0, decay_fraction=0.0),
        trainer=TrainerConfig(micro_batch_size=16, mixed_precision="fp32", max_norm=0.0),
        generator=GeneratorRoleConfig(count=1, max_batch=16, device="cpu", dtype="fp32"),
        rl=LoopConfig(
            steps=8, eval_every=4, wait_timeout_s=60, heartbeat_s=0.25, dead_after_s=3.0
        ),  # fmt: skip
        checkpoint=RLCheckpointConfig(enable=False),
    )


def publish_fails(out: str = "outputs/rl_test") -> RLConfig:
    """`tiny`, with the trainer's publish of policy version 2 failing in its background
    thread (the fail-fast test). The patch is made in every role process that builds this
    config; only the trainer publishes."""
    from concurrent.futures import Future

    import tidal.store.client

    real = tidal.store.client.Store.put_state_dict_async

    def put_state_dict_async(self, state_dict, key, **kwargs):
        if key == "policy" and kwargs.get("version") == 2:
            failed: Future = Future()
            failed.set_exception(RuntimeError("publish failure on purpose"))
            return failed
        return real(self, state_dict, key, **kwargs)

    tidal.store.client.Store.put_state_dict_async = put_state_dict_async  # type: ignore[method-assign]
    return tiny(out)
