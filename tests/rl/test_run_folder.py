"""`tidal rl` against the run folder it is given, decided before any role starts: a folder
that is a file, a finished run run again, a resume to a step already reached, a resume that
goes on, and a fresh run in a folder holding an earlier run's metrics."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from tests.rl._cli import records, run_rl
from tidal.rl.config import RLConfig
from tidal.rl.report import check_resume_step, check_run_folder, summarize, summary_line
from tidal.train.run_folder import read_records

NO_ROLE = ("generator 0: on", "trainer:")  # what a started role prints first


def _one_error(stdout: str, expected: str) -> None:
    lines = [x for x in stdout.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("tidal rl: error: "), stdout
    assert expected in lines[0], lines[0]


def test_an_output_dir_that_is_a_file_is_one_line_and_status_2(tmp_path):
    """The same check, and the same line, as `tidal train`'s (tidal/train/run_folder.py)."""
    (tmp_path / "a_file").write_text("")
    r = run_rl(tmp_path / "a_file", timeout=60)
    assert r.returncode == 2, r.stdout
    _one_error(
        r.stdout, f"job.output_dir '{tmp_path / 'a_file'}' is a file; it must be a directory"
    )


def test_a_finished_run_is_reported_and_a_resume_to_a_reached_step_refused(tmp_path):
    out = tmp_path / "run"
    r = run_rl(out, "--rl.steps", "2", "--rl.eval_every", "2", "--checkpoint.enable", "true")
    assert r.returncode == 0, r.stdout
    files = {name: (out / name).read_bytes() for name in ("rl.png", "metrics.jsonl")}
    steps, evals = records(out)
    want = summary_line(summarize(steps, evals))
    assert "held-out pass@1" in want and want in r.stdout  # the run's own summary line

    # Run again: the finished run's figures, from its metrics.jsonl; no role starts.
    r = run_rl(out, "--rl.steps", "2", "--rl.eval_every", "2", "--checkpoint.enable", "true")
    assert r.returncode == 0, r.stdout
    assert f"tidal rl: the run in {out} is finished (step 2 of rl.steps=2)" in r.stdout
    assert want in r.stdout and f"plot: {out / 'rl.png'}" in r.stdout
    assert not any(x in r.stdout for x in NO_ROLE), r.stdout
    assert {name: (out / name).read_bytes() for name in files} == files  # nothing overwritten

    # A resume to a step already passed: one line, status 2, no wait.
    start = time.monotonic()
    r = run_rl(out, "--rl.steps", "1", "--checkpoint.enable", "true", timeout=60)
    assert r.returncode == 2, r.stdout
    _one_error(r.stdout, "holds a run at step 2, past rl.steps=1")
    assert "--rl.steps above 2" in r.stdout
    assert time.monotonic() - start < 60
    assert {name: (out / name).read_bytes() for name in files} == files

    # A resume with steps left goes on from the checkpoint, appending to metrics.jsonl.
    r = run_rl(out, "--rl.steps", "3", "--rl.eval_every", "0", "--checkpoint.enable", "true")
    assert r.returncode == 0, r.stdout
    assert "steps 3..3" in r.stdout
    assert [s["step"] for s in records(out)[0]] == [1, 2, 3]
    assert [r["step"] for r in read_records(out) if "reward_mean" in r] == [1, 2, 3]


def test_a_fresh_run_refuses_an_earlier_runs_folder_before_any_role_starts(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    r = run_rl(out, "--checkpoint.enable", "false", timeout=60)
    assert r.returncode == 2, r.stdout
    _one_error(r.stdout, "holds an earlier run (metrics.jsonl has 1 records)")
    assert not any(x in r.stdout for x in NO_ROLE)


def test_the_run_folder_checks_in_process(tmp_path):
    """check_run_folder decides from the folder alone: a checkpoint at rl.steps is a finished
    run (reported from the records that stand after a resume), one past it an error."""
    cfg = RLConfig()
    cfg.job.output_dir = str(tmp_path)
    cfg.rl.steps = 2
    assert check_run_folder(cfg, prog="tidal rl", log=lambda line: None) is False  # a fresh run
    step = tmp_path / "checkpoint" / "step-2"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")  # the marker of a complete checkpoint
    rows = [
        {"step": 0, "eval_pass1": 0.25, "eval_correct": 1, "eval_total": 4, "eval_s": 1.0},
        {"step": 1, "reward_mean": 0.1, "elapsed_s": 1.0},
        {"step": 2, "reward_mean": 0.9, "elapsed_s": 2.0},  # superseded by the resume
        {"event": "resume", "step": 1},
        {"step": 2, "reward_mean": 0.5, "elapsed_s": 3.0},
        {"step": 2, "eval_pass1": 0.75, "eval_correct": 3, "eval_total": 4, "eval_s": 1.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines: list[str] = []
    assert check_run_folder(cfg, prog="tidal rl", log=lines.append) is True
    assert lines[0].startswith(f"tidal rl: the run in {tmp_path} is finished (step 2 of ")
    assert "pass@1 25.0% (version 0) -> 75.0% (version 2), +50.0 points" in lines[1]
    assert "reward 0.100 -> 0.500" in lines[1]
    cfg.rl.steps = 1
    with pytest.raises(ValueError, match="holds a run at step 2, past rl.steps=1"):
        check_run_folder(cfg, prog="tidal rl", log=lines.append)
    cfg.rl.steps = 2
    with pytest.raises(ValueError, match="the run is finished"):
        check_resume_step(cfg, 2)  # a trainer role started on its own, at its last step


def test_grpo_py_reports_a_finished_run_under_its_own_name(tmp_path):
    """`python -m tidal.rl.grpo` reads the run folder as `tidal rl` does; the lines name it."""
    from tidal.rl.grpo import PROG, run

    cfg = RLConfig()
    cfg.job.output_dir, cfg.rl.steps = str(tmp_path), 1
    step = tmp_path / "checkpoint" / "step-1"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "reward_mean": 0.5, "elapsed_s": 1.0}) + "\n"
    )
    lines: list[str] = []
    assert run(cfg, log=lines.append) == {}  # nothing built, nothing run
    assert PROG == "python -m tidal.rl.grpo"
    assert lines[0].startswith(f"{PROG}: the run in {tmp_path} is finished (step 1 of ")
    assert not any(line.startswith("tidal rl") for line in lines)


