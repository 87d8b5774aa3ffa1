"""Asynchronous mode: the schedule's staleness bound, the generator's in-flight weight switch
and its per-token version stamps, the per-token correction, bad input, and `tidal rl` runs
in async mode (tests/rl/loop_configs.py:tiny, as the sync loop tests)."""

from __future__ import annotations

import math

import pytest
import torch

import tidal.store
from tests.generate.conftest import tiny_model
from tests.rl._cli import NO_PLOT, records, run_rl
from tidal.generate import Generator, GeneratorConfig, SamplingParams
from tidal.rl.config import LoopConfig
from tidal.rl.distributed.prefetch import Stager
from tidal.rl.distributed.schedule import AsyncSchedule, SyncSchedule
from tidal.rl.loss import LossConfig, policy_loss
from tidal.rl.report import ASYNC_FIELDS
from tidal.rl.rollout import RolloutBatch
from tidal.rl.tasks.base import Grade

# -- the schedule ------------------------------------------------------------------------


def test_the_schedule_bounds_staleness_per_token():
    s = AsyncSchedule(steps=10, max_staleness=1)
    # Step 5: the trainer holds version 4; tokens of versions 3 and 4 are allowed.
    versions = torch.tensor([[4, 4, -1], [3, 4, 4], [2, 3, 3], [3, -1, -1], [-1, -1, -1]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 0, 0]]).bool()
    assert s.oldest_version(5) == 3
    # Row 2 has one token of version 2 (too old); row 4 is unversioned (-1): both dropped.
    assert s.stale_samples(versions, mask, 5).tolist() == [False, False, True, False, True]
    keep = ~s.stale_samples(versions, mask, 5)
    assert s.histogram(versions[keep], mask[keep], 5) == [4, 2]  # lag 0: four tokens, lag 1: two
    assert SyncSchedule(10).oldest_version(5) == 4
    assert AsyncSchedule(10, 0).stale_samples(versions, mask, 5).tolist() == [
        False,
        True,
        True,
        True,
        True,
    ]


# -- the generator's in-flight switch ----------------------------------------------------


def _copy(model):
    m = tiny_model()
    m.load_state_dict(model.state_dict())
    return m


def test_a_sequence_spanning_two_versions_is_stamped_per_token():
    """Version 0 (seed 0) is live, version 1 (seed 1) is prefetched by the Stager from the
    store; the Generator swaps it in at its first host check, mid-sequence: the tokens before
    are version 0's (equal to a run without the swap), the ones after carry version 1, and
    the live weights are then version 1's."""
    v0, v1 = tiny_model(seed=0), tiny_model(seed=1)
    live = _copy(v0)
    cfg = GeneratorConfig(max_batch=4, max_seq_len=64, check_every=4)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=12)
    prompt = [[3, 1, 4, 1, 5]]
    (plain,) = Generator(_copy(v0), config=cfg).generate(prompt, params)

    with tidal.store.connect() as store:
        store.put_state_dict(v0.state_dict(), "policy", version=0)
        store.put_state_dict(v1.state_dict(), "policy", version=1)
        gen = Generator(live, config=cfg)
        gen.version = 0
        stager = Stager(store, "policy", live.state_dict(), held=0, last=1, slice_s=0.1)
        stager.start()
        try:
            assert stager.wait_staged(30) == 1
            gen.swap_hook = stager.swap
            (group,) = gen.generate(prompt, params)
        finally:
            stager.close()
    # Prefill gives token 0, the first 4 decode steps tokens 1-4, then the host check swaps.
    for s, ref in zip(group, plain, strict=True):
        assert s.versions == [0] * 5 + [1] * 7
        assert s.weight_version == 0
        assert s.completion_ids[:5] == ref.completion_ids[:5]
        assert s.logprobs[:5] == pytest.approx(ref.logprobs[:5], abs=1e-5)
    assert [s.completion_ids for s in group] != [s.completion_ids for s in plain]
    assert gen.version == 1 and gen.stats.weight_swaps == 1 and stager.swaps == 1
    for name, w in v1.state_dict().items():
        assert torch.equal(live.state_dict()[name], w), name
    batch = RolloutBatch.from_samples(
        group, [Grade(reward=0.0, answer=None, format_ok=True)] * 2, task="t"
    )
    assert batch.versions.tolist() == [[0] * 5 + [1] * 7] * 2


