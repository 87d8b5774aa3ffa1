"""Conversations continued from the KV cache: `generate(..., keep=True)`, `Continuation`,
`Generator.continue_` and `release` (multi-turn rollouts: observations appended as tokens,
only they prefilled)."""

from collections import deque

import pytest
import torch

from tests.generate.conftest import tiny_model
from tidal.generate import (
    Continuation,
    Generator,
    GeneratorConfig,
    SamplingParams,
    logprobs,
)

# Per trajectory: the prompt and the observation after each of its first turns.
TRAJECTORIES = [
    ([1, 5, 7], [[9, 9, 9], [4, 4]]),
    ([2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [[30], [31, 32, 33, 34]]),
    ([4], [[50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67], []]),
]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def run_alone(model, prompt, observations, params, config):
    """Every turn of one trajectory, alone in its generator."""
    gen = Generator(model, config=config)
    ((s,),) = gen.generate([prompt], params, keep=True)
    turns = [s]
    for obs in observations:
        (s,) = gen.continue_([s.conversation], [obs], params)
        turns.append(s)
    gen.release(s.conversation)
    assert not gen.conversations
    return turns


def test_three_turns_from_the_cache_are_bitwise_the_trainers(model):
    """Batch-invariant mode: every turn's log-probs, sampled from the cache rows of earlier
    turns with only the observations prefilled, are bitwise those of the whole conversation
    (prompt, turns, observations) scored in one trainer forward; each token keeps the policy
    version it was sampled with."""
    config = GeneratorConfig(max_batch=4, max_seq_len=112, check_every=3, batch_invariant=True)
    gen = Generator(model, config=config)
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=n, seed=i, stop_token_ids=())
        for i, n in enumerate((9, 6, 12))
    ]
    gen.load_weights(model.state_dict(), version=1)
    firsts = [g[0] for g in gen.generate([p for p, _ in TRAJECTORIES], params, keep=True)]
    turns = [[s] for s in firsts]
    prefilled = sum(len(p) for p, _ in TRAJECTORIES)
    for k in range(2):
        gen.load_weights(model.state_dict(), version=2 + k)  # same weights, a new version
        last = [t[-1] for t in turns]
        obs = [o[k] for _, o in TRAJECTORIES]
        nexts = gen.continue_([s.conversation for s in last], obs, params)
        prefilled += sum(len(o) + 1 for o in obs)  # the observation and the last turn's token
        for t, s in zip(turns, nexts, strict=True):
            t.append(s)
    assert gen.stats.prefill_tokens == prefilled  # nothing of a conversation prefilled twice

    for (prompt, obs), t in zip(TRAJECTORIES, turns, strict=True):
        whole = prompt + t[0].completion_ids + obs[0] + t[1].completion_ids
        whole += obs[1] + t[2].completion_ids
        assert t[2].prompt_ids + t[2].completion_ids == whole == t[2].conversation.ids
        with torch.no_grad():
            lp = logprobs(model, torch.tensor([whole]), batch_invariant=True)[0]
        for k, s in enumerate(t):
            start = len(s.prompt_ids) - 1
            want = lp[start : start + len(s.completion_ids)]
            assert torch.equal(torch.tensor(s.logprobs), want), (prompt, k)
            assert s.weight_version == 1 + k and s.versions is None
        assert t[2].conversation.turns == 3
        gen.release(t[2].conversation)
    assert not gen.conversations


def test_conversations_at_different_turns_batch_as_each_alone(model):
    """Greedy trajectories started at different times share decode steps at different turns
    (one stream, continuations fed as turns end, rows refilled and compacted around held
    rows) and give the tokens each gives alone."""
    params = SamplingParams(temperature=0.0, max_new_tokens=7, stop_token_ids=())
    alone_cfg = GeneratorConfig(max_batch=1, max_seq_len=96)
    alone = [run_alone(model, p, o, params, alone_cfg) for p, o in TRAJECTORIES]

    gen = Generator(model, config=GeneratorConfig(max_batch=4, max_seq_len=96, check_every=2))
    # A new trajectory joins each time a batch ends: turns 1, 2 and 3 run together.
    batches = deque([([TRAJECTORIES[0][0]], params)])
    got: dict[int, list] = {}  # trajectory -> its turns
    owner: dict[int, int] = {}  # id(conversation) -> trajectory

    def feed(idle):
        if batches:
            return batches.popleft()
        finished = len(got) == len(TRAJECTORIES) and all(len(t) == 3 for t in got.values())
        return Generator.END if finished else None

    for groups in gen.stream(feed, keep=True):
        items: list = []
        for (s,) in groups:
            if id(s.conversation) not in owner:  # a first turn: which prompt
                owner[id(s.conversation)] = [t[0] for t in TRAJECTORIES].index(s.prompt_ids)
            i = owner[id(s.conversation)]
            got.setdefault(i, []).append(s)
            if len(got[i]) < 3:
                items.append(Continuation(s.conversation, TRAJECTORIES[i][1][len(got[i]) - 1]))
            else:
                gen.release(s.conversation)
        if len(owner) < len(TRAJECTORIES):
            items.append(TRAJECTORIES[len(owner)][0])
        if items:
            batches.append((items, params))
    assert sorted(got) == [0, 1, 2]
    # Turns of different trajectories shared prefills and decode steps: 9 turns of 7 tokens
    # alone take 9 prefills and 9 x 6 steps.
    assert gen.stats.prefill_calls < 9 and gen.stats.decode_steps < 9 * 6, gen.stats
    for i, turns in got.items():
        assert [s.completion_ids for s in turns] == [s.completion_ids for s in alone[i]], i
        assert [s.prompt_ids for s in turns] == [s.prompt_ids for s in alone[i]], i
    assert not gen.conversations


