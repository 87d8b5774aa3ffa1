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
        ),
        loss=LossConfig(drop_equal_groups=False),
        optimizer=OptimizerConfig(lr=3e-2, weight_decay=0.0),
        lr_scheduler=SchedulerConfig(warmup_steps=0, decay_fraction=0.0),
        trainer=TrainerConfig(micro_batch_size=16, mixed_precision="fp32", max_norm=0.0),
        generator=GeneratorRoleConfig(count=1, max_batch=16, device="cpu", dtype="fp32"),
        rl=LoopConfig(steps=8, eval_every=4, wait_timeout_s=60, heartbeat_s=0.25, dead_after_s=3.0),
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
    process writes there the full parameters of each policy version it holds
    (`_write_weights`; the layouts test compares them)."""
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


def cuda_async(out: str = "outputs/rl_test") -> RLConfig:
    """`tiny` as it runs on a GPU, every role on one CUDA device, in async mode: the trainer
    in bf16 mixed precision publishes bf16 into its own GPU memory (store.policy_memory auto
    resolves to cuda), and one generator in bf16 (compiled decode steps in CUDA graphs, the
    defaults on CUDA) reads each version device to device (CUDA IPC) into GPU staging slots
    and swaps it into its live parameters between decode steps. A batch's 32 samples of up to
    192 tokens go through the generator's 8 rows in four waves, so that a batch outlasts
    a trainer step and new versions land mid-batch. With TIDAL_TEST_WEIGHTS naming a folder,
    every role process writes there the full parameters of each version it holds, and the
    trainer's stream stalls before each publish (`_write_weights`). `--rl.mode sync` runs
    the same job in sync mode; `--job.device cpu --generator.device cpu` runs it on CPU."""
    import dataclasses
    import os

    cfg = tiny(out)
    rollout = dataclasses.replace(cfg.rollout, max_new_tokens=192)
    trainer = dataclasses.replace(cfg.trainer, mixed_precision="bf16")
    generator = GeneratorRoleConfig(count=1, max_batch=8, device="cuda", dtype="bf16")
    # Compiling the decode steps at the generator's start takes a while: no role is taken
    # for dead or lost meanwhile.
    loop = dataclasses.replace(
        cfg.rl, mode="async", wait_timeout_s=600, dead_after_s=60, lost_after_s=60
    )
    if os.environ.get("TIDAL_TEST_WEIGHTS"):
        _write_weights(os.environ["TIDAL_TEST_WEIGHTS"], stall_cycles=20_000_000)
    return dataclasses.replace(
        cfg,
        job=dataclasses.replace(cfg.job, device="cuda"),
        rollout=rollout,
        trainer=trainer,
        generator=generator,
        loss=dataclasses.replace(cfg.loss, tis_cap=2.0),
        rl=loop,
    )


def _write_weights(folder: str, *, stall_cycles: int = 0) -> None:
    """Patch, in this role process, the points where policy weights change hands, to save in
    `folder` the full parameters of each version held there (once per version and process):

    - the trainer's publish (`Store.put_state_dict_async` of "policy"): its parameters cast
      to bf16 (the generators' dtype) on their device, from its rank 0, as `trainer-v{v}.pt`
      with the put's `memory`;
    - a generator's weights, every rank's gathered from its shards, as
      `generator{index}-rank{r}-v{v}.pt` with `by` naming where the version was seen first:
      "generate" (`Generator.generate`: every batch of the sync loop, every evaluation),
      "start" (`Stager.start`: the version an async generator starts from), "batch start"
      (`Stager.swap` called by `Stager.at_batch_start`) or "in flight" (`Stager.swap` called
      between decode steps), and `staging`, the device of a Stager's staging memory.

    A swap's copies are queued on the current CUDA stream of the generator's thread
    (non-blocking); the parameters are copied to host memory right after, in that thread,
    by a blocking copy on that stream: they are the swapped-in bytes, not an earlier state.

    `stall_cycles`: before each publish of CUDA weights, the trainer's stream spins that many
    GPU clock cycles (`torch.cuda._sleep`; 20M: about 10 ms), so the put's device copies run
    after the put has queued them and told the store (as behind a large model's optimizer
    step). Without it, the dump's own copy to host memory would leave the trainer's stream
    idle at each publish, and a reader that does not wait for the writer's copies would
    never be caught reading the slots' old bytes."""
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import tidal.generate.generator
    import tidal.rl.distributed.prefetch
    import tidal.store.client

    def full(sd: dict, dtype: torch.dtype | None = None) -> dict:
        """Each tensor whole (a collective for DTensors), cast to `dtype` on its device, in
        host memory (a copy on the current stream, after the work queued there)."""
        out = {}
        for k, t in sd.items():
            t = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
            out[k] = t.to(dtype=dtype or t.dtype).to("cpu", copy=True)
        return out

    def rank() -> tuple[int, int]:
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    put = tidal.store.client.Store.put_state_dict_async

    def put_state_dict_async(self, state_dict, key, **kwargs):
        if key == "policy":  # every trainer rank publishes together: the gathers match up
            params = full(state_dict, torch.bfloat16)
            if rank()[0] == 0:
                v = kwargs["version"]
                torch.save(
                    {"version": v, "params": params, "memory": kwargs.get("memory")},
                    Path(folder) / f"trainer-v{v}.pt",
                )
            if stall_cycles and any(t.is_cuda for t in state_dict.values()):
                torch.cuda._sleep(stall_cycles)  # the put's copies wait behind it
        return put(self, state_dict, key, **kwargs)

    written: set[int] = set()  # every rank of a generator sees the same versions at once

    def write(v: int, sd: dict, by: str, staging: str | None = None) -> None:
        if v in written:
            return
        written.add(v)
        local = sum((t.to_local() if isinstance(t, DTensor) else t).numel() for t in sd.values())
        r, world = rank()
        index = sys.argv[sys.argv.index("--index") + 1]
        torch.save(
            {
                "version": v,
                "params": full(sd),
                "local_numel": local,
                "world": world,
                "by": by,
                "staging": staging,
            },
            Path(folder) / f"generator{index}-rank{r}-v{v}.pt",
        )

    generate = tidal.generate.generator.Generator.generate

    def generate_and_write(self, prompts, params=None):
        if self.version is not None:  # every rank of a generator generates together
            write(self.version, self.model.state_dict(), "generate")
        return generate(self, prompts, params)

    Stager = tidal.rl.distributed.prefetch.Stager
    start, swap, at_batch_start = Stager.start, Stager.swap, Stager.at_batch_start
    where = ["in flight"]  # where the next swap is called from

    def staging_of(stager) -> str:
        t = next(iter(stager.staging.values()))
        return (t.to_local() if isinstance(t, DTensor) else t).device.type

    def start_and_write(self):
        write(self.held, self.params, "start", staging_of(self))
        return start(self)

    def swap_and_write(self):
        v = swap(self)
        if v is not None:  # the ranks of a generator swap the same version at the same point
            write(v, self.params, where[0], staging_of(self))
        return v

    def at_batch_start_and_write(self):
        where[0] = "batch start"
        try:
            return at_batch_start(self)
        finally:
            where[0] = "in flight"

    tidal.store.client.Store.put_state_dict_async = put_state_dict_async  # type: ignore[method-assign]
    tidal.generate.generator.Generator.generate = generate_and_write  # type: ignore[method-assign]
    Stager.start = start_and_write  # type: ignore[method-assign]
    Stager.swap = swap_and_write  # type: ignore[method-assign]
    Stager.at_batch_start = at_batch_start_and_write  # type: ignore[method-assign]
