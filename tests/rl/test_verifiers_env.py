"""A verifiers environment trained on by tidal: verifiers 0.4.0 plays a taskset (its
`SingleAgentEnv`, `null` chat harness run by uv, `EvalClient`, `@reward`s) against the
OpenAI-compatible server on the generator, and `tidal rl` and grpo.py train on its rewards
with the tokens the server sampled.

verifiers is not a dependency of the test set-up: these tests run with it on PYTHONPATH
(`pip install 'tidal[verifiers]'`, or `pip install --target DIR verifiers==0.4.0 uv` and
DIR on PYTHONPATH, DIR/bin on PATH) and are skipped without it; the one below them, on the
error without it, always runs."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.rl.envs import get_env

ROOT = Path(__file__).resolve().parents[2]
TASKSETS = ROOT / "tests" / "rl" / "vf_tasksets"
HAVE = importlib.util.find_spec("verifiers") is not None and shutil.which("uv") is not None
needs_verifiers = pytest.mark.skipif(
    not HAVE,
    reason="needs verifiers 0.4.0 and uv (pip install 'tidal[verifiers]', or both on "
    "PYTHONPATH and PATH)",
)

ARGS = [
    "--config",
    "tests/rl/loop_configs.py:tiny",
    "--task.name",
    "verifiers",
    "--task.params",
    '{"taskset": "vf_addition"}',
    "--task.eval_problems",
    "2",
    "--rollout.prompts_per_step",
    "2",
    "--rollout.group_size",
    "4",
    "--rl.steps",
    "2",
    "--rl.eval_every",
    "0",
    "--metrics.plot",
    "false",
]


def run(module: list[str], out: Path, *extra: str) -> list[dict]:
    # verifiers found where this process finds it; the taskset package by its folder
    vf_path = str(Path(importlib.util.find_spec("verifiers").origin).parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(TASKSETS), vf_path]),
        "OMP_NUM_THREADS": "1",
    }
    p = subprocess.run(
        [sys.executable, "-m", *module, *ARGS, *extra, "--job.output_dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "reward_mean" in r]


@pytest.mark.slow  # about 2.5 min on 2 cores: verifiers' imports and a harness process per episode
@needs_verifiers
def test_tidal_rl_trains_on_a_verifiers_taskset_token_exactly(tmp_path):
    steps = run(["tidal", "rl"], tmp_path / "rl")
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["samples"] == 8 and s["grader_errors"] == 0 and s["turns_mean"] == 1.0
        assert s["retokenized"] == 0
        # every sampled token came back from the server: each trained on, and the trainer
        # scores them as the generator did (PPO ratios 1 up to fp32 reductions)
        assert s["sampled_len_mean"] == s["response_len_mean"] > 0
        assert s["ratio_max"] - 1 < 1e-4 and 1 - s["ratio_min"] < 1e-4
    # verifiers' rewards (its weighted @rewards: the digit share moves for a seed model)
    assert any(s["reward_std"] > 0 for s in steps)

    # grpo.py in one process: the same episodes, the same rewards
    one = run(["tidal.rl.grpo"], tmp_path / "grpo")
    for a, b in zip(one, steps, strict=True):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-6)


USER_SIM = {
    "taskset": "vf_addition",
    "env_id": "user-sim",
    "env_args": {"persona": "Ask: {scenario} Say {done} when answered."},
    "seats": {"assistant": {}, "user": {"max_turns": 3}},
}


@pytest.mark.slow  # about 1.5 min
@needs_verifiers
def test_multi_turn_episodes_are_trained_on_token_exactly(tmp_path):
    """verifiers' user-sim env: the model answers a simulated user (the same model, not
    trained on) for three turns. Every turn chains onto the ids sampled before it (the
    server continues each session from its own ids), observations masked out."""
    extra = ["--task.params", json.dumps(USER_SIM), "--rollout.max_new_tokens", "16"]
    extra += ["--rollout.max_context", "512"]  # the conversation: 3 turns and the user's
    extra += ["--rollout.prompts_per_step", "1", "--rollout.group_size", "2", "--rl.steps", "1"]
    (s,) = run(["tidal.rl.grpo"], tmp_path / "sim", *extra)
    assert s["turns_mean"] == 3.0 and s["retokenized"] == 0 and s["grader_errors"] == 0
    assert s["sampled_len_mean"] == 3 * 16 < s["response_len_mean"]
    assert s["ratio_max"] - 1 < 1e-4 and 1 - s["ratio_min"] < 1e-4


@needs_verifiers
def test_the_environment_reads_the_taskset(monkeypatch):
    monkeypatch.syspath_prepend(str(TASKSETS))
    env = get_env("verifiers", taskset="vf_addition", taskset_args={"num_tasks": 64})
    assert len(env.tasks()) == 64
    problem = next(env.problems("train", seed=0))
    assert problem.prompt.startswith("What is ")
    assert env.reset(problem) == [{"role": "user", "content": problem.prompt}]
    # a multi-agent env of verifiers' with its seats
    seats = {"assistant": {}, "user": {"max_turns": 3}}
    persona = "Ask: {scenario} Say {done} when answered."
    sim = get_env(
        "verifiers",
        taskset="vf_addition",
        env_id="user-sim",
        env_args={"persona": persona},
        seats=seats,
    )
    assert type(sim.vf_env()).__name__ == "UserSimEnv"
    assert sim.vf_env().config.persona == persona and sim.vf_env().config.user.max_turns == 3


def test_without_verifiers_the_error_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    env = get_env("verifiers", taskset="vf_addition")
    with pytest.raises(ImportError, match=r"pip install 'tidal\[verifiers\]'"):
        env.tasks()
    with pytest.raises(ValueError, match="taskset must name"):
        get_env("verifiers", taskset="")