def test_a_continuation_past_the_context_ends_truncated_and_rows_are_freed(model):
    cap = 40
    gen = Generator(model, config=GeneratorConfig(max_batch=4, max_seq_len=cap, check_every=3))
    params = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=())
    ((s,),) = gen.generate([[1, 2, 3]], params, keep=True)
    (t,) = gen.continue_([s.conversation], [[7] * 20], params)  # 33 tokens: 7 positions left
    assert t.finish_reason == "length" and len(t.completion_ids) == cap - 33
    assert len(t.conversation.ids) == cap and t.conversation.open
    (u,) = gen.continue_([t.conversation], [[]], params)  # not even one new token fits
    assert u.finish_reason == "truncated" and u.completion_ids == [] and u.logprobs == []
    assert not u.conversation.open and gen.stats.truncated == 1 and not gen.conversations
    gen.release(u.conversation)  # a closed conversation: nothing to do

    # Many trajectories through 4 rows, ending every way: released, last turn with
    # keep=False, truncated. No row stays held.
    done = {"released": 0, "last": 0, "truncated": 0}
    for r in range(12):
        p = SamplingParams(temperature=1.0, max_new_tokens=5, seed=r, stop_token_ids=())
        groups = gen.generate([[r + 1, 3], [r + 2]], [p, p], keep=True)
        convs = [g[0].conversation for g in groups]
        assert len(gen.conversations) == 2
        how = ["released", "last", "truncated"][r % 3]
        if how == "released":
            for c in convs:
                gen.release(c)
        elif how == "last":
            ends = gen.continue_(convs, [[5], [6, 6]], p, keep=False)
            assert all(e.finish_reason == "length" and not e.conversation.open for e in ends)
        else:
            ends = gen.continue_(convs, [[5] * cap, [6] * 34], p)
            assert [e.finish_reason for e in ends] == ["truncated", "truncated"]
        done[how] += 1
        assert not gen.conversations, (r, how)
    assert gen.stats.truncated == 1 + 2 * done["truncated"]
    # Every row is free again: a full group fits.
    (group,) = gen.generate([[1]], SamplingParams(n=4, max_new_tokens=3))
    assert len(group) == 4


def test_bad_continuations(model):
    gen = Generator(model, config=GeneratorConfig(max_batch=3, max_seq_len=64))
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    ((s,),) = gen.generate([[1, 2]], params, keep=True)
    c = s.conversation
    with pytest.raises(ValueError, match="a continuation takes n=1"):
        gen.generate([Continuation(c, [3])], SamplingParams(n=2))
    with pytest.raises(ValueError, match="running a turn or waiting for one"):
        gen.generate([Continuation(c, [3]), Continuation(c, [4])], params)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.continue_([c], [[10_000]])
    with pytest.raises(ValueError, match="not held by this generator"):
        Generator(model, config=GeneratorConfig(max_batch=1)).continue_([c], [[3]])
    with pytest.raises(ValueError, match="keep=True holds a cache row per sample"):
        gen.generate([[1], [2], [3]], params, keep=True)  # 2 rows free, 3 samples
    with pytest.raises(ValueError, match="n=3 samples need as many free cache rows"):
        gen.generate([[1]], SamplingParams(n=3, max_new_tokens=4))
    with pytest.raises(ValueError, match="1 conversations but 2 observations"):
        gen.continue_([c], [[1], [2]])
    # Nothing was claimed by the refused calls: the conversation goes on, then closes.
    (t,) = gen.continue_([c], [[3]], params, keep=False)
    assert t.prompt_ids == s.prompt_ids + s.completion_ids + [3] and not c.open
    with pytest.raises(ValueError, match="the conversation is closed"):
        gen.continue_([c], [[3]])
    # A stream whose kept rows fill the cache while a request still waits.
    feed = iter([([[1], [2]], params), ([[3], [4]], params)])
    with pytest.raises(RuntimeError, match="held by kept conversations"):
        list(gen.stream(lambda idle: next(feed, Generator.END), keep=True))
    assert len(gen.conversations) == 3  # the caller releases them
    for c in gen.conversations:
        gen.release(c)
    (group,) = gen.generate([[1]], SamplingParams(n=3, max_new_tokens=2))
    assert len(group) == 3
    # A stream abandoned while a continuation waits (behind a request with no free row):
    # the conversation can be continued later.
    ((s,),) = gen.generate([[1, 2]], params, keep=True)
    feed = iter([([[1], [2]], params), ([[3], Continuation(s.conversation, [5])], params)])
    stream = gen.stream(lambda idle: next(feed, Generator.END))
    assert len(next(stream)) == 2
    stream.close()
    (t,) = gen.continue_([s.conversation], [[5]], params, keep=False)
    assert t.prompt_ids == s.prompt_ids + s.completion_ids + [5] and not gen.conversations
