"""The sync RL loop through the store, as the user runs it: `tidal rl` (launcher, embedded
store, a generator process and a trainer process) and the role commands on their own.

The config is tests/rl/loop_configs.py:tiny (a seed-initialized 0.3M model on CPU in fp32,
8-token completions, the `digits` reward); every role process imports that file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import tidal.store
from tests._signals import default_sigint
from tests.rl._cli import (
    CONFIG,
    NO_PLOT,
    assert_session_gone,
    records,
    run_module,
    run_rl,
    start_tidal,
)
from tidal.rl.report import STEP_FIELDS


def test_reward_rises_and_the_run_reports_everything(tmp_path):
    out = tmp_path / "run"
    r = run_rl(
        out, "--checkpoint.enable", "true", "--rl.steps", "8", "--metrics.tensorboard", "true"
    )
    assert r.returncode == 0, r.stdout
    steps, evals = records(out)
    assert [s["step"] for s in steps] == list(range(1, 9))
    for s in steps:
        missing = [f for f in STEP_FIELDS if f not in s]
        assert not missing, f"step {s['step']} lacks {missing}"
        assert "kl" not in s  # kl_coef = 0
        assert s["sync_trainer_s"] >= 0 and s["sync_generator_s"] >= 0
        assert s["tokens_per_s_gen"] > 0 and s["tokens_per_s_train"] > 0
    first = sum(s["reward_mean"] for s in steps[:2]) / 2
    last = sum(s["reward_mean"] for s in steps[-2:]) / 2
    assert last > first + 0.3, [round(s["reward_mean"], 3) for s in steps]
    assert [e["step"] for e in evals] == [0, 4, 8]
    assert all(e["eval_total"] == 8 for e in evals)
    assert (out / "rl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "checkpoint" / "step-8").is_dir()
    assert any((out / "tb").iterdir())  # TensorBoard events
    assert "held-out pass@1" in r.stdout and f"plot: {out / 'rl.png'}" in r.stdout
    assert f"metrics: {out / 'metrics.jsonl'}" in r.stdout
    assert "step    8/8 reward" in r.stdout


def test_batch_invariant_ratios_are_exactly_one_through_the_loop(tmp_path):
    """Generator and trainer are separate processes with their own model copies; the weights
    travel through the store, and the trainer's step recomputes the generator's log-probs
    bit for bit: every token's ratio is exactly 1.0 at every step, with one trainer rank and
    with two (FSDP over gloo), whose runs are then the same run."""
    rewards = []
    for nproc in (1, 2):
        out = tmp_path / f"run{nproc}"
        r = run_rl(
            out,
            "--rl.steps",
            "3",
            "--generator.batch_invariant",
            "true",
            *NO_PLOT,
            "--nproc",
            str(nproc),
        )
        assert r.returncode == 0, r.stdout
        steps, _ = records(out)
        assert len(steps) == 3
        for s in steps:
            assert s["ratio_max"] == 1.0 and s["ratio_min"] == 1.0, s
            assert s["clip_frac"] == 0.0
        assert steps[-1]["reward_mean"] != steps[0]["reward_mean"]  # the policy did change
        rewards.append([s["reward_mean"] for s in steps])
    assert "world 2 (dp_shard=2)" in r.stdout
    assert rewards[0] == rewards[1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task.name", "no_such_task"], "unknown task 'no_such_task'"),
        (["--rollout.group_size", "1"], "group_size=1 with loss.std_normalize=true"),
        (["--model.vocab_size", "100"], "does not cover"),
        (["--store.address", "tcp://127.0.0.1:9"], "does not answer"),
        (["--task.params", '{"digits": 3}'], "task 'digits' has no parameter 'digits'"),
        (["--rollout.max_prompt_tokens", "4"], "over rollout.max_prompt_tokens=4"),
        (["--parallelism.cp", "2", "--nproc", "2"], "does not run under context parallelism"),
    ],
    ids=[
        "unknown-task",
        "group-of-one",
        "vocabulary",
        "store-address",
        "task-parameter",
        "prompt-length",
        "context-parallel",
    ],
)
def test_bad_input_fails_before_any_role_starts(tmp_path, args, message):
    start = time.monotonic()
    r = run_rl(tmp_path / "run", *args, "--store.connect_timeout_s", "2", timeout=60)
    assert r.returncode == 2, r.stdout
    assert message in r.stdout
    assert "tidal rl: error:" in r.stdout
    assert "generator 0: on" not in r.stdout and "trainer:" not in r.stdout  # none started
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert time.monotonic() - start < 60


def test_a_grader_that_raises_is_counted_and_the_run_goes_on(tmp_path):
    out = tmp_path / "run"
    r = run_rl(out, "--rl.steps", "2", "--task.params", '{"raises": true}', *NO_PLOT)
    assert r.returncode == 0, r.stdout
    steps, _ = records(out)
    assert len(steps) == 2 and all(s["grader_errors"] > 0 for s in steps)
    assert "RuntimeError: grader bug on purpose" in steps[0]["grader_error"]
    assert "grader raised" in r.stdout and "the grader raised" in r.stdout


def _endless(out: Path) -> tuple[str, ...]:
    """A `tidal rl` run (or role) in `out` that goes on until it is stopped."""
    return ("--config", CONFIG, "--job.output_dir", str(out), "--rl.steps", "10000", *NO_PLOT)


def _role(role: str, store: str, out: Path, *extra: str) -> subprocess.Popen:
    return start_tidal("rl", role, "--store", store, *_endless(out), *extra)


@pytest.mark.parametrize("victim", ["generator", "trainer"])
def test_when_a_role_dies_the_other_exits_with_a_clear_message(tmp_path, victim):
    """The role commands on their own against a store (as on a cluster): kill one with
    SIGKILL mid-run; the other notices through the store alone and exits within bounded
    time, naming the dead role."""
    store = tidal.store.connect()
    procs = {}
    try:
        procs["trainer"] = _role("trainer", store.address, tmp_path / "run")
        procs["generator"] = _role("generator", store.address, tmp_path / "run", "--index", "0")
        # The loop is running once step 2's rollouts are in the store.
        store.get_state_dict("rollouts/0", into={}, version=2, wait=90)
        procs[victim].kill()
        procs[victim].wait()
        other = procs["trainer" if victim == "generator" else "generator"]
        start = time.monotonic()
        out, _ = other.communicate(timeout=30)
        took = time.monotonic() - start
        assert other.returncode == 2, out
        if victim == "trainer":
            assert "trainer stopped answering" in out, out
        else:  # the last generator lost: too few for the trainer (tests/rl/test_faults.py)
            assert "generator 0 lost: no heartbeat" in out, out
            assert "fewer than rl.min_generators=1" in out, out
        assert took < 3.0 + 15, took  # rl.dead_after_s = rl.lost_after_s = 3 here
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
            assert_session_gone(p.pid)
        store.close()


def test_ctrl_c_stops_every_role(tmp_path):
    p = start_tidal("rl", *_endless(tmp_path / "run"), preexec_fn=default_sigint)
    try:
        assert p.stdout is not None
        for line in p.stdout:  # the loop runs once a step is logged
            if line.startswith("step    2/"):
                break
        os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole group
        rest, _ = p.communicate(timeout=60)
        assert p.returncode == 130, rest
        assert "interrupted" in rest
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert_session_gone(p.pid)


def test_help_and_print_config(capsys):
    from tidal.rl.distributed.cli import main

    assert main(["--config", "rl_addition", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in (
        "--rollout.group_size",
        "--loss.clip_high",
        "--rl.eval_every",
        "--store.address",
        "--generator.batch_invariant",
        "--nproc",
    ):
        assert flag in text
    assert main(["--config", "rl_addition", "--print-config", "--rl.steps", "7"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["rl"]["steps"] == 7 and cfg["policy"]["init"].startswith("sft:")
    assert main(["--config", "nope"]) == 2
    assert "unknown RL config 'nope'" in capsys.readouterr().err
    assert main(["trainer", "--config", "rl_addition"]) == 2
    assert "needs the run's store" in capsys.readouterr().err


def test_the_warm_start_weights_reach_the_trainer(tmp_path):
    """policy.init=checkpoint:PATH loads that checkpoint's weights into the trainer through
    the checkpoint code, with policy checkpoints on or off (the checkpoint code reads an
    initial load only when enabled)."""
    import torch

    from tests.rl.loop_configs import tiny
    from tidal.models import Transformer, get_flavor
    from tidal.rl.build import trainer_config
    from tidal.rl.warmstart import resolve_policy
    from tidal.train.config_parse import apply_overrides
    from tidal.train.data import DataBundle
    from tidal.train.trainer import Trainer

    seed_run = tmp_path / "seed"
    p = run_module(
        "tidal",
        "train",
        "--config",
        "sft_addition",
        "--model.flavor",
        "tiny",
        "--training.seed",
        "7",
        "--job.device",
        "cpu",
        "--job.output_dir",
        str(seed_run),
        "--checkpoint.enable",
        "true",
        "--checkpoint.create_seed_checkpoint",
        "true",
        "--data.num_problems",
        "2000",
        "--metrics.val_every",
        "0",
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    with torch.device("meta"):
        expected = Transformer(get_flavor("tiny", vocab_size=512))
    expected.to_empty(device="cpu")
    expected.init_weights(seed=7)
    for enable in ("false", "true"):
        cfg = apply_overrides(
            tiny(str(tmp_path / f"rl-{enable}")),
            [
                "--policy.init",
                f"checkpoint:{seed_run / 'checkpoint'}",
                "--checkpoint.enable",
                enable,
                "--trainer.seed",
                "0",
            ],
        )
        src = resolve_policy(cfg, log=lambda line: None)
        data = DataBundle(tokenizer=src.tokenizer, train=None, val=None)
        trainer = Trainer(trainer_config(cfg, src), data=data, log=lambda line: None)
        try:
            got = trainer.model.state_dict()
            for name, want in expected.state_dict().items():
                assert torch.equal(got[name], want), (enable, name)
        finally:
            trainer.close()
