"""An environment through the RL loop as the user runs it: `tidal rl --task.name guess` (a
multi-turn game) trains and reports, in sync mode (grpo.py in one process takes the same
steps) and in async mode, and bad environment settings stop the run before any role
starts."""

from __future__ import annotations

import pytest

from tests.rl._cli import CONFIG, NO_PLOT, records, run_module, run_rl, tidal_rl
from tidal.rl.report import ASYNC_FIELDS

GUESS = [
    "--config",
    CONFIG,
    "--task.name",
    "guess",
    "--task.params",
    '{"high": 50, "max_turns": 3}',
    "--task.eval_problems",
    "4",
    "--rollout.max_prompt_tokens",
    "96",
    "--rollout.max_context",
    "256",
    "--rl.steps",
    "2",
    "--rl.eval_every",
    "0",
    *NO_PLOT,
]


def test_tidal_rl_and_grpo_train_on_a_multi_turn_environment_alike(tmp_path):
    out = tmp_path / "run"
    r = tidal_rl(*GUESS, "--job.output_dir", str(out), timeout=300)
    assert r.returncode == 0, r.stdout
    steps, evals = records(out)
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["grader_errors"] == 0 for s in steps)
    # several turns: observations between the sampled turns (at most 8 tokens each)
    assert all(8 < s["sampled_len_mean"] < s["response_len_mean"] for s in steps)
    assert all(1 < s["turns_mean"] <= 3 and s["tool_calls_mean"] == 0 for s in steps)
    assert [e["step"] for e in evals] == [0, 2] and evals[0]["eval_total"] == 4
    assert all(1 <= e["eval_turns_mean"] <= 3 for e in evals)

    # the loop in one process plays the same trajectories and takes the same steps
    one = tmp_path / "grpo"
    p = run_module("tidal.rl.grpo", *GUESS, "--job.output_dir", str(one))
    assert p.returncode == 0, p.stdout + p.stderr
    a, a_evals = records(one)
    for x, y in zip(a, steps, strict=True):
        for field in ("reward_mean", "response_len_mean", "sampled_len_mean", "turns_mean"):
            assert x[field] == pytest.approx(y[field], abs=1e-6), (field, x, y)
        assert (x["loss"] is None) == (y["loss"] is None)
        if x["loss"] is not None:
            assert x["loss"] == pytest.approx(y["loss"], abs=1e-6)
    assert [e["eval_correct"] for e in a_evals] == [e["eval_correct"] for e in evals]


def test_async_run_on_a_multi_turn_environment(tmp_path):
    """`--rl.mode async` plays the environment's batches whole, switching weights between
    rounds of turns: the run completes, every trained token is within max_staleness, and the
    per-token versions reach the records."""
    out = tmp_path / "run"
    args = [*GUESS, "--rl.steps", "3", "--rl.mode", "async", "--loss.tis_cap", "2"]
    r = tidal_rl(*args, "--rl.max_staleness", "2", "--job.output_dir", str(out), timeout=300)
    assert r.returncode == 0, r.stdout
    assert "async mode (max_staleness 2" in r.stdout
    steps, evals = records(out)
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        missing = [f for f in ASYNC_FIELDS if f not in s]
        assert not missing, f"step {s['step']} lacks {missing}"
        assert s["samples_trained"] + s["stale_samples_dropped"] == 32
        assert s["grader_errors"] == 0 and 1 < s["turns_mean"] <= 3
        assert 8 < s["sampled_len_mean"] < s["response_len_mean"]
        if s["samples_trained"]:
            assert s["step"] - 1 - s["version_min"] <= 2 and s["version_max"] <= s["step"] - 1
        if s["stale_samples_dropped"] == 0:
            # the histogram counts sampled tokens only (observations are not trained on)
            assert sum(s["staleness_hist"]) == round(s["sampled_len_mean"] * 32)
    assert [e["step"] for e in evals] == [0, 3]
    assert all(1 <= e["eval_turns_mean"] <= 3 for e in evals)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # the opening with the calc tool's listing: checked before any role starts
        (["--task.name", "calculator"], "over rollout.max_prompt_tokens=32"),
        (["--task.name", "guess", "--task.params", '{"size": 3}'], "has no parameter 'size'"),
        (
            ["--task.name", "gues"],
            "or an environment: ['calculator', 'guess', 'python', 'verifiers']",
        ),
    ],
)
def test_bad_environment_settings_fail_before_any_role_starts(tmp_path, args, message):
    r = run_rl(tmp_path / "run", *args)
    assert r.returncode == 2, r.stdout
    assert "tidal rl: error:" in r.stdout and message in r.stdout
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
