"""Environments with a real Generator on CPU: a task played through the environment API gives
the very batch the single-turn path gives, and multi-turn trajectories are token-exact: in
batch-invariant mode the trainer's forward over a whole conversation reproduces every sampled
token's generator log-prob bit for bit, so every PPO ratio is exactly 1.0."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.generate.conftest import tiny_model
from tests.rl._trainer import no_data, rl_config
from tests.rl.test_rollout import assert_same
from tidal.generate import Generator, GeneratorConfig
from tidal.rl.config import RolloutConfig
from tidal.rl.envs import get_env, sample_env_batch
from tidal.rl.experience import Grader, Policy, sample_batch
from tidal.rl.loss import LossConfig, group_advantages
from tidal.rl.tasks import Grade, Problem, get_task
from tidal.rl.trainer_inputs import PolicyLoss, rollout_batches
from tidal.train.data.chat import build_encoder
from tidal.train.data.config import CHAT_SPECIAL_TOKENS
from tidal.train.data.tokenizer import Tokenizer, train_bpe
from tidal.train.trainer import Trainer

TEXTS = ["What is 12 + 345? #### 357", "Guess. Higher. Lower. Reply with one number from 1 to 9."]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return train_bpe(
        TEXTS * 50, 512, tmp_path_factory.mktemp("bpe"), extra_specials=CHAT_SPECIAL_TOKENS
    )


def test_a_task_through_the_environment_api_gives_the_same_batch(tok):
    model = tiny_model(vocab_size=tok.vocab_size, max_seq_len=96)
    policy = Policy(
        generator=Generator(model, tokenizer=tok, config=GeneratorConfig(max_batch=8)),
        encoder=build_encoder(tok, "builtin", None),
        pad_id=tok.eos_id,
        max_prompt_tokens=48,
    )
    cfg = SimpleNamespace(
        rollout=RolloutConfig(prompts_per_step=3, group_size=3, max_new_tokens=10, seed=5)
    )
    task = get_task("addition", digits=(1, 3))
    old = sample_batch(policy, task, Grader(task), cfg, seeds=(5, 2, 0), n_prompts=3)
    env = get_env("addition", digits=(1, 3))
    new = sample_env_batch(policy, env, cfg, seeds=(5, 2, 0), n_prompts=3)
    assert old.completion_mask.any()
    assert torch.equal(new.train_mask, old.completion_mask)
    assert new.meta["gen_tokens"] == old.meta["gen_tokens"] and new.meta["obs_tokens"] == 0
    new.loss_mask, new.meta = None, old.meta
    assert_same(old, new)
    # and the trainer rows are the same
    adv = group_advantages(old.rewards, old.group_ids, LossConfig(drop_equal_groups=False))
    for a, b in zip(
        rollout_batches(old, adv, micro_batch_size=4),
        rollout_batches(new, adv, micro_batch_size=4),
        strict=True,
    ):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        for k in a.extras:
            assert torch.equal(a.extras[k], b.extras[k]), k


class Recording:
    """A TokenLoss that keeps what the step passed it, then defers to the GRPO loss."""

    def __init__(self, loss):
        self.loss, self.wants_entropy, self.seen = loss, loss.wants_entropy, []

    def __call__(self, logprobs, batch, norms, entropy):
        x = batch.extras
        self.seen.append((logprobs.detach().clone(), x["old_logprobs"], x["mask"]))
        return self.loss(logprobs, batch, norms, entropy)


@pytest.mark.parametrize("engine", ["cache", "resubmit"])
def test_multi_turn_trajectories_are_token_exact_and_ratios_are_one(tmp_path, tok, engine):
    from tidal.generate import SamplingParams
    from tidal.rl.envs import FromCache, TurnCodec, resubmit, run_trajectories
    from tidal.rl.rollout import RolloutBatch

    cfg = rl_config(
        tmp_path,
        "--model.flavor",
        "debug",
        "--training.batch_invariant",
        "true",
        "--training.seq_len",
        "160",
    )
    trainer = Trainer(cfg, data=no_data(), log=lambda *a: None)
    try:
        gen = Generator(
            trainer.model,
            tokenizer=tok,
            config=GeneratorConfig(max_batch=6, max_seq_len=160, batch_invariant=True),
        )
        encoder = build_encoder(tok, "builtin", None)
        env = get_env("guess", low=1, high=9, max_turns=3)
        problems = [
            Problem("Guess.", {"target": 4, "high": 9}),
            Problem("Guess.", {"target": 7, "high": 9}),
        ]
        params = [
            SamplingParams(n=3, max_new_tokens=8, seed=i, stop_token_ids=tuple(encoder.stop_ids))
            for i in range(2)
        ]
        generate_turn = FromCache(gen) if engine == "cache" else resubmit(gen)
        groups, counts = run_trajectories(
            env, problems, TurnCodec(encoder), generate_turn, params, max_context=160
        )
        trajs = [t for g in groups for t in g]
        assert counts["turns"] > len(trajs)  # several turns each (a random model rarely wins)
        if engine == "cache":  # each id prefilled once: the openings, then observations only
            observations = sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajs)
            later_turns = counts["turns"] - len(trajs)
            openings = sum(len(g[0].prompt_ids) for g in groups)
            assert gen.stats.prefill_tokens == openings + observations + later_turns
            assert gen.conversations  # rows held until the batch is played
            generate_turn.close()
            assert not gen.conversations
        rollout = RolloutBatch.from_trajectories(
            trajs, task="guess", group_ids=[0, 0, 0, 1, 1, 1], pad_id=tok.eos_id
        )
        assert int((rollout.completion_mask & ~rollout.train_mask).sum()) > 0  # observations
        loss_cfg = LossConfig(drop_equal_groups=False, std_normalize=False)
        rewards = torch.arange(6, dtype=torch.float32) % 2  # a learning signal for the step
        adv = group_advantages(rewards, rollout.group_ids, loss_cfg)
        batches = rollout_batches(rollout, adv, micro_batch_size=4, seq_len=159)
        for b in batches:
            lp, mask = trainer.logprobs(b), b.extras["mask"]
            assert mask.sum() > 0
            assert torch.equal(lp[mask], b.extras["gen_logprobs"][mask])
        loss = Recording(PolicyLoss(loss_cfg))
        result = trainer.train_step(batches, sum(b.target_count() for b in batches), loss=loss)
        for new, old, mask in loss.seen:
            assert torch.equal(new[mask], old[mask])
        assert float(result.metrics["ratio_max"]) == 1.0
        assert float(result.metrics["ratio_min"]) == 1.0
        assert int(result.metrics["num_tokens"]) == int(rollout.train_mask.sum())
    finally:
        trainer.close()


def test_evaluate_env_scores_a_task_as_evaluate_does(tok):
    from tidal.rl.envs import evaluate_env
    from tidal.rl.experience import evaluate

    model = tiny_model(vocab_size=tok.vocab_size, max_seq_len=96)
    policy = Policy(
        generator=Generator(model, tokenizer=tok, config=GeneratorConfig(max_batch=4)),
        encoder=build_encoder(tok, "builtin", None),
        pad_id=tok.eos_id,
        max_prompt_tokens=48,
    )
    env = get_env("addition", digits=1)
    problems = env.eval_set(6)
    # a random model is never right: a grader that credits references over 4 instead
    env.task.grade = lambda text, ref: Grade(  # type: ignore[method-assign]
        reward=float(int(ref) > 4), answer=None, format_ok=bool(text)
    )
    old = evaluate(policy, Grader(env.task), problems, max_new_tokens=8, log=print, label="e")
    new = evaluate_env(policy, env, problems, max_new_tokens=8)
    assert 0 < old["correct"] < 6
    assert (new["pass1"], new["correct"], new["total"]) == (old["pass1"], old["correct"], 6)
    assert new["turns_mean"] == 1.0 and new["env_errors"] == 0
