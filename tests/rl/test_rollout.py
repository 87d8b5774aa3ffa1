"""The rollout batch: packing samples, the store round trip, checks on what comes back,
concat/select, and the trainer side (token ids, per-token log-probs, one loss step)."""

import pytest
import torch

import tidal.store
from tests.generate.conftest import tiny_model
from tidal.generate import (
    Generator,
    GeneratorConfig,
    Sample,
    SamplingParams,
    completion_logprobs,
    logprobs,
)
from tidal.rl.loss import LossConfig, group_advantages, policy_loss
from tidal.rl.rollout import MAX_ANSWER_CHARS, SCHEMA, RolloutBatch
from tidal.rl.tasks import Grade


def make_sample(prompt_index, sample_index, prompt, completion, version=3, reason="stop"):
    return Sample(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_ids=list(prompt),
        completion_ids=list(completion),
        text=None,
        finish_reason=reason,
        logprobs=[-0.5 - 0.1 * k for k in range(len(completion))],
        sampling_logprobs=[-0.25 * k for k in range(len(completion))],
        weight_version=version,
    )


def small_batch(task="addition", meta=None):
    samples = [
        make_sample(0, 0, [1, 2, 3], [7, 8]),
        make_sample(0, 1, [1, 2, 3], [9, 10, 11, 12], reason="length"),
        make_sample(1, 0, [4], [5], version=None),
        make_sample(1, 1, [4], [6, 2, 2]),
    ]
    grades = [
        Grade(reward=1.0, answer="625", format_ok=True),
        Grade(reward=0.0, answer=None, format_ok=False),
        Grade(reward=0.0, answer="x" * 1000, format_ok=True),
        Grade(reward=1.0, answer="3", format_ok=False),
    ]
    return RolloutBatch.from_samples(samples, grades, task=task, pad_id=0, meta=meta), samples


def assert_same(a: RolloutBatch, b: RolloutBatch):
    for name in (
        "prompt_ids",
        "prompt_lens",
        "completion_ids",
        "completion_mask",
        "logprobs",
        "sampling_logprobs",
        "versions",
        "rewards",
        "group_ids",
        "format_ok",
        "truncated",
    ):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert (a.answers, a.task, a.pad_id, a.meta) == (b.answers, b.task, b.pad_id, b.meta)


def test_from_samples_pads_and_masks():
    batch, samples = small_batch()
    assert batch.num_samples == 4
    assert batch.prompt_ids.tolist() == [[1, 2, 3], [1, 2, 3], [4, 0, 0], [4, 0, 0]]
    assert batch.prompt_lens.tolist() == [3, 3, 1, 1]
    assert batch.completion_ids.tolist() == [
        [7, 8, 0, 0],
        [9, 10, 11, 12],
        [5, 0, 0, 0],
        [6, 2, 2, 0],
    ]
    assert batch.completion_mask.sum(1).tolist() == [2, 4, 1, 3]
    assert batch.versions.tolist()[0] == [3, 3, -1, -1] and batch.versions[2].tolist() == [-1] * 4
    torch.testing.assert_close(batch.logprobs[1], torch.tensor(samples[1].logprobs))
    assert (batch.logprobs[~batch.completion_mask] == 0).all()
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert batch.truncated.tolist() == [False, True, False, False]
    assert batch.answers[2] == "x" * MAX_ANSWER_CHARS and batch.answers[1] is None
    stats = batch.stats()
    assert stats["format_ok_rate"] == 0.5 and stats["answered_rate"] == 0.75
    assert stats["truncated_rate"] == 0.25 and stats["completion_len_mean"] == 2.5
    assert (stats["version_min"], stats["version_max"]) == (-1.0, 3.0)


def test_from_samples_bad_input():
    _, samples = small_batch()
    grade = Grade(reward=1.0, answer=None, format_ok=False)
    with pytest.raises(ValueError, match="at least one sample"):
        RolloutBatch.from_samples([], [], task="t")
    with pytest.raises(ValueError, match="4 samples and 3 grades"):
        RolloutBatch.from_samples(samples, [grade] * 3, task="t")
    with pytest.raises(ValueError, match="4 samples and 2 group ids"):
        RolloutBatch.from_samples(samples, [grade] * 4, task="t", group_ids=[0, 1])
    samples[0].logprobs.append(0.0)
    with pytest.raises(ValueError, match="sample 0: 2 completion tokens but 3 logprobs"):
        RolloutBatch.from_samples(samples, [grade] * 4, task="t")


