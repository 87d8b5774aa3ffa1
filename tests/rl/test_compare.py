"""tidal.rl.compare: two runs' metrics.jsonl side by side."""

import json

import pytest

from tidal.rl.compare import main, run_figures


def _write(folder, records):
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")


def test_compare_reads_mode_speed_and_pass1(tmp_path, capsys):
    _write(
        tmp_path / "sync",
        [
            {"step": 0, "eval_pass1": 0.4},
            {"step": 1, "reward_mean": 0.1, "elapsed_s": 30.0},
            {"step": 2, "reward_mean": 0.2, "elapsed_s": 60.0},
            {"step": 2, "eval_pass1": 0.7},
        ],
    )
    _write(
        tmp_path / "async",
        [
            {"step": 1, "reward_mean": 0.1, "elapsed_s": 20.0, "stale_samples_dropped": 0},
            {"step": 2, "eval_pass1": 0.6},
            {"step": 0, "eval_pass1": 0.4},
            {"step": 2, "reward_mean": 0.3, "elapsed_s": 40.0, "stale_samples_dropped": 1},
        ],
    )
    s, a = run_figures(tmp_path / "sync"), run_figures(tmp_path / "async")
    assert (s["mode"], s["steps"], s["steps_per_min"]) == ("sync", 2, pytest.approx(2.0))
    assert (a["mode"], a["steps_per_min"]) == ("async", pytest.approx(3.0))
    assert (a["pass1_before"], a["pass1_after"]) == (0.4, 0.6)  # in step order
    assert main([str(tmp_path / "sync"), str(tmp_path / "async")]) == 0
    out = capsys.readouterr().out
    assert "40.0% -> 70.0%" in out and "40.0% -> 60.0%" in out


def test_compare_names_a_missing_or_empty_run(tmp_path, capsys):
    assert main([str(tmp_path / "nothing")]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().out
    _write(tmp_path / "empty", [{"step": 0, "eval_pass1": 0.4}])
    with pytest.raises(ValueError, match="holds no RL step"):
        run_figures(tmp_path / "empty")
