"""Experience: a task's problems sampled by the policy and graded, as a `RolloutBatch`, and
the held-out evaluation. The generator's half of the algorithm, used by tidal/rl/grpo.py (one
process) and by the generator role of `tidal rl` (tidal/rl/distributed/generator.py and
async_generator.py) alike.

Every batch is seeded by integers (the run's `rollout.seed`, the step, the generator, ...):
its problems and its sampling noise are the same whatever ran before, so a resumed run, or
the same step in grpo.py and in `tidal rl`, draws the same batch.

Example (a `Policy` from tidal.rl.build.make_policy)::

    grader = Grader(task)
    rollout = sample_batch(policy, task, grader, cfg, seeds=(cfg.rollout.seed, step, 0),
                           n_prompts=cfg.rollout.prompts_per_step)
    print(float(rollout.rewards.mean()))
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tidal.generate import Generator, Sample, SamplingParams
from tidal.rl.config import RLConfig
from tidal.rl.rollout import RolloutBatch
from tidal.rl.tasks.base import Grade, Problem, Task

Log = Callable[[str], None]


def eval_versions(steps: int, eval_every: int) -> list[int]:
    """Policy versions scored on the held-out set: 0, every `eval_every`, and the last."""
    every = set(range(eval_every, steps + 1, eval_every)) if eval_every else set()
    return sorted({0, steps} | every)


def request_seed(*parts: int) -> int:
    """A sampling seed in [0, 2**63) from integers (run seed, step, generator, prompt)."""
    h = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 1


@dataclass(kw_only=True)
class Policy:
    """What a generator needs to turn a task's problems into token ids and back."""

    generator: Generator
    encoder: Any
    """tidal.train.data.chat.ChatEncoder: prompt rendering and `stop_ids`."""
    pad_id: int
    max_prompt_tokens: int

    @property
    def stop(self) -> tuple[int, ...]:
        """The token ids that end a completion (the chat template's end of turn)."""
        return tuple(sorted(self.encoder.stop_ids))


def encode_prompt(policy: Policy, problem: Problem) -> list[int]:
    """The chat-rendered prompt of a problem, checked against `rollout.max_prompt_tokens`."""
    ids = policy.encoder.prompt_ids([{"role": "user", "content": problem.prompt}])
    if len(ids) > policy.max_prompt_tokens:
        raise ValueError(
            f"a prompt of the task is {len(ids)} tokens, over rollout.max_prompt_tokens="
            f"{policy.max_prompt_tokens}: {problem.prompt[:80]!r}"
        )
    return ids


class Grader:
    """The task's grader with its failures counted, never raised: a grader that raises gives
    reward 0 for that sample and the run goes on (the count and first message are reported)."""

    def __init__(self, task: Task) -> None:
        self.task, self.errors, self.first_error = task, 0, ""

    def __call__(self, text: str | None, reference: Any) -> Grade:
        try:
            return self.task.grade(text or "", reference)
        except Exception as e:  # documented fallback: a broken grader costs reward, not the run
            self.errors += 1
            if not self.first_error:
                self.first_error = f"{type(e).__name__}: {e}"[:300]
            return Grade(reward=0.0, answer=None, format_ok=False)


def evaluate(
    policy: Policy,
    grader: Grader,
    problems: list[Problem],
    *,
    max_new_tokens: int,
    log: Log,
    label: str,
) -> dict[str, Any]:
    """pass@1 of greedy decoding on `problems` (a fixed held-out set), with progress lines;
    for an environment (`grader.task`), one greedy trajectory each (`evaluate_env`)."""
    from tidal.rl.envs import Env, evaluate_env

    if isinstance(grader.task, Env):
        return evaluate_env(
            policy, grader.task, problems, max_new_tokens=max_new_tokens, log=log, label=label
        )
    start = time.perf_counter()
    params = SamplingParams(
        temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=policy.stop
    )
    correct, chunk = 0, max(1, policy.generator.config.max_batch)
    for lo in range(0, len(problems), chunk):
        part = problems[lo : lo + chunk]
        groups = policy.generator.generate([encode_prompt(policy, p) for p in part], params)
        for p, group in zip(part, groups, strict=True):
            correct += grader(group[0].text, p.reference).reward >= 1.0
        done = lo + len(part)
        if done < len(problems):
            log(f"{label}: {done}/{len(problems)} problems, {correct} right so far")
    n = len(problems)
    return {
        "pass1": correct / max(n, 1),
        "correct": correct,
        "total": n,
        "seconds": time.perf_counter() - start,
    }


def sample_batch(
    policy: Policy,
    task: Task,
    grader: Grader,
    cfg: RLConfig,
    *,
    seeds: tuple[int, ...],
    n_prompts: int,
    meta: dict[str, Any] | None = None,
) -> RolloutBatch:
    """The graded samples of one batch of `n_prompts` problems (see `batch_requests`);
    `meta` (the caller's figures) gains the generation time `gen_s`. For an environment,
    its trajectories (`sample_env_batch`), its errors counted as the grader's."""
    from tidal.rl.envs import Env, sample_env_batch

    if isinstance(task, Env):
        batch = sample_env_batch(policy, task, cfg, seeds=seeds, n_prompts=n_prompts, meta=meta)
        grader.errors += batch.meta["env_errors"]
        grader.first_error = grader.first_error or batch.meta["env_error"]
        return batch
    problems, prompts, params = batch_requests(policy, task, cfg, seeds, n_prompts)
    t0 = time.perf_counter()
    groups = policy.generator.generate(prompts, params)
    meta = {**(meta or {}), "gen_s": time.perf_counter() - t0}
    return graded_batch(policy, task, grader, problems, groups, meta)


def batch_requests(
    policy: Policy,
    task: Task,
    cfg: RLConfig,
    seeds: tuple[int, ...],
    n_prompts: int,
) -> tuple[list[Problem], list[list[int]], list[SamplingParams]]:
    """The problems of one batch, their prompts' token ids and their sampling parameters. Its
    problems and sampling noise are seeded by `seeds` (the same whatever ran before: a
    resumed run draws what the uninterrupted one would have)."""
    r = cfg.rollout
    stream: Iterator[Problem] = task.problems("train", seed=request_seed(*seeds))
    problems = [next(stream) for _ in range(n_prompts)]
    prompts = [encode_prompt(policy, p) for p in problems]
    params = [
        SamplingParams(
            n=r.group_size,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=policy.stop,
            seed=request_seed(*seeds, i),
        )
        for i in range(len(prompts))
    ]
    return problems, prompts, params


def graded_batch(
    policy: Policy,
    task: Task,
    grader: Grader,
    problems: list[Problem],
    groups: list[list[Sample]],
    meta: dict[str, Any],
) -> RolloutBatch:
    """The rollout batch of `groups` (one per problem), each sample graded; `meta` gains the
    token and grader-error counts."""
    samples = [s for g in groups for s in g]
    errors_before = grader.errors
    grades = [grader(s.text, problems[s.prompt_index].reference) for s in samples]
    meta = {
        **meta,
        "gen_tokens": sum(len(s.completion_ids) for s in samples),
        "grader_errors": grader.errors - errors_before,
        "grader_error": grader.first_error,
    }
    return RolloutBatch.from_samples(
        samples, grades, task=task.name, pad_id=policy.pad_id, meta=meta
    )