def test_round_trip_through_the_store():
    batch, _ = small_batch(meta={"generator": 2, "seed": 7, "timing": {"gen_s": 1.5}})
    with tidal.store.connect() as store:
        v = store.put_state_dict(batch.to_state_dict(), "rollouts/gen2", version=5)
        got = RolloutBatch.from_state_dict(store.get_state_dict("rollouts/gen2", version=v))
        empty = batch.select([])  # every group dropped: zero rows travel too
        store.put_state_dict(empty.to_state_dict(), "rollouts/gen2", version=6)
        got_empty = RolloutBatch.from_state_dict(store.get_state_dict("rollouts/gen2", version=6))
    assert_same(got, batch)
    assert_same(got_empty, empty)
    assert got_empty.num_samples == 0


def test_from_state_dict_checks_what_arrives():
    batch, _ = small_batch()
    sd = batch.to_state_dict()
    assert_same(RolloutBatch.from_state_dict(sd), batch)
    with pytest.raises(ValueError, match="schema"):
        RolloutBatch.from_state_dict(sd | {"schema": SCHEMA + 1})
    with pytest.raises(ValueError, match=r"lacks \['rewards'\]"):
        RolloutBatch.from_state_dict({k: v for k, v in sd.items() if k != "rewards"})
    with pytest.raises(ValueError, match="rewards must be torch.float32 of shape"):
        RolloutBatch.from_state_dict(sd | {"rewards": sd["rewards"].double()})
    with pytest.raises(ValueError, match=r"logprobs must be torch.float32 of shape \(4, 4\)"):
        RolloutBatch.from_state_dict(sd | {"logprobs": sd["logprobs"][:, :3]})
    with pytest.raises(ValueError, match="answers must hold 4"):
        RolloutBatch.from_state_dict(sd | {"answers": [None]})
    with pytest.raises(ValueError, match="'task' must be a str"):
        RolloutBatch.from_state_dict(sd | {"task": 3})


def test_concat_renumbers_groups_and_pads():
    a, _ = small_batch()
    b = RolloutBatch.from_samples(
        [make_sample(0, 0, [1, 2, 3, 4, 5], [1] * 6), make_sample(0, 1, [1], [2])],
        [Grade(reward=0.5, answer=None, format_ok=False)] * 2,
        task="addition",
    )
    c = RolloutBatch.concat([a, b])
    assert c.num_samples == 6 and c.prompt_ids.shape == (6, 5) and c.completion_ids.shape == (6, 6)
    assert c.group_ids.tolist() == [0, 0, 1, 1, 2, 2]  # b's group 0 is not a's group 0
    assert c.versions[0].tolist() == [3, 3, -1, -1, -1, -1]
    assert torch.equal(c.completion_mask.sum(1), torch.tensor([2, 4, 1, 3, 6, 1]))
    assert c.answers == a.answers + b.answers
    with pytest.raises(ValueError, match="cannot concat"):
        RolloutBatch.concat([a, small_batch(task="countdown")[0]])


def test_select_keeps_what_dynamic_sampling_keeps():
    batch, _ = small_batch()
    batch.rewards[:2] = 1.0  # group 0 all correct: dropped
    adv = group_advantages(batch.rewards, batch.group_ids, LossConfig())
    kept = batch.select(adv.keep)
    assert kept.num_samples == 2 and kept.group_ids.tolist() == [1, 1]
    assert kept.answers == batch.answers[2:]
    assert batch.select([]).num_samples == 0 and batch.select([]).stats() == {}


def test_trainer_side_log_probs_and_one_loss_step():
    model = tiny_model()
    gen = Generator(model, config=GeneratorConfig(max_batch=8, max_seq_len=64))
    groups = gen.generate(
        [[1, 5, 7], [2, 3, 4, 5, 6, 7, 8, 9]], SamplingParams(n=3, max_new_tokens=6, seed=1)
    )
    samples = [s for g in groups for s in g]
    grades = [
        Grade(reward=float(s.sample_index == 0), answer=None, format_ok=False) for s in samples
    ]
    batch = RolloutBatch.from_samples(samples, grades, task="addition")
    store = tidal.store.connect()
    store.put_state_dict(batch.to_state_dict(), "rollouts", version=0)
    batch = RolloutBatch.from_state_dict(store.get_state_dict("rollouts", version=0))
    store.close()

    ids = batch.token_ids()
    lp_NC = batch.completion_values(logprobs(model, ids))
    with torch.no_grad():
        expected = completion_logprobs(model, samples)
    for i, e in enumerate(expected):
        n = len(e)
        torch.testing.assert_close(lp_NC[i, :n].detach(), e)
        assert (lp_NC[i, n:] == 0).all()
    assert (lp_NC.detach() - batch.logprobs).abs().max() < 1e-4  # the generator's own

    adv = group_advantages(batch.rewards, batch.group_ids, LossConfig())
    loss, metrics = policy_loss(
        lp_NC, batch.logprobs, adv.advantages, batch.completion_mask, LossConfig()
    )
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert metrics["num_tokens"] == batch.completion_mask.sum()
