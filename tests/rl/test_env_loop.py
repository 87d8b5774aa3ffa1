"""An environment through the RL loop as the user runs it: `tidal rl --task.name guess` (a
multi-turn game) trains and reports, and environments refuse async mode before any work."""

from __future__ import annotations

from tests.rl.test_loop import CONFIG, records, tidal_rl


def test_tidal_rl_trains_on_a_multi_turn_environment(tmp_path):
    out = tmp_path / "run"
    r = tidal_rl(
        "--config",
        CONFIG,
        "--job.output_dir",
        str(out),
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
        "--metrics.plot",
        "false",
        timeout=300,
    )
    assert r.returncode == 0, r.stdout
    steps, evals = records(out)
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["grader_errors"] == 0 for s in steps)
    # several turns: observations between the sampled turns (at most 8 tokens each)
    assert all(8 < s["sampled_len_mean"] < s["response_len_mean"] for s in steps)
    assert [e["step"] for e in evals] == [0, 2] and evals[0]["eval_total"] == 4


def test_an_environment_in_async_mode_is_refused(tmp_path):
    r = tidal_rl(
        "--config",
        CONFIG,
        "--job.output_dir",
        str(tmp_path / "run"),
        "--task.name",
        "guess",
        "--rl.mode",
        "async",
        "--loss.tis_cap",
        "2.0",
    )
    assert r.returncode != 0
    assert "environment 'guess' runs in rl.mode sync only" in r.stdout
