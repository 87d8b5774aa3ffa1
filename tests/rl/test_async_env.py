"""Async mode with an environment: between rounds of turns the generator switches to the
newest staged policy version (`Feed.between_rounds`), so a trajectory spans versions, each
sampled token stamped with (and log-probs from) the version that sampled it; the intake's
staleness bound and the loss's correction read those per-token versions, and observation
tokens (version -1, masked out) never count as stale. The whole run is in
tests/rl/test_env_loop.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import tidal.store
from tests.generate.conftest import tiny_model
from tests.rl.test_envs import encoder, tok  # noqa: F401 (fixtures)
from tidal.generate import Generator, GeneratorConfig
from tidal.generate.scoring import logprobs
from tidal.rl.config import RolloutConfig
from tidal.rl.distributed.async_generator import Feed
from tidal.rl.distributed.intake import drop_stale
from tidal.rl.distributed.prefetch import Stager
from tidal.rl.distributed.schedule import AsyncSchedule
from tidal.rl.envs import FromCache, get_env, resubmit, sample_env_batch
from tidal.rl.loss import LossConfig, group_advantages
from tidal.rl.trainer_inputs import rollout_batches


def _turns(mask: list[bool]) -> list[list[int]]:
    """The positions of each sampled turn: runs of True."""
    runs: list[list[int]] = []
    for k, m in enumerate(mask):
        if m and (k == 0 or not mask[k - 1]):
            runs.append([])
        if m:
            runs[-1].append(k)
    return runs


@pytest.mark.parametrize("engine", ["cache", "resubmit"])
def test_a_trajectory_spans_versions_at_a_turn_boundary(encoder, engine):  # noqa: F811
    """`cache` (FromCache, the default engine): the turns after the switch continue over the
    keys and values version 0 wrote, so their log-probs are those sampled with, not a clean
    version-1 forward's; `resubmit` prefills each turn again, so they are exactly version 1's."""
    v0, v1 = tiny_model(seed=0, max_seq_len=256), tiny_model(seed=1, max_seq_len=256)
    live = tiny_model(seed=0, max_seq_len=256)
    gen = Generator(live, config=GeneratorConfig(max_batch=8, max_seq_len=256))
    gen.version = 0
    stop = tuple(encoder.tokenizer.encode(encoder.stop_text, special_tokens=True))
    policy = SimpleNamespace(
        encoder=encoder, pad_id=0, max_prompt_tokens=96, generator=gen, stop=stop
    )
    cfg = SimpleNamespace(
        rollout=RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=6, temperature=1.0)
    )
    env = get_env("guess", high=50, max_turns=3)
    with tidal.store.connect() as store:
        store.put_state_dict(v0.state_dict(), "policy", version=0)
        store.put_state_dict(v1.state_dict(), "policy", version=1)
        stager = Stager(store, "policy", live.state_dict(), held=0, last=1, slice_s=0.1)
        stager.start()
        try:
            assert stager.wait_staged(30) == 1  # staged before the batch: swapped after turn 0
            feed = Feed(
                policy=policy,  # type: ignore[arg-type]
                task=env,
                link=None,  # type: ignore[arg-type]
                cfg=cfg,  # type: ignore[arg-type]
                stager=stager,
                index=0,
                main=True,
                number=0,
                first=1,
                first_step=0,
                log=print,
                evals=set(),
            )
            batch = sample_env_batch(
                policy,  # type: ignore[arg-type]
                env,
                cfg,  # type: ignore[arg-type]
                seeds=(0, 0, 1, 0),
                n_prompts=2,
                generate_turn=FromCache(gen) if engine == "cache" else resubmit(gen),
                between_rounds=feed.between_rounds,
            )
        finally:
            stager.close()
    assert gen.version == 1 and stager.swaps == 1
    assert gen.conversations == []  # every cache row freed (FromCache)
    for name, w in v1.state_dict().items():
        assert torch.equal(live.state_dict()[name], w), name

    # Per token: turn 0 of version 0, the later turns of version 1, observations -1; the
    # log-probs are those of the version that sampled each token.
    ids = batch.token_ids()
    with torch.no_grad():
        lp0, lp1 = (logprobs(m, ids) for m in (v0, v1))
    spanning = 0
    for i in range(batch.num_samples):
        p, c = int(batch.prompt_lens[i]), int(batch.completion_mask[i].sum())
        mask = batch.loss_mask[i, :c].tolist()
        versions = batch.versions[i, :c].tolist()
        turns = _turns(mask)
        assert all(versions[k] == -1 for k in range(c) if not mask[k])
        for t, positions in enumerate(turns):
            want, lp = (0, lp0) if t == 0 else (1, lp1)
            assert [versions[k] for k in positions] == [want] * len(positions)
            got = batch.logprobs[i, positions]
            at = [p - 1 + k for k in positions]
            if t == 0 or engine == "resubmit":
                torch.testing.assert_close(got, lp[i, at], atol=1e-4, rtol=0)
            else:  # sampled with version 1's weights, over version 0's cache
                assert (got - lp0[i, at]).abs().max() > 1e-3
        spanning += len(turns) > 1
    assert spanning >= 2, "the random policy should rarely win the game at its first guess"

    # The intake: step 2 (the trainer holds version 1). max_staleness 1 keeps every
    # trajectory (observations at -1 are not stale), the histogram counts sampled tokens
    # only; max_staleness 0 drops every trajectory with a version-0 turn.
    sampled = batch.loss_mask
    n1 = int(((batch.versions == 1) & sampled).sum())
    n0 = int(((batch.versions == 0) & sampled).sum())
    assert n0 + n1 == int(sampled.sum()) and n1 > 0
    assert bool(((batch.versions == -1) & batch.completion_mask).any())
    kept, info = drop_stale(batch, AsyncSchedule(steps=5, max_staleness=1), step=2)
    assert kept is batch and info["stale_samples_dropped"] == 0
    assert info["staleness_hist"] == [n1, n0]
    assert (info["version_min"], info["version_max"]) == (0, 1)
    kept, info = drop_stale(batch, AsyncSchedule(steps=5, max_staleness=0), step=2)
    assert kept is None and info["stale_samples_dropped"] == batch.num_samples

    # The correction: its per-token IS ratio exp(old - gen), with the trainer at version 1,
    # is 1 on version-1 tokens and off 1 on version-0 ones.
    adv = group_advantages(batch.rewards, batch.group_ids, LossConfig(drop_equal_groups=False))
    old = torch.zeros_like(batch.logprobs)
    for i in range(batch.num_samples):
        p, c = int(batch.prompt_lens[i]), int(batch.completion_mask[i].sum())
        old[i, :c] = lp1[i, p - 1 : p - 1 + c]
    (b,) = rollout_batches(batch, adv, old_logprobs=old, micro_batch_size=batch.num_samples)
    ratio = (b.extras["old_logprobs"] - b.extras["gen_logprobs"]).exp()
    v_NT = torch.full_like(b.extras["mask"], -1, dtype=torch.int64)
    for i in range(batch.num_samples):
        p, c = int(batch.prompt_lens[i]), int(batch.completion_mask[i].sum())
        v_NT[i, p - 1 : p - 1 + c] = batch.versions[i, :c]
    m = b.extras["mask"]
    assert torch.equal(m, (v_NT >= 0))
    if engine == "resubmit":
        assert ratio[m & (v_NT == 1)].sub(1).abs().max() < 1e-3
    assert ratio[m & (v_NT == 0)].sub(1).abs().max() > 1e-2
