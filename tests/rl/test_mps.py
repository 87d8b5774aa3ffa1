"""The roles of one `tidal rl` job under a CUDA MPS daemon of their own (rl.mps,
tidal/rl/distributed/mps.py): the config checks, the daemon's start and quit (a stand-in
control program here: this machine has no GPU), and each role's SM share in its processes'
environment."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.rl._cli import CONFIG, run_rl
from tests.rl.loop_configs import tiny
from tidal.rl.config import GeneratorRoleConfig, TrainerConfig
from tidal.rl.distributed.launch import run_roles
from tidal.rl.distributed.mps import mps_daemon, role_env
from tidal.train.config_parse import apply_overrides


def test_sm_percent_is_checked_and_needs_mps():
    for bad in (0, 101):
        with pytest.raises(ValueError, match=f"trainer.sm_percent must be in 1..100, got {bad}"):
            TrainerConfig(sm_percent=bad)
        with pytest.raises(ValueError, match=f"generator.sm_percent must be in 1..100, got {bad}"):
            GeneratorRoleConfig(sm_percent=bad)
    needs = r"trainer.sm_percent=50 splits a GPU's SMs between the roles only under CUDA MPS"
    with pytest.raises(ValueError, match=needs + ": set --rl.mps true"):
        apply_overrides(tiny(), ["--trainer.sm_percent", "50"])
    cfg = apply_overrides(tiny(), ["--rl.mps", "true", "--trainer.sm_percent", "50"])
    assert cfg.rl.mps and cfg.trainer.sm_percent == 50 and cfg.generator.sm_percent == 100


def test_role_env_caps_a_share_below_100_only():
    env = {"A": "1"}
    assert role_env(env, 100) is env
    assert role_env(env, 40) == {"A": "1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"}
    assert env == {"A": "1"}


def _fake_control(folder: Path, fails: bool = False) -> Path:
    """A stand-in nvidia-cuda-mps-control: logs its arguments, stdin and pipe folder."""
    log = folder / "calls"
    script = folder / "nvidia-cuda-mps-control"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY" >> {log}\n'
        f'if [ -z "$1" ]; then cat >> {log}; fi\n'
        + ("echo 'cannot start: no GPU' >&2; exit 3\n" if fails else "exit 0\n")
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return log


def test_the_daemon_is_private_and_quit(tmp_path, monkeypatch):
    log = _fake_control(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    said: list[str] = []
    with mps_daemon(said.append) as env:
        pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
        assert Path(pipe).is_dir() and Path(env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
        assert log.read_text() == f"args=-d pipe={pipe}\n"
        assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ  # only the roles get it
    assert log.read_text() == f"args=-d pipe={pipe}\nargs= pipe={pipe}\nquit\n"
    assert not Path(pipe).exists()  # the private folders are removed
    assert said == [f"tidal rl: roles share the GPU under a CUDA MPS daemon of their own ({pipe})"]


def test_a_missing_or_failing_control_program_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match="rl.mps needs nvidia-cuda-mps-control on PATH"):
        with mps_daemon():
            pass
    _fake_control(tmp_path, fails=True)
    with pytest.raises(
        ValueError,
        match=r"nvidia-cuda-mps-control -d failed \(status 3\): "
        r"cannot start: no GPU",
    ):
        with mps_daemon():
            pass


class _Done:
    """A role process that has already exited 0."""

    def __init__(self, argv, env):
        self.argv, self.env = argv, env

    def poll(self):
        return 0

    def wait(self, timeout=None):
        return 0


def test_each_role_gets_the_daemon_and_its_share():
    started: list[_Done] = []

    def popen(argv, env):
        started.append(_Done(argv, env))
        return started[-1]

    cfg = apply_overrides(
        tiny(), ["--rl.mps", "true", "--trainer.sm_percent", "30", "--generator.count", "2"]
    )
    daemon = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/x/pipe", "CUDA_MPS_LOG_DIRECTORY": "/tmp/x/log"}

    class Store:
        address = "tcp://127.0.0.1:1"

    assert run_roles(cfg, Store(), ["--config", CONFIG], mps=daemon, popen=popen) == 0
    assert len(started) == 3
    for p in started:
        assert p.env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/x/pipe"
        trainer = p.argv[3:5] == ["rl", "trainer"]
        assert p.env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == ("30" if trainer else None)
    assert sum(p.argv[3:5] == ["rl", "trainer"] for p in started) == 1


def test_tidal_rl_refuses_mps_for_roles_on_cpu(tmp_path):
    r = run_rl(
        tmp_path / "run",
        "--rl.mps",
        "true",
        timeout=60,
    )
    assert r.returncode == 2, r.stdout
    assert (
        "tidal rl: error: rl.mps shares a GPU between the roles, but the generators run "
        "on cpu: set --rl.mps false"
    ) in r.stdout
    assert "trainer:" not in r.stdout  # nothing started
