"""The synchronous RL loop, as two short loops over library pieces: one per role.

    trainer (tidal/train Trainer)                     generator g (tidal.rl.Generator)
      put policy@v0                           ---->     wait policy@v0, load it in place
                                                        [g = 0: eval_pass1 of v0 -> eval@0]
      wait rollouts/<g>@1 from every g        <----     sample, grade -> rollouts/<g>@1
      step 1 (GRPO loss) -> put policy@v1     ---->     wait policy@v1, load ...
      ...                                               ...
      wait eval@steps, put control/done                 [g = 0: eval of the last version]

Which version a batch must come from is the schedule's answer (tidal/rl/schedule.py); these
loops ask it and nothing else, so the asynchronous loop is another schedule. Every wait goes
through `Link.wait` (tidal/rl/coupling.py): bounded, and stopped early when another role
stops or dies.

Timing reported per step (metrics.jsonl, docs/rl.md): `sync_trainer_s` is the time the
trainer was blocked publishing (the `put_state_dict_async` call and, before the next
optimizer step, waiting for that put to finish reading the weights); `sync_generator_s` is
the longest time a generator was blocked copying a committed version into its parameters.
Waiting for the other role to produce something is idle time, reported apart
(`trainer_idle_s`, `generator_idle_s`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tidal.rl.config import RLConfig
from tidal.rl.coupling import EVAL, POLICY, Link, rollouts_key
from tidal.rl.generate import Generator
from tidal.rl.loss import group_advantages
from tidal.rl.rollout import RolloutBatch
from tidal.rl.sampling import SamplingParams
from tidal.rl.schedule import SyncSchedule
from tidal.rl.tasks.base import Grade, Problem, Task
from tidal.rl.trainer_inputs import PolicyLoss, rollout_batches

Log = Callable[[str], None]

TIS_FIELDS = ("tis_weight_mean", "tis_capped_frac")
"""The step record's truncated importance sampling metrics (with `loss.tis_cap`)."""


def eval_versions(steps: int, eval_every: int) -> list[int]:
    """Policy versions scored on the held-out set: 0, every `eval_every`, and the last."""
    every = set(range(eval_every, steps + 1, eval_every)) if eval_every else set()
    return sorted({0, steps} | every)


def request_seed(*parts: int) -> int:
    """A sampling seed in [0, 2**63) from integers (run seed, step, generator, prompt)."""
    h = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 1


# -- generator side --------------------------------------------------------------------------


@dataclass(kw_only=True)
class Policy:
    """What a generator needs to turn a task's problems into token ids and back."""

    generator: Generator
    encoder: Any
    """tidal.train.data.chat.ChatEncoder: prompt rendering and `stop_ids`."""
    pad_id: int
    max_prompt_tokens: int


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


def evaluate(policy: Policy, grader: Grader, problems: list[Problem], *, max_new_tokens: int,
             log: Log, label: str) -> dict[str, Any]:  # fmt: skip
    """pass@1 of greedy decoding on `problems` (a fixed held-out set), with progress lines."""
    start = time.perf_counter()
    stop = tuple(sorted(policy.encoder.stop_ids))
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop)
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
    return {"pass1": correct / max(n, 1), "correct": correct, "total": n,
            "seconds": time.perf_counter() - start}  # fmt: skip


