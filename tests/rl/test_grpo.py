"""tidal/rl/grpo.py (the loop in one process) is the algorithm `tidal rl` runs as processes:
3 steps of `rl_addition`, shrunk (a tiny SFT warm start, 1-digit sums, 4 prompts), through
`python -m tidal.rl.grpo` and through `tidal rl` in sync mode, with the same config and
seeds, give the same per-step rewards and losses."""

from __future__ import annotations

import pytest

from tests.rl._cli import NO_PLOT, records, run_module, tidal_rl


def overrides(cache_dir, out) -> list[str]:
    return [
        "--config",
        "rl_addition",
        # A warm start that writes answers now and then: groups with a reward to learn from.
        "--policy.sft_overrides",
        "model.flavor=tiny training.steps=40 training.seq_len=128 data.num_problems=2000 "
        "metrics.val_every=0",
        "--policy.cache_dir",
        str(cache_dir),
        "--task.params",
        '{"digits": [1, 1]}',
        "--task.eval_problems",
        "4",
        "--rollout.prompts_per_step",
        "6",
        "--rollout.max_new_tokens",
        "48",
        "--rl.steps",
        "3",
        "--rl.eval_every",
        "0",
        "--job.device",
        "cpu",
        "--generator.device",
        "cpu",
        "--checkpoint.enable",
        "false",
        *NO_PLOT,
        "--job.output_dir",
        str(out),
    ]


def test_grpo_in_one_process_matches_tidal_rl_step_by_step(tmp_path, cache_dir):
    one = tmp_path / "grpo"
    p = run_module("tidal.rl.grpo", *overrides(cache_dir, one))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "step    3/3 reward" in p.stdout
    procs = tmp_path / "tidal_rl"
    r = tidal_rl(*overrides(cache_dir, procs), timeout=240)  # reuses the cached warm start
    assert r.returncode == 0, r.stdout

    (a, a_evals), (b, b_evals) = records(one), records(procs)
    assert [s["step"] for s in a] == [s["step"] for s in b] == [1, 2, 3]
    trained = [s for s in a if s["loss"] is not None]
    assert trained, "no step had a group with a reward to learn from: the test checks nothing"
    for x, y in zip(a, b, strict=True):
        for field in ("reward_mean", "reward_std", "response_len_mean", "samples", "groups"):
            assert x[field] == pytest.approx(y[field], abs=1e-6), (field, x, y)
        assert x["groups_dropped"] == y["groups_dropped"]
        for field in ("loss", "entropy", "clip_frac", "ratio_max", "ratio_min"):
            if x[field] is None or y[field] is None:
                assert x[field] is y[field], (field, x, y)
            else:
                assert x[field] == pytest.approx(y[field], abs=1e-6), (field, x, y)
    evals = [sorted((e["step"], e["eval_correct"]) for e in x) for x in (a_evals, b_evals)]
    assert evals[0] == evals[1] and [v for v, _ in evals[0]] == [0, 3]


def test_grpo_takes_tidal_rl_configs_and_refuses_what_needs_processes(capsys):
    from tidal.rl.grpo import main

    assert main(["--config", "rl_addition", "--print-config", "--rl.steps", "7"]) == 0
    assert '"steps": 7' in capsys.readouterr().out
    assert main(["--config", "rl_addition", "--rl.mode", "async", "--loss.tis_cap", "2"]) == 2
    assert "grpo.py runs the synchronous loop" in capsys.readouterr().err
    assert main(["--config", "rl_addition", "--generator.tp", "2"]) == 2
    assert "tensor-parallel generators run under tidal rl" in capsys.readouterr().err
    assert main(["--config", "nope"]) == 2
    assert "unknown RL config 'nope'" in capsys.readouterr().err