def test_prefetch_hits_and_misses_are_counted_at_batch_starts():
    model = tiny_model()
    with tidal.store.connect() as store:
        store.put_state_dict(model.state_dict(), "policy", version=0)
        stager = Stager(store, "policy", model.state_dict(), held=0, last=4, slice_s=0.1)
        assert stager.at_batch_start() is None  # nothing newer: not a need
        assert (stager.hits, stager.misses) == (0, 0)
        store.put_state_dict(model.state_dict(), "policy", version=1)
        assert stager.at_batch_start() is None  # newer, not staged (the thread is not running)
        assert (stager.hits, stager.misses) == (0, 1)
        stager.start()
        try:
            assert stager.wait_staged(30) == 1
            # The thread holds version 1 staged until it is swapped in; meanwhile 2 and 3 come.
            store.put_state_dict(model.state_dict(), "policy", version=2)
            store.put_state_dict(model.state_dict(), "policy", version=3)
            assert stager.at_batch_start() == 1  # swapped in, but the batch starts behind 3
            assert (stager.hits, stager.misses, stager.held) == (0, 2, 1)
            # The newest committed version is staged next, skipping 2, and swapped in between
            # decode steps of the batch: the next batch starts on the newest version, a hit.
            assert stager.wait_staged(30) == 3 and stager.swap() == 3
            assert stager.at_batch_start() is None
            assert (stager.hits, stager.misses) == (1, 2)
            assert stager.at_batch_start() is None  # nothing new since: not a need
            assert (stager.hits, stager.misses) == (1, 2)
            store.put_state_dict(model.state_dict(), "policy", version=4)
            assert stager.wait_staged(30) == 4
            assert stager.at_batch_start() == 4  # staged in time, swapped in at the start
            assert (stager.hits, stager.misses) == (2, 2)
        finally:
            stager.close()


# -- the correction ----------------------------------------------------------------------


def _reference(new, old, gen, adv, mask, cfg):
    """policy_loss by hand, one token at a time: token-mean of -min(r A, clip(r) A) * w with
    w the truncated IS weight or the band's 0/1."""
    total, n = 0.0, 0
    for i in range(new.shape[0]):
        for t in range(new.shape[1]):
            if not mask[i, t]:
                continue
            r = torch.exp(new[i, t] - old[i, t])
            a = float(adv[i])
            pg = -torch.minimum(r * a, r.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * a)
            is_ratio = math.exp(float(old[i, t] - gen[i, t]))
            if cfg.tis_cap is not None:
                w = min(is_ratio, cfg.tis_cap)
            else:
                w = 1.0 if cfg.mask_low <= is_ratio <= cfg.mask_high else 0.0
            total, n = total + w * pg, n + 1
    return total / n