def generate_loop(
    policy: Policy,
    task: Task,
    link: Link,
    cfg: RLConfig,
    *,
    index: int,
    first_step: int,
    log: Log,
) -> None:
    """Generator `index`'s side of the sync loop, from rollout batch `first_step + 1` to the
    end (and the final evaluation when `index` is 0)."""
    store, gen, r = link.store, policy.generator, cfg.rollout
    schedule = SyncSchedule(cfg.rl.steps)
    grader = Grader(task)
    eval_set = task.eval_set(cfg.task.eval_problems, seed=cfg.task.eval_seed) if index == 0 else []
    evals = set(eval_versions(cfg.rl.steps, cfg.rl.eval_every))
    stop = tuple(sorted(policy.encoder.stop_ids))

    def load(version: int) -> tuple[float, float]:
        """Wait for `version` to be committed (idle), then copy it into the parameters."""
        t0 = time.perf_counter()
        link.wait_version(POLICY, version, f"policy version {version}", into={})
        t1 = time.perf_counter()
        store.get_state_dict(POLICY, into=gen.model.state_dict(), version=version)
        gen.version = version
        return t1 - t0, time.perf_counter() - t1

    def maybe_eval(version: int) -> None:
        if index != 0 or version not in evals:
            return
        result = evaluate(policy, grader, eval_set, max_new_tokens=r.max_new_tokens, log=log,
                          label=f"eval of policy version {version}")  # fmt: skip
        store.put_state_dict(result, EVAL, version=version)

    for step in range(first_step + 1, cfg.rl.steps + 1):
        version = schedule.version_for_batch(step)
        idle_s, sync_s = load(version)
        maybe_eval(version)
        problems = _problems(task, cfg, index, step)
        prompts = [encode_prompt(policy, p) for p in problems]
        params = [SamplingParams(n=r.group_size, temperature=r.temperature, top_p=r.top_p,
                                 top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                                 stop_token_ids=stop, seed=request_seed(r.seed, step, index, i))
                  for i in range(len(prompts))]  # fmt: skip
        t0 = time.perf_counter()
        groups = gen.generate(prompts, params)
        gen_s = time.perf_counter() - t0
        samples = [s for g in groups for s in g]
        errors_before = grader.errors
        grades = [grader(s.text, problems[s.prompt_index].reference) for s in samples]
        meta = {
            "generator": index, "version": version, "gen_s": gen_s, "idle_s": idle_s,
            "sync_s": sync_s, "gen_tokens": sum(len(s.completion_ids) for s in samples),
            "grader_errors": grader.errors - errors_before, "grader_error": grader.first_error,
        }  # fmt: skip
        batch = RolloutBatch.from_samples(samples, grades, task=task.name, pad_id=policy.pad_id,
                                          meta=meta)  # fmt: skip
        store.put_state_dict(batch.to_state_dict(), rollouts_key(index), version=step)
    if index == 0:
        last = cfg.rl.steps
        if last in evals and gen.version != last:
            load(last)
            maybe_eval(last)


def _problems(task: Task, cfg: RLConfig, index: int, step: int) -> list[Problem]:
    """Generator `index`'s prompts of step `step`: the same for the same seed whatever ran
    before (a resumed run draws what the uninterrupted one would have)."""
    stream: Iterator[Problem] = task.problems("train", seed=request_seed(cfg.rollout.seed, step,
                                                                         index))  # fmt: skip
    return [next(stream) for _ in range(cfg.prompts_of(index))]


# -- trainer side ----------------------------------------------------------------------------


@dataclass(kw_only=True)
class TrainerSide:
    """The trainer role's pieces the loop uses (built by tidal/rl/roles.py)."""

    trainer: Any
    """tidal.train.trainer.Trainer, built without a data pipeline."""
    publish: Callable[[int], Any]
    """Starts publishing the current weights as a version; returns a Future."""
    dp_rank: int
    dp_world: int
    seq_len: int | None
    """Fixed T of every trainer batch (pipeline parallel), or None."""
    reference: list[torch.Tensor] | None = None
    """The frozen reference weights (a copy of the trainer's parameters at the start) when
    `loss.kl_coef` > 0, else None."""


