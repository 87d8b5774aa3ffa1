"""Faults and membership of the RL roles, each in bounded time: a generator killed
mid-rollout (sync and async, and under `tidal rl`), the trainer killed mid-publish, the
store's controller killed or restarted, a generator joining a running job late and
generators leaving it, a generator started before the trainer on a store holding an earlier
run's keys, an unreachable store.

The roles run as their own commands against a store (as on a cluster), with
tests/rl/fault_configs.py:stall (tests/rl/loop_configs.py:tiny: rl.heartbeat_s 0.25,
rl.dead_after_s 3, rl.lost_after_s at its default 3). A role to be killed mid-put is held
just before its commit by that config, so the kill lands at a known point; bounds are the
mechanism's configured period plus slack for a loaded 2-core machine."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import tidal.store
from tests.rl._cli import NO_PLOT, ROOT, assert_session_gone, child_env

CONFIG = "tests/rl/fault_configs.py:stall"
LOST_AFTER_S = 3.0  # rl.lost_after_s (its default)
DEAD_AFTER_S = 3.0  # rl.dead_after_s of the test config
SLACK_S = 7.0  # a loaded 2-core machine: process start-up, descheduled threads


class Role:
    """A role's process, its output read line by line in a thread (for bounded waits)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.p = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self._q.put(line)
        self._q.put(None)

    def expect(self, text: str, timeout: float) -> float:
        """Read lines until one contains `text`; returns when (monotonic). Fails after
        `timeout` s or at the end of the output."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no line with {text!r} within {timeout:g} s:\n" + "".join(self.lines)
                ) from None
            if line is None:
                self._q.put(None)
                raise AssertionError(f"the output ended without {text!r}:\n" + "".join(self.lines))
            self.lines.append(line)
            if text in line:
                return time.monotonic()

    def finish(self, timeout: float) -> str:
        """Wait for the exit; the whole output."""
        self.p.wait(timeout=timeout)
        while (line := self._q.get(timeout=30)) is not None:
            self.lines.append(line)
        self._q.put(None)
        return "".join(self.lines)

    def end(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait()
        assert_session_gone(self.p.pid)


class Job:
    """The trainer and generators of one run against a store address."""

    def __init__(self, tmp_path: Path, address: str, *args: str, stall: str = "") -> None:
        self.out, self.address, self.args = tmp_path / "run", address, list(args)
        self.marker = tmp_path / "stalled"
        self.env = {
            **child_env(),
            "TIDAL_TEST_STALL": stall,
            "TIDAL_TEST_STALL_FILE": str(self.marker),
        }
        self.roles: dict[str, Role] = {}

    def start(self, role: str, *extra: str) -> Role:
        kind = role.split()[0]
        argv = [
            sys.executable,
            "-m",
            "tidal",
            "rl",
            kind,
            "--store",
            self.address,
            "--config",
            CONFIG,
            "--job.output_dir",
            str(self.out),
            *NO_PLOT,
            *self.args,
            *extra,
        ]
        self.roles[role] = Role(argv, self.env)
        return self.roles[role]

    def generator(self, index: int, *extra: str) -> Role:
        return self.start(f"generator {index}", "--index", str(index), *extra)

    def stalled_pid(self, timeout: float = 120) -> int:
        """Wait until a process stalls at the stall point; its pid."""
        deadline = time.monotonic() + timeout
        while not (self.marker.exists() and self.marker.read_text().endswith("\n")):
            assert time.monotonic() < deadline, f"no role reached the stall point in {timeout} s"
            for name, r in self.roles.items():
                assert r.p.poll() is None, f"{name} exited early:\n{r.finish(30)}"
            time.sleep(0.05)  # waiting for the marker file, bounded
        return int(self.marker.read_text().split()[0])

    def stalled(self, timeout: float = 120) -> tuple[str, int]:
        """Wait until a role stalls at the stall point; (its role name, its pid)."""
        pid = self.stalled_pid(timeout)
        names = [n for n, r in self.roles.items() if r.p.pid == pid]
        assert names, f"pid {pid} is none of the roles"
        return names[0], pid

    def records(self) -> list[dict]:
        lines = (self.out / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if "reward_mean" in r]

    def end(self) -> None:
        for r in self.roles.values():
            r.end()


@pytest.fixture
def store():
    with tidal.store.connect() as s:
        yield s


def test_a_generator_killed_mid_rollout_is_dropped_and_the_other_fills_the_batch(tmp_path, store):
    """Sync, two generators: the first to put its rollouts of step 3 is killed with SIGKILL
    with the batch written but not committed. The trainer reports it lost within
    rl.lost_after_s (+ slack), trains step 3 on the survivor's batch alone (the torn one is
    never read), then gives the survivor every prompt, and finishes the run."""
    job = Job(
        tmp_path, store.address, "--generator.count", "2", "--rl.steps", "6", stall="rollouts/*:3"
    )
    try:
        trainer = job.start("trainer")
        job.generator(0)
        job.generator(1)
        victim, pid = job.stalled()
        k = int(victim.split()[1])
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        took = trainer.expect(f"generator {k} lost: no heartbeat", LOST_AFTER_S + SLACK_S) - killed
        assert took < LOST_AFTER_S + SLACK_S, took
        out = trainer.finish(120)
        assert trainer.p.returncode == 0, out
        survivor = job.roles[f"generator {1 - k}"]
        assert survivor.finish(60) and survivor.p.returncode == 0
        assert job.roles[victim].p.wait(10) == -signal.SIGKILL
    finally:
        job.end()
    steps = job.records()
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    for s in steps[:2]:
        assert s["generators"] == [0, 1] and s["samples_per_generator"] == [16, 16], s
    assert steps[2]["generators"] == [1 - k] and steps[2]["samples"] == 16, steps[2]
    for s in steps[3:]:  # the survivor samples all 4 prompts
        assert s["generators"] == [1 - k] and s["samples_per_generator"] == [32], s
        assert s["generators_live"] == 1 and s["generators_lost"] == 1
    assert not store.exists(f"rollouts/{k}", 3)  # the torn batch never became visible


def test_under_tidal_rl_a_killed_generator_does_not_stop_the_run(tmp_path):
    """`tidal rl` (the launcher, two generator processes): one killed mid-put is reported by
    the launcher and dropped by the trainer; the run finishes with status 0."""
    job = Job(tmp_path, "", stall="rollouts/*:3")
    argv = [
        sys.executable,
        "-m",
        "tidal",
        "rl",
        "--config",
        CONFIG,
        "--job.output_dir",
        str(job.out),
        *NO_PLOT,
        "--generator.count",
        "2",
        "--rl.steps",
        "5",
    ]
    launcher = job.roles["tidal rl"] = Role(argv, job.env)
    try:
        os.kill(job.stalled_pid(), signal.SIGKILL)
        out = launcher.finish(120)
        assert launcher.p.returncode == 0, out
        assert "was killed by signal 9; the trainer goes on with the others" in out, out
        assert "lost: no heartbeat" in out, out
    finally:
        job.end()
    assert [s["step"] for s in job.records()] == [1, 2, 3, 4, 5]


def test_async_a_killed_generator_and_the_survivor_fills_every_step(tmp_path, store):
    """Async, two generators (a step takes two batches, one queue slot each): one is killed
    mid-put of its third batch; the survivor's batches fill every later step."""
    job = Job(
        tmp_path,
        store.address,
        "--generator.count",
        "2",
        "--rl.steps",
        "6",
        "--rl.mode",
        "async",
        "--loss.tis_cap",
        "2",
        "--rl.max_staleness",
        "4",
        stall="rollouts/*:3",
    )
    try:
        trainer = job.start("trainer")
        job.generator(0)
        job.generator(1)
        victim, pid = job.stalled()
        k = int(victim.split()[1])
        os.kill(pid, signal.SIGKILL)
        trainer.expect(f"generator {k} lost: no heartbeat", LOST_AFTER_S + SLACK_S)
        out = trainer.finish(120)
        assert trainer.p.returncode == 0, out
    finally:
        job.end()
    steps = job.records()
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert all(s["samples"] == 32 for s in steps)  # two batches of 16, from whoever is live
    assert steps[-1]["generators"] == [1 - k, 1 - k]
    assert not store.exists(f"rollouts/{k}", 3)