@pytest.mark.parametrize(
    "cfg", [LossConfig(tis_cap=1.5), LossConfig(mask_low=0.8, mask_high=1.25)], ids=["tis", "mask"]
)
def test_the_correction_is_applied_per_token(cfg):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    old = -torch.rand(B, T, generator=g) * 2  # the trainer's recomputation
    gen = old + 0.5 * torch.randn(B, T, generator=g)  # the generator's: a stale policy
    new = (old + 0.1 * torch.randn(B, T, generator=g)).requires_grad_()
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    mask = torch.rand(B, T, generator=g) > 0.2
    loss, metrics = policy_loss(new, old, adv, mask, cfg, gen_logprobs=gen)
    (grad,) = torch.autograd.grad(loss, new)
    ref_new = new.detach().clone().requires_grad_()
    ref = _reference(ref_new, old, gen, adv, mask, cfg)
    (ref_grad,) = torch.autograd.grad(ref, ref_new)
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    ratio = (old - gen).exp()[mask]
    if cfg.tis_cap is None:
        outside = ((ratio < cfg.mask_low) | (ratio > cfg.mask_high)).float().mean()
        assert 0 < float(outside) < 1  # the band did cut some tokens, not all
        assert float(metrics["is_masked_frac"]) == pytest.approx(float(outside))
        # A masked token gets no gradient.
        masked_tok = mask & ((old - gen).exp() > cfg.mask_high)
        assert bool(masked_tok.any()) and bool((grad[masked_tok] == 0).all())
    else:
        assert 0 < float(metrics["tis_capped_frac"]) < 1


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"mask_low": 0.5}, "set together"),
        ({"mask_low": 1.5, "mask_high": 2.0}, "mask_low must be in (0, 1]"),
        ({"mask_low": 0.5, "mask_high": 2.0, "tis_cap": 2.0}, "set one"),
    ],
)
def test_bad_mask_band(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        LossConfig(**kw)


# -- bad input ---------------------------------------------------------------------------


def test_max_staleness_below_zero_errors_clearly(tmp_path):
    with pytest.raises(ValueError, match=r"rl.max_staleness must be >= 0 .* got -1"):
        LoopConfig(mode="async", max_staleness=-1)
    r = run_rl(
        tmp_path / "run",
        "--rl.mode",
        "async",
        "--loss.tis_cap",
        "2",
        "--rl.max_staleness",
        "-1",
        timeout=60,
    )
    assert r.returncode == 2, r.stdout
    assert "tidal rl: error:" in r.stdout and "rl.max_staleness must be >= 0" in r.stdout
    assert "trainer:" not in r.stdout  # nothing started


def test_async_without_a_correction_and_a_queue_too_small_for_the_generators():
    from tests.rl.loop_configs import tiny
    from tidal.train.config_parse import apply_overrides

    with pytest.raises(ValueError, match="needs a per-token correction: set --loss.tis_cap"):
        apply_overrides(tiny(), ["--rl.mode", "async"])
    cfg = apply_overrides(
        tiny(),
        [
            "--rl.mode",
            "async",
            "--loss.tis_cap",
            "2",
            "--generator.count",
            "3",
            "--rl.queue_depth",
            "2",
        ],
    )
    warning = cfg.queue_warning()
    assert warning is not None
    assert "rl.queue_depth=2" in warning and "generator.count=3" in warning
    assert cfg.queue_slots() == 1
    assert apply_overrides(cfg, ["--rl.queue_depth", "6"]).queue_slots() == 2
    assert apply_overrides(cfg, ["--rl.queue_depth", "6"]).queue_warning() is None


# -- through `tidal rl` ------------------------------------------------------------------


def test_async_run_reward_rises_and_every_token_is_within_max_staleness(tmp_path):
    out = tmp_path / "run"
    r = run_rl(
        out,
        "--rl.mode",
        "async",
        "--loss.tis_cap",
        "2",
        "--rl.max_staleness",
        "2",
        "--rl.steps",
        "8",
        *NO_PLOT,
    )
    assert r.returncode == 0, r.stdout
    assert "async mode (max_staleness 2" in r.stdout
    steps, evals = records(out)
    assert [s["step"] for s in steps] == list(range(1, 9))
    for s in steps:
        missing = [f for f in ASYNC_FIELDS if f not in s]
        assert not missing, f"step {s['step']} lacks {missing}"
        assert s["samples_trained"] + s["stale_samples_dropped"] == 32
        assert len(s["staleness_hist"]) == 3
        if s["samples_trained"]:
            # Every trained token is at most max_staleness versions behind version s - 1.
            assert s["step"] - 1 - s["version_min"] <= 2, s
            assert s["version_max"] <= s["step"] - 1, s
            assert 0 < sum(s["staleness_hist"]) <= 32 * 8
            assert "tis_weight_mean" in s
        assert 0 <= s["trainer_idle_frac"] <= 1 and 0 <= s["generator_idle_frac"] <= 1
        assert s["prefetch_hit_rate"] is None or 0 <= s["prefetch_hit_rate"] <= 1
    assert sum(s["samples_trained"] for s in steps) >= 4 * 32  # most of it was used
    first = sum(s["reward_mean"] for s in steps[:2]) / 2
    last = sum(s["reward_mean"] for s in steps[-2:]) / 2
    assert last > first + 0.3, [round(s["reward_mean"], 3) for s in steps]
    assert {0, 8} <= {e["step"] for e in evals}
    assert "stale dropped" in r.stdout and "prefetch hit" in r.stdout


def test_two_batches_in_flight_keep_every_token_within_max_staleness(tmp_path):
    """The generator may decode two batches at once (the next one's groups take the rows the
    current one frees): every trained token is still within max_staleness, nothing is lost,
    and generator 0 still evaluates the first and the last version."""
    out = tmp_path / "run"
    r = run_rl(
        out,
        "--rl.mode",
        "async",
        "--loss.tis_cap",
        "2",
        "--rl.max_staleness",
        "3",
        "--rl.batches_in_flight",
        "2",
        "--rl.steps",
        "6",
        "--rl.eval_every",
        "3",
        "--generator.max_batch",
        "64",
        *NO_PLOT,
    )
    assert r.returncode == 0, r.stdout
    assert "queue 1 batch(es) per generator, 2 in flight" in r.stdout
    steps, evals = records(out)
    assert [s["step"] for s in steps] == list(range(1, 7))
    for s in steps:
        assert s["samples_trained"] + s["stale_samples_dropped"] == 32
        if s["samples_trained"]:
            assert s["step"] - 1 - s["version_min"] <= 3 and s["version_max"] <= s["step"] - 1
    assert sum(s["samples_trained"] for s in steps) >= 4 * 32
    # Batch 2 is fed while batch 1 decodes (its slot is free from the start); later ones
    # wait for the trainer here, where generation is faster than training.
    assert sum(s["batches_overlapped"] for s in steps) >= 1
    assert {0, 6} <= {e["step"] for e in evals}


def test_batches_in_flight_below_one_is_refused():
    with pytest.raises(ValueError, match="rl.batches_in_flight must be >= 1, got 0"):
        LoopConfig(batches_in_flight=0)


def test_forced_staleness_drops_and_counts_samples(tmp_path):
    """max_staleness 0 with two queue slots: the generator starts batch 2 with version 0
    right after putting batch 1, long before the trainer can publish version 1, so step 2
    (which trains at version 1) must drop samples; they are counted, and none of a too-old
    version is trained on. The correction here is the mask band."""
    out = tmp_path / "run"
    r = run_rl(
        out,
        "--rl.mode",
        "async",
        "--loss.mask_low",
        "0.5",
        "--loss.mask_high",
        "2",
        "--rl.max_staleness",
        "0",
        "--rl.queue_depth",
        "2",
        "--rl.steps",
        "4",
        *NO_PLOT,
    )
    assert r.returncode == 0, r.stdout
    steps, _ = records(out)
    assert len(steps) == 4
    assert steps[1]["stale_samples_dropped"] > 0
    total = 0
    for s in steps:
        total += s["stale_samples_dropped"]
        assert s["stale_samples_dropped_total"] == total
        assert s["stale_dropped_frac"] == pytest.approx(s["stale_samples_dropped"] / 32)
        if s["samples_trained"]:
            assert s["version_min"] == s["version_max"] == s["step"] - 1
            assert "is_masked_frac" in s
        else:  # nothing left: no optimizer step, the version still advances
            assert s["tokens_per_s_train"] == 0.0


def test_async_with_two_trainer_ranks_and_two_generators(tmp_path):
    """Two trainer ranks (FSDP over gloo) take the same rollouts each step (rank 0 chooses
    and announces them), from two generators whose batches arrive in any order."""
    out = tmp_path / "run"
    r = run_rl(
        out,
        "--rl.mode",
        "async",
        "--loss.tis_cap",
        "2",
        "--rl.max_staleness",
        "3",
        "--rl.steps",
        "3",
        "--generator.count",
        "2",
        "--nproc",
        "2",
        *NO_PLOT,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout
    assert "world 2 (dp_shard=2)" in r.stdout
    steps, _ = records(out)
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["samples_trained"] + s["stale_samples_dropped"] == 32  # 2 batches of 16