def train_loop(side: TrainerSide, link: Link, cfg: RLConfig, *, first_step: int,
               log_record: Callable[[dict[str, Any]], None]) -> None:  # fmt: skip
    """The trainer's side of the sync loop: steps first_step + 1 .. rl.steps, publishing each
    version, then waiting for the last evaluation. `log_record` gets one record per step and
    one per evaluation (rank 0 writes them)."""
    from tidal.train.optim import set_lr, wsd_multiplier

    trainer, store = side.trainer, link.store
    schedule = SyncSchedule(cfg.rl.steps)
    loss = PolicyLoss(cfg.loss)
    pending_evals = [v for v in eval_versions(cfg.rl.steps, cfg.rl.eval_every) if v >= first_step]
    start = time.perf_counter()
    t0 = time.perf_counter()
    future = side.publish(first_step)
    sync_s = time.perf_counter() - t0
    lr_start = trainer.checkpoint.lr_start
    for step in range(first_step + 1, cfg.rl.steps + 1):
        step_start = time.perf_counter()
        parts = [RolloutBatch.from_state_dict(link.wait_version(
            rollouts_key(g), step, f"the rollouts of step {step} from generator {g}"))
            for g in range(cfg.generator.count)]  # fmt: skip
        idle_s = time.perf_counter() - step_start
        rollout = RolloutBatch.concat(parts)
        stale = schedule.stale_tokens(rollout.versions, rollout.completion_mask, step)
        if stale:
            raise RuntimeError(
                f"step {step}: {stale} rollout tokens come from another policy version than "
                f"{schedule.version_for_batch(step)}; sync mode trains only on-policy tokens"
            )
        adv = group_advantages(rollout.rewards, rollout.group_ids, cfg.loss)
        t0 = time.perf_counter()
        future.result()  # the last put read the weights: the optimizer may change them now
        sync_s += time.perf_counter() - t0
        lr = cfg.optimizer.lr * wsd_multiplier(step - lr_start, cfg.rl.steps - lr_start,
                                               cfg.lr_scheduler)  # fmt: skip
        set_lr(trainer.optimizer, lr)
        train_start = time.perf_counter()
        metrics, tokens, positions = _train_step(side, rollout, adv, loss, cfg)
        train_s = time.perf_counter() - train_start
        trainer.step = step
        t0 = time.perf_counter()
        future = side.publish(step)
        sync_s += time.perf_counter() - t0
        trainer.checkpoint.maybe_save(step, cfg.rl.steps)
        meta = [p.meta for p in parts]
        gen_s = max(m["gen_s"] for m in meta)
        lens = rollout.completion_mask.sum(1).float()
        record: dict[str, Any] = {
            "step": step,
            "reward_mean": float(rollout.rewards.mean()),
            "reward_std": float(rollout.rewards.std()) if rollout.num_samples > 1 else 0.0,
            "response_len_mean": float(lens.mean()),
            "entropy": metrics.get("entropy"),
            **({"kl": metrics.get("kl")} if cfg.loss.kl_coef > 0 else {}),
            **({k: metrics.get(k) for k in TIS_FIELDS} if cfg.loss.tis_cap is not None else {}),
            "clip_frac": metrics.get("clip_frac"),
            "ratio_max": metrics.get("ratio_max"),
            "ratio_min": metrics.get("ratio_min"),
            "ratio_mean": metrics.get("ratio_mean"),
            "loss": metrics.get("loss"),
            "groups_dropped": adv.dropped_groups,
            "groups": adv.groups,
            "samples": rollout.num_samples,
            "samples_per_generator": [p.num_samples for p in parts],
            "format_ok_rate": float(rollout.format_ok.float().mean()),
            "truncated_rate": float(rollout.truncated.float().mean()),
            "grader_errors": sum(m["grader_errors"] for m in meta),
            "tokens_per_s_gen": sum(m["gen_tokens"] for m in meta) / max(gen_s, 1e-9),
            "tokens_per_s_train": tokens / max(train_s, 1e-9) if tokens else 0.0,
            "train_pad_frac": 1.0 - tokens / positions if positions else 0.0,
            "sync_trainer_s": sync_s,
            "sync_generator_s": max(m["sync_s"] for m in meta),
            "trainer_idle_s": idle_s,
            "generator_idle_s": max(m["idle_s"] for m in meta),
            "gen_s": gen_s,
            "train_s": train_s,
            "lr": lr,
            "elapsed_s": time.perf_counter() - start,
        }
        errors = [m["grader_error"] for m in meta if m["grader_error"]]
        if record["grader_errors"]:
            record["grader_error"] = errors[0] if errors else ""
        log_record(record)
        sync_s = 0.0
        pending_evals = _log_evals(store, pending_evals, step, log_record)
    future.result()
    trainer.checkpoint.finish()
    for v in pending_evals:  # the last version's evaluation, and any not yet seen
        result = link.wait_version(EVAL, v, f"the evaluation of policy version {v}")
        log_record({"step": v, "eval_pass1": result["pass1"], "eval_correct": result["correct"],
                    "eval_total": result["total"], "eval_s": result["seconds"]})  # fmt: skip