def _step(step: int, **kw) -> dict:
    record = {
        "step": step,
        "reward_mean": 0.5,
        "reward_std": 0.25,
        "response_len_mean": 40.0,
        "entropy": 0.8,
        "clip_frac": 0.0,
        "groups_dropped": 3,
        "groups": 16,
        "tokens_per_s_gen": 900.0,
        "tokens_per_s_train": 1200.0,
        "sync_trainer_s": 0.01,
        "sync_generator_s": 0.02,
        "gen_s": 6.0,
        "train_s": 2.5,
        "elapsed_s": 9.0 * step,
    }
    return record | kw


def test_the_step_line_says_what_it_dropped_and_the_first_step_its_time(tmp_path):
    from tidal.rl.report import Report

    cfg = RLConfig()
    cfg.job.output_dir, cfg.rl.steps, cfg.metrics.plot = str(tmp_path), 50, False
    lines: list[str] = []
    report = Report(cfg, first_step=0, resumed=False, log=lines.append)
    report.log(_step(1))
    report.log(_step(2))
    report.close()
    assert "dropped 3/16 groups (all-same reward)" in lines[0]
    assert lines[1] == (
        "step 1 took 9.0s (generation 6.0s, training 2.5s); the 49 steps left: about 7 min at "
        "that pace, evaluations apart"
    )
    assert len(lines) == 3 and "took" not in lines[2]  # the first step only

    cfg.loss = dataclasses.replace(cfg.loss, drop_equal_groups=False)  # the line omits it
    lines.clear()
    report = Report(cfg, first_step=0, resumed=False, log=lines.append)
    report.log(_step(1, groups_dropped=0))
    report.close()
    assert "dropped" not in lines[0]


def test_a_run_continued_past_its_end_plots_and_sums_up_every_step(tmp_path, monkeypatch):
    """Resumed with a larger rl.steps, the run's end draws rl.png and its summary from the
    whole metrics.jsonl: the earlier run's steps and evaluations too, not only its own."""
    import tidal.rl.report as report_mod
    from tidal.rl.report import Report

    drawn = []
    monkeypatch.setattr(
        report_mod, "plot", lambda steps, evals, path, *, title="": drawn.append((steps, evals))
    )

    def ev(step: int, pass1: float) -> dict:
        return {
            "step": step,
            "eval_pass1": pass1,
            "eval_correct": 1,
            "eval_total": 4,
            "eval_s": 1.0,
        }

    cfg = RLConfig()
    cfg.job.output_dir, cfg.rl.steps, cfg.metrics.plot = str(tmp_path), 2, True
    report = Report(cfg, first_step=0, resumed=False, log=lambda line: None)
    for record in (ev(0, 0.25), _step(1, reward_mean=0.1), _step(2, reward_mean=0.3), ev(2, 0.5)):
        report.log(record)
    first = report.finish()
    report.close()
    assert [s["step"] for s in drawn[-1][0]] == [1, 2] and first["pass1_after"] == 0.5

    cfg.rl.steps = 4  # `--rl.steps 4` on the finished run: it resumes at step 2
    lines: list[str] = []
    report = Report(cfg, first_step=2, resumed=True, log=lines.append)
    for record in (_step(3, reward_mean=0.5), _step(4, reward_mean=0.7), ev(4, 0.75)):
        report.log(record)
    summary = report.finish()
    report.close()
    steps, evals = drawn[-1]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert [s["reward_mean"] for s in steps] == [0.1, 0.3, 0.5, 0.7]
    assert [(e["step"], e["eval_pass1"]) for e in evals] == [(0, 0.25), (2, 0.5), (4, 0.75)]
    assert summary["steps"] == 4
    assert (summary["version_before"], summary["pass1_before"]) == (0, 0.25)
    assert "pass@1 25.0% (version 0) -> 75.0% (version 4), +50.0 points" in "\n".join(lines)
