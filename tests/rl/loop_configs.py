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


def layouts(out: str = "outputs/rl_test") -> RLConfig:
    """`tiny` with two generators in layouts of their own: generator 0 tensor parallel on 2
    ranks, generator 1 on one, both in bf16 (the fp32 trainer publishes bf16); run it with
    `--nproc 2` for an FSDP trainer. With TIDAL_TEST_WEIGHTS naming a folder, every role
    process writes there the full parameters of each policy version it holds (the layouts
    test compares them)."""
    import dataclasses
    import os

    cfg = tiny(out)
    generator = GeneratorRoleConfig(count=2, tp=(2, 1), max_batch=16, device="cpu", dtype="bf16")
    # Seven processes on a loaded 2-core machine: no role is taken for dead while it waits
    # for a core (this test is about weights, not faults).
    loop = dataclasses.replace(cfg.rl, wait_timeout_s=240, dead_after_s=60)
    if os.environ.get("TIDAL_TEST_WEIGHTS"):
        _write_weights(os.environ["TIDAL_TEST_WEIGHTS"])
    return dataclasses.replace(cfg, generator=generator, rl=loop)


def _write_weights(folder: str) -> None:
    """Patch the trainer's publish and the Generator's generate (in this process) to save the
    full parameters of each version: the trainer's cast to bf16 (the generators' dtype) from
    its rank 0, each generator rank's gathered from its shards."""
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import tidal.rl.generate
    import tidal.store.client

    def full(sd: dict) -> dict:
        return {k: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
                for k, t in sd.items()}  # fmt: skip

    def rank() -> tuple[int, int]:
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    put = tidal.store.client.Store.put_state_dict_async

    def put_state_dict_async(self, state_dict, key, **kwargs):
        if key == "policy":  # every trainer rank publishes together: the gathers match up
            params = {k: t.to(torch.bfloat16) for k, t in full(state_dict).items()}
            if rank()[0] == 0:
                v = kwargs["version"]
                torch.save({"version": v, "params": params}, Path(folder) / f"trainer-v{v}.pt")
        return put(self, state_dict, key, **kwargs)

    generate = tidal.rl.generate.Generator.generate
    written: set[int] = set()

    def generate_and_write(self, prompts, params=None):
        v = self.version
        if v is not None and v not in written:  # every rank of a generator generates together
            written.add(v)
            sd = self.model.state_dict()
            local = sum(
                (t.to_local() if isinstance(t, DTensor) else t).numel() for t in sd.values()
            )
            r, world = rank()
            index = sys.argv[sys.argv.index("--index") + 1]
            torch.save({"version": v, "params": full(sd), "local_numel": local, "world": world},
                       Path(folder) / f"generator{index}-rank{r}-v{v}.pt")  # fmt: skip
        return generate(self, prompts, params)

    tidal.store.client.Store.put_state_dict_async = put_state_dict_async  # type: ignore[method-assign]
    tidal.rl.generate.Generator.generate = generate_and_write  # type: ignore[method-assign]