def _log_evals(store: Any, pending: list[int], step: int, log_record) -> list[int]:
    """Log the evaluations that have arrived (of versions < step: the one of `step` is in
    the making); returns those still pending."""
    left = []
    for v in pending:
        if v < step and store.exists(EVAL, v):
            r = store.get_state_dict(EVAL, version=v)
            log_record({"step": v, "eval_pass1": r["pass1"], "eval_correct": r["correct"],
                        "eval_total": r["total"], "eval_s": r["seconds"]})  # fmt: skip
        else:
            left.append(v)
    return left


def _train_step(side: TrainerSide, rollout: RolloutBatch, adv, loss: PolicyLoss,
                cfg: RLConfig) -> tuple[dict[str, float], int, int]:  # fmt: skip
    """One optimizer step on a rollout (nothing when dynamic sampling dropped every group).
    Returns the loss metrics, the real token positions trained on (every kept sample's prompt
    and completion, minus its last token, over all ranks) and the positions the trainer ran,
    padding included."""
    trainer = side.trainer
    batches = rollout_batches(rollout, adv, micro_batch_size=cfg.trainer.micro_batch_size,
                              seq_len=side.seq_len, dp_rank=side.dp_rank,
                              dp_world=side.dp_world)  # fmt: skip
    if not batches:
        return {}, 0, 0
    batches = [b.to(trainer.device) for b in batches]
    if cfg.loss.tis_cap is not None:  # the PPO ratio against the trainer's own old log-probs
        for b in batches:
            b.extras["old_logprobs"] = trainer.logprobs(b)
    if side.reference is not None:  # the KL term's frozen reference, in the same layout

        def score_reference() -> None:
            for b in batches:
                b.extras["ref_logprobs"] = trainer.logprobs(b)

        _with_weights(trainer, side.reference, score_reference)
    n_tokens = sum(b.target_count() for b in batches)
    result = trainer.train_step(batches, n_tokens, loss=loss)
    metrics = {k: float(v) for k, v in result.metrics.items()}
    lens = rollout.prompt_lens + rollout.completion_mask.sum(1)
    real = int((lens - 1).clamp(min=0)[adv.keep].sum())
    return metrics, real, int(result.tokens)


@torch.no_grad()
def _with_weights(trainer: Any, weights: list[torch.Tensor], fn: Callable[[], Any]) -> None:
    """Run `fn` with the trainer's parameters swapped for `weights` (same layout), then put
    the trainer's own back.

    The swap writes the (sharded) parameters; FSDP2 modules that keep their gathered
    parameters after a forward (the root and the last block, by default) are resharded on
    both sides of it, or the next forward would reuse a copy gathered from the other
    weights (the KL reference pass read the policy's weights, and the training step the
    reference's)."""
    own = [p.detach().clone() for p in trainer.params]
    _reshard(trainer)
    for p, w in zip(trainer.params, weights, strict=True):
        p.copy_(w)
    try:
        fn()
    finally:
        _reshard(trainer)
        for p, w in zip(trainer.params, own, strict=True):
            p.copy_(w)


def _reshard(trainer: Any) -> None:
    """Free the gathered parameters of every FSDP2 module of the trainer (a no-op without
    FSDP or when already resharded)."""
    from torch.distributed.fsdp import FSDPModule

    for module in trainer.modules:
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