def test_the_trainer_killed_mid_publish(tmp_path, store):
    """The trainer is killed with SIGKILL while publishing policy version 3 (written, not
    committed): the generators never read it, say so, keep version 2, and exit with a line
    naming the trainer within rl.dead_after_s (+ slack)."""
    job = Job(
        tmp_path, store.address, "--generator.count", "2", "--rl.steps", "6", stall="policy:3"
    )
    try:
        job.start("trainer")
        gens = [job.generator(0), job.generator(1)]
        victim, pid = job.stalled()
        assert victim == "trainer"
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for g in gens:
            g.expect("trainer stopped answering", DEAD_AFTER_S + SLACK_S)
            assert time.monotonic() - killed < DEAD_AFTER_S + SLACK_S
            out = g.finish(30)
            assert g.p.returncode == 2, out
            assert "policy version 3: version 3 of key 'policy' is gone (aborted" in out, out
    finally:
        job.end()
    assert not store.exists("policy", 3) and store.exists("policy", 2)


def _serve(port: int = 0) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen(
        [sys.executable, "-m", "tidal", "store", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    assert "tidal store serving at" in line, line + p.stdout.read()
    return p, line.split()[4]


@pytest.mark.parametrize(
    "how", ["killed", pytest.param("restarted", marks=pytest.mark.slow), "emptied"]
)
def test_the_stores_controller_killed_or_restarted(tmp_path, how):
    """`tidal store serve` is killed mid-run ("restarted": and started again on the same port
    at once, empty; "emptied": the run's control/start deleted, which is what a controller
    restarted between two calls looks like): every role says so in one line and exits with
    status 2; none is left."""
    server, address = _serve()
    job = Job(tmp_path, address, "--rl.steps", "10000")
    try:
        trainer = job.start("trainer")
        gen = job.generator(0)
        trainer.expect("step    2/", 120)
        if how == "emptied":
            with tidal.store.connect(address) as s:
                s.delete("control/start")
        else:
            server.kill()
            server.wait()
        if how == "restarted":
            server, again = _serve(int(address.rsplit(":", 1)[1]))
            assert again == address
        gone = "stopped answering ("
        said = {
            "killed": (gone,),
            "restarted": (gone, "no longer holds this run"),
            "emptied": ("no longer holds this run (its control/start is gone)",),
        }[how]
        for role in (trainer, gen):
            out = role.finish(DEAD_AFTER_S + 30)
            assert role.p.returncode == 2, out
            assert any(x in out for x in (*said, "the run's store failed")), out
            assert "Traceback" not in out, out
    finally:
        job.end()
        server.kill()
        server.wait()


ASYNC = ("--rl.mode", "async", "--loss.tis_cap", "2", "--rl.max_staleness", "4")


@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_a_generator_joins_late_and_generators_leave(tmp_path, store, mode):
    """One generator to start with; a second one under the same index is refused. Another
    joins the running job (`tidal rl generator --index 1`), starts from the newest version
    and contributes (sync: half of every step's prompts; async: batches of its own, taken
    as they arrive). Sent SIGTERM, it leaves cleanly (status 0) and the job goes on with
    the first; when that one leaves too, the trainer stops with an error naming it."""
    job = Job(tmp_path, store.address, "--rl.steps", "10000", *(ASYNC if mode == "async" else ()))
    try:
        trainer = job.start("trainer")
        first = job.generator(0)
        trainer.expect("step    2/", 120)
        if mode == "sync":
            dup = job.start("generator 0 again", "--index", "0")
            out = dup.finish(60)
            assert dup.p.returncode == 2, out
            assert "generator 0 is already running in this job" in out, out
        late = job.generator(1)
        trainer.expect("generator 1 joined", 120)
        late.expect(
            "sampling 2 prompts a step from policy version"
            if mode == "sync"
            else "4 prompts a batch",
            60,
        )
        deadline = time.monotonic() + 120
        while not store.exists("rollouts/1"):  # it contributed a batch (bounded wait)
            assert time.monotonic() < deadline and late.p.poll() is None, late.finish(30)
            time.sleep(0.05)
        for _ in range(2):
            trainer.expect("step ", 60)
        late.p.send_signal(signal.SIGTERM)
        trainer.expect("generator 1 left (it was asked to leave (SIGTERM))", 30)
        out = late.finish(30)
        assert late.p.returncode == 0, out
        assert "leaving the job" in out
        for _ in range(3):
            trainer.expect("step ", 60)
        first.p.send_signal(signal.SIGTERM)
        out = trainer.finish(30)
        assert trainer.p.returncode == 2, out
        assert "fewer than rl.min_generators=1" in out, out
        assert "generator 0 left (it was asked to leave (SIGTERM))" in out, out
        assert first.finish(30) and first.p.returncode == 0
    finally:
        job.end()
    steps = job.records()
    if mode == "async":  # one batch of 32 a step, from either generator
        assert all(s["samples"] == 32 for s in steps)
        assert [1] in [s["generators"] for s in steps], [s["generators"] for s in steps]
        assert steps[0]["generators"] == steps[-1]["generators"] == [0]
        return
    runs: list[tuple[list[int], list[int]]] = []  # consecutive steps with the same members
    for s in steps:
        shape = (s["generators"], s["samples_per_generator"])
        if not runs or runs[-1] != shape:
            runs.append(shape)
    # A leaving generator first makes a batch it was given prompts for; only a SIGTERM in the
    # moment between its check and the trainer's announcement leaves a step without its share.
    if runs[2] == ([0], [16]):
        del runs[2]
    assert runs[:3] == [([0], [32]), ([0, 1], [16, 16]), ([0], [32])], runs


@pytest.mark.slow
def test_a_generator_started_before_the_trainer_on_a_used_store_waits_for_it(tmp_path, store):
    """The store holds an earlier run's keys (its control/start, a trainer heartbeat that no
    longer advances, policy versions). A generator started first does not take them for this
    run's, nor the stale heartbeat for a dead trainer after rl.dead_after_s: it waits for the
    trainer, which joins later, and the run completes."""
    store.put_state_dict({"step": 0, "steps": 2}, "control/start", version=0)
    store.put_state_dict({"role": "trainer", "t": 0.0, "id": "old"}, "alive/trainer")
    store.put_state_dict({"w": torch.zeros(1)}, "policy", version=7)
    job = Job(tmp_path, store.address, "--rl.steps", "2")
    try:
        gen = job.generator(0)
        # The generator's own heartbeats measure its life: 3 x rl.dead_after_s of it.
        beats = int(3 * DEAD_AFTER_S / 0.25)
        deadline = time.monotonic() + 120
        while not store.exists("alive/generator0") or (
            store.versions("alive/generator0")[-1] < beats
        ):
            assert gen.p.poll() is None, gen.finish(30)
            assert time.monotonic() < deadline, "the generator did not beat"
            time.sleep(0.1)  # waiting for its heartbeats, bounded
        trainer = job.start("trainer")
        out = trainer.finish(120)
        assert trainer.p.returncode == 0, out
        out = gen.finish(60)
        assert gen.p.returncode == 0, out
        assert "from policy version 0 to 2" in out, out
    finally:
        job.end()
    assert [s["step"] for s in job.records()] == [1, 2]


def test_a_role_command_against_an_unreachable_store(tmp_path):
    start = time.monotonic()
    for role in (["trainer"], ["generator", "--index", "0"]):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "tidal",
                "rl",
                *role,
                "--store",
                "tcp://127.0.0.1:9",
                "--config",
                CONFIG,
                "--job.output_dir",
                str(tmp_path / "run"),
                "--store.connect_timeout_s",
                "2",
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, r.stdout + r.stderr
        assert "store.address 'tcp://127.0.0.1:9' does not answer" in r.stderr, r.stderr
    assert time.monotonic() - start < 60
