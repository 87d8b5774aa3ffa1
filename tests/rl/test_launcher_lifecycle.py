"""No role of `tidal rl` is left running (tidal/rl/distributed/launch.py): a generator still
running after the trainer finished is ended, and a role ends with its launcher
(lifeline.py's `die_with_launcher`). CPU only, stand-in processes, a few seconds at most."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.rl.loop_configs import tiny
from tidal.rl.distributed.launch import run_roles
from tidal.rl.distributed.lifeline import LAUNCHER_ENV
from tidal.train.config_parse import apply_overrides

ROOT = Path(__file__).resolve().parents[2]


class _Role:
    """A stand-in role process: the trainer exits 0, a generator hangs until signalled."""

    def __init__(self, argv, env):
        self.argv, self.env = argv, env
        self.trainer = argv[3:5] == ["rl", "trainer"]
        self.signals: list[int] = []
        self.code: int | None = 0 if self.trainer else None
        self.born = time.monotonic()

    def poll(self):
        if time.monotonic() - self.born > 5:  # the launcher would wait for it forever
            raise AssertionError("the launcher still waits for the hung generator after 5 s")
        return self.code

    def send_signal(self, sig):
        self.signals.append(sig)
        self.code = -sig

    def wait(self, timeout=None):
        return self.code

    def kill(self):
        self.code = -signal.SIGKILL


class _Store:
    address = "tcp://127.0.0.1:1"

    def __init__(self):
        self.put: list[dict] = []

    def exists(self, key):
        return False

    def put_state_dict(self, sd, key):
        self.put.append(sd)


def test_a_generator_hung_after_the_trainer_finished_is_ended():
    roles: list[_Role] = []

    def popen(argv, env):
        roles.append(_Role(argv, env))
        return roles[-1]

    cfg = apply_overrides(tiny(), ["--rl.wait_timeout_s", "0.3"])
    said: list[str] = []
    store = _Store()
    start = time.monotonic()
    assert run_roles(cfg, store, ["--config", "x"], popen=popen, log=said.append) == 0
    assert time.monotonic() - start < 3
    (gen,) = [r for r in roles if not r.trainer]
    assert gen.signals == [signal.SIGTERM]
    assert any("the trainer finished but generator" in s and "still ran" in s for s in said)
    assert "did not exit" in store.put[0]["reason"]
    assert all(r.env[LAUNCHER_ENV] == str(os.getpid()) for r in roles)


_ROLE = """
import sys, time
from tidal.rl.distributed.lifeline import die_with_launcher
die_with_launcher()
print("started", flush=True)
time.sleep(30)
"""

_LAUNCHER = """
import os, subprocess, sys
env = {**os.environ, "TIDAL_RL_LAUNCHER": str(os.getpid())}
p = subprocess.Popen(  # no pipe of the caller's kept open by the role
    [sys.executable, "-c", sys.argv[1]], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
)
assert p.stdout.readline() == b"started\\n"
print(p.pid, flush=True)
os.kill(os.getpid(), 9)
"""

# The launcher's own way to start a role (`start_role`), with a child that makes no request of
# its own: a torchrun, whose ranks it ends on SIGTERM.
_START_ROLE_LAUNCHER = """
import os, subprocess, sys
from tidal.rl.distributed.lifeline import start_role
out, err, quiet = os.dup(1), os.dup(2), os.open(os.devnull, os.O_WRONLY)
os.dup2(quiet, 1)  # the role keeps no pipe of the caller's open
os.dup2(quiet, 2)
p = start_role([sys.executable, "-c", sys.argv[1]], env=dict(os.environ))
os.dup2(out, 1)
os.dup2(err, 2)
print(p.pid, flush=True)
os.kill(os.getpid(), 9)
"""
_PLAIN_ROLE = """
import time
time.sleep(30)
"""


# Run under a child subreaper of its own, so the orphaned role is this script's to watch and
# reap (whatever this machine's init does with orphans): "ended STATUS" or "alive".
_WATCH = """
import ctypes, os, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
launcher = subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]], capture_output=True,
                          timeout=60)
assert launcher.returncode == -9, launcher.stderr.decode()
role = int(launcher.stdout.split()[0])
deadline = time.monotonic() + 5
while time.monotonic() < deadline:
    done, status = os.waitpid(role, os.WNOHANG)
    if done:
        print("ended", os.waitstatus_to_exitcode(status))
        sys.exit(0)
    time.sleep(0.02)
os.kill(role, 9)
os.waitpid(role, 0)
print("alive")
"""


@pytest.mark.parametrize(
    ("launcher", "role"),
    [(_LAUNCHER, _ROLE), (_START_ROLE_LAUNCHER, _PLAIN_ROLE)],
    ids=["the_role_asks", "start_role_asks_for_it"],
)
def test_a_role_ends_with_its_launcher(launcher, role):
    """Killed outright, the launcher takes its role along: a role that asks for the signal
    itself (`die_with_launcher`), or any process `start_role` started (a torchrun)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    watch = subprocess.run(
        [sys.executable, "-c", _WATCH, launcher, role],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert watch.returncode == 0, watch.stderr
    assert watch.stdout.split() == ["ended", str(-signal.SIGTERM)]


def test_a_role_whose_launcher_is_already_gone_stops_at_once():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    env = {**os.environ, "PYTHONPATH": str(ROOT), LAUNCHER_ENV: str(dead.pid)}
    role = subprocess.run(
        [sys.executable, "-c", _ROLE], env=env, capture_output=True, text=True, timeout=60
    )
    assert role.returncode == 1
    assert f"the launcher (pid {dead.pid}) that started this role is gone" in role.stderr
