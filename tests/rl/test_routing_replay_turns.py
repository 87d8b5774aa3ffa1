"""Routing replay through multi-turn trajectories, CPU fp32, batch-invariant mode.

The stale generator of test_routing_replay.py (a selection bias the trainer lacks) plays the
`guess` game, continuing each conversation from its cache row or resubmitting it whole. Each
trajectory carries the experts of every position the generator ran, the environment's
observations included (the next turn prefills them): they are the generator's model's own
forward routing of the whole conversation. Packed into the rollout they make the trainer's
log-probs the generator's bit for bit (every PPO ratio exactly 1.0), where without replay
they differ. Bad input: records of the wrong shape, one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tidal.store
from tests.generate.test_routing_records import forward_routing
from tests.rl.test_routing_replay import check_rollout_replays, moe_trainer, stale_generator
from tidal.generate import Sample, SamplingParams
from tidal.rl.envs import FromCache, Trajectory, TurnCodec, get_env, resubmit, run_trajectories
from tidal.rl.rollout import RolloutBatch
from tidal.rl.tasks import Problem
from tidal.train.data.chat import build_encoder
from tidal.train.data.config import CHAT_SPECIAL_TOKENS
from tidal.train.data.tokenizer import Tokenizer, train_bpe

TEXTS = ["Guess. Higher. Lower. Reply with one number from 1 to 9."]
SEQ = 128


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return train_bpe(
        TEXTS * 50, 512, tmp_path_factory.mktemp("bpe"), extra_specials=CHAT_SPECIAL_TOKENS
    )


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    t = moe_trainer(tmp_path_factory.mktemp("replay_turns"), seq_len=SEQ)
    yield t
    t.close()


def play(trainer, tok, engine: str) -> tuple[list[Trajectory], torch.nn.Module]:
    """Two groups of three `guess` trajectories from the stale generator; and its model."""
    gen = stale_generator(trainer, tokenizer=tok, max_batch=6, max_seq_len=SEQ)
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
    try:
        groups, counts = run_trajectories(
            env, problems, TurnCodec(encoder), generate_turn, params, max_context=SEQ
        )
    finally:
        if isinstance(generate_turn, FromCache):
            generate_turn.close()
    trajs = [t for g in groups for t in g]
    assert counts["turns"] > len(trajs)  # several turns each (a random model rarely wins)
    return trajs, gen.model


@pytest.mark.parametrize("engine", ["cache", "resubmit"])
def test_multi_turn_replay_makes_the_trainers_logprobs_the_generators_bits(trainer, tok, engine):
    trajs, model = play(trainer, tok, engine)
    observed = 0
    for t in trajs:
        r = t.routed_experts
        assert r is not None and r.dtype == torch.uint8
        # every position up to the last sampled turn's last token, never fed back
        last = max(k for k, m in enumerate(t.loss_mask) if m)
        assert r.shape[1] == len(t.prompt_ids) + last
        want = forward_routing(model, t.token_ids())[:, : r.shape[1]]
        assert torch.equal(r.long(), want)
        observed += sum(not m for m in t.loss_mask[:last])
    assert observed > 0  # observations between turns, recorded as the generator ran them
    batch = RolloutBatch.from_trajectories(
        trajs, task="guess", group_ids=[0, 0, 0, 1, 1, 1], pad_id=tok.eos_id
    )
    for i, t in enumerate(trajs):  # the records in the rollout's layout
        p = len(t.prompt_ids)
        got = torch.cat([batch.prompt_experts[i, :, :p], batch.completion_experts[i]], 1)
        assert torch.equal(got[:, : t.routed_experts.shape[1]], t.routed_experts)
    with tidal.store.connect() as store:  # the generator -> trainer path
        store.put_state_dict(batch.to_state_dict(), "rollouts", version=0)
        rollout = RolloutBatch.from_state_dict(store.get_state_dict("rollouts", version=0))
    rollout.rewards = torch.arange(6, dtype=torch.float32) % 2  # a learning signal
    check_rollout_replays(trainer, rollout)


def _sample(prompt: list[int], completion: list[int], experts: torch.Tensor | None) -> Sample:
    n = len(completion)
    return Sample(
        prompt_index=0,
        sample_index=0,
        prompt_ids=prompt,
        completion_ids=completion,
        text="",
        finish_reason="stop",
        logprobs=[0.0] * n,
        sampling_logprobs=[0.0] * n,
        weight_version=None,
        routed_experts=experts,
    )


def test_records_of_the_wrong_shape_are_one_line():
    L, K = 2, 2
    rec = torch.zeros(L, 4, K, dtype=torch.uint8)  # 3 prompt + 2 sampled tokens, but the last
    t = Trajectory(prompt_ids=[1, 2, 3])
    with pytest.raises(ValueError, match=r"shape \(2, 5, 2\); the conversation needs \[layers, 4"):
        t.add_sampled(_sample([1, 2, 3], [4, 5], torch.zeros(L, 5, K, dtype=torch.uint8)))
    t.add_sampled(_sample([1, 2, 3], [4, 5], rec))
    t.add_observation([6, 7])
    with pytest.raises(ValueError, match="carries no routing records .* earlier turns do"):
        t.add_sampled(_sample(t.token_ids(), [8], None))
    with pytest.raises(ValueError, match="differ in layers, top_k or dtype"):
        t.add_sampled(_sample(t.token_ids(), [8], torch.zeros(3, 7, K, dtype=torch.uint8)))
    t.add_sampled(_sample(t.token_ids(), [8], torch.ones(L, 7, K, dtype=torch.uint8)))
    # the positions recorded first keep their records; the new ones come from the new turn
    assert t.routed_experts.shape == (L, 7, K)
    assert t.routed_experts[:, :4].eq(0).all() and t.routed_experts[:, 4:].eq(1).all()

    def pack(*trajs: Trajectory) -> RolloutBatch:
        return RolloutBatch.from_trajectories(trajs, task="t", group_ids=[0] * len(trajs))

    batch = pack(t)
    assert batch.prompt_experts.shape == (1, L, 3, K)
    assert batch.completion_experts.shape == (1, L, 5, K)
    # a trailing observation (the next turn never ran): experts 0..K-1, nothing trained after
    t.add_observation([9, 10])
    ce = pack(t).completion_experts[0]
    assert ce[:, :1].eq(0).all() and ce[:, 1:4].eq(1).all()
    assert torch.equal(ce[:, 4:6], torch.arange(K).expand(L, 2, K))
    with pytest.raises(ValueError, match=r"trajectory 0: routed_experts .* \(2, 7 to 9, 2\)"):
        pack(dataclasses.replace(t, routed_experts=t.routed_experts[:, :5]))
    with pytest.raises(ValueError, match=r"trajectory 0: routed_experts .* \(2, 7 to 9, 2\)"):
        pack(dataclasses.replace(t, routed_experts=torch.zeros(L, 10, K, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="trajectory 1 carries no routing records .* others do"):
        pack(t, dataclasses.replace(t, routed_experts=None))


def test_replay_is_refused_only_for_environments_that_play_themselves():
    from tidal.models import get_flavor
    from tidal.rl.build import check_routing_replay
    from tidal.rl.configs import get_rl_config
    from tidal.train.config_parse import apply_overrides

    moe = get_flavor("debug_moe")
    for name in ("guess", "calculator"):
        args = ["--loss.routing_replay", "true", "--task.name", name]
        check_routing_replay(apply_overrides(get_rl_config("rl_addition"), args), moe)
    cfg = apply_overrides(
        get_rl_config("rl_addition"), ["--loss.routing_replay", "true", "--task.name", "verifiers"]
    )
    with pytest.raises(ValueError, match="'verifiers' plays its own turns .* no routing records"):
        check_routing_replay(cfg, moe)


def test_grpo_loop_with_replay_on_a_multi_turn_environment(tmp_path, cache_dir):
    """`rl_addition_moe` playing `guess` through the one-process loop, shrunk: with replay in
    batch-invariant mode every step reports no gap and ratios of exactly one."""
    import json

    from tidal.rl import grpo

    args = [
        "--config", "rl_addition_moe", "--policy.cache_dir", str(cache_dir),
        "--task.name", "guess", "--task.params", '{"high": 9, "max_turns": 3}',
        "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
        "--rollout.max_new_tokens", "6", "--rollout.max_prompt_tokens", "96",
        "--rollout.max_context", "160", "--task.eval_problems", "2", "--rl.steps", "2",
        "--job.device", "cpu", "--generator.device", "cpu", "--metrics.plot", "false",
        "--job.output_dir", str(tmp_path), "--generator.batch_invariant", "true",
        "--loss.routing_replay", "true",
    ]  # fmt: skip
    assert grpo.main(args) == 0
    steps = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["turns_mean"] > 1
        assert r["logprob_diff_max"] == 0.0 and r["logprob_diff_mean"] == 0.0
        assert r["ratio_max"] == 1.0 and r["ratio_min"] == 1.0
