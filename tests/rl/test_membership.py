"""Generator membership through the store, in one process: the trainer's view of heartbeats
(joined, lost, back, restarted, left), the sync announcement of each generator's prompts,
the async batch numbering of a restarted generator, and a torn policy version that a
prefetching generator never swaps in (tidal/rl/distributed/membership.py, intake.py, staging.py).
The multi-process faults are in test_faults.py."""

from __future__ import annotations

import time

import pytest
import torch

import tidal.store
from tests.generate.conftest import tiny_model
from tests.rl.loop_configs import tiny
from tidal.rl.distributed.coupling import MEMBERS, Link, RoleStopped, left_key
from tidal.rl.distributed.intake import first_batch
from tidal.rl.distributed.membership import Members, leave, share_of
from tidal.rl.distributed.prefetch import Stager
from tidal.store import ops, testing
from tidal.train.config_parse import apply_overrides


@pytest.fixture
def store():
    with tidal.store.connect() as s:
        yield s


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(store, g: int, ident: str, t: float, ready: bool = True) -> None:
    """What generator g's Link puts every heartbeat."""
    store.put_state_dict(
        {"role": f"generator {g}", "t": t, "id": ident, "ready": ready}, f"alive/generator{g}"
    )


def test_the_trainer_sees_generators_join_get_lost_come_back_restart_and_leave(store):
    cfg = apply_overrides(tiny(), ["--generator.count", "2"])  # lost after 3 s, 4 prompts
    clock, lines = Clock(), []
    m = Members(store, cfg, log=lines.append, clock=clock)
    beat(store, 0, "a", 1.0)
    beat(store, 1, "b", 1.0)
    m.poll(force=True)
    assert m.live() == []  # a heartbeat seen once may be an earlier run's: not yet a member
    beat(store, 0, "a", 2.0)
    beat(store, 1, "b", 2.0)
    m.poll(force=True)
    assert [g.index for g in m.live()] == [0, 1]
    assert lines == ["trainer: generator 0 joined (1 live)", "trainer: generator 1 joined (2 live)"]

    # Sync: each version's announcement splits the prompts over the live generators.
    assert m.announce(0) == [[0, "a", 2], [1, "b", 2]]
    assert store.get_state_dict(MEMBERS, version=0) == {"generators": [[0, "a", 2], [1, "b", 2]]}
    link = Link(store, "generator 1", watch=[], loop=cfg.rl)
    link.ident = "b"
    assert share_of(link, 0, 1) == 2
    link.ident = "someone else"  # a process not announced (joined since, or restarted)
    assert share_of(link, 0, 1) == 0

    # Generator 1 stops beating: lost after rl.lost_after_s, not before.
    clock.now += 2.0
    beat(store, 0, "a", 3.0)
    m.poll(force=True)
    assert m.is_live(1, "b")
    clock.now += 1.5
    beat(store, 0, "a", 4.0)
    m.poll(force=True)
    assert not m.is_live(1, "b") and m.is_live(0, "a") and m.lost == 1
    assert "generator 1 lost: no heartbeat for 3.5 s (rl.lost_after_s=3)" in lines[-1]
    assert m.announce(1) == [[0, "a", 4]]  # the survivor gets every prompt
    beat(store, 1, "b", 5.0)  # it was only paused: taken back
    m.poll(force=True)
    assert m.is_live(1, "b") and lines[-1] == "trainer: generator 1 joined again (2 live)"

    # Generator 0 restarted under its index (a new process id) before it could be lost.
    beat(store, 0, "c", 5.0)
    m.poll(force=True)
    assert not m.is_live(0, "a") and m.is_live(0, "c") and m.lost == 2
    assert "generator 0 restarted as a new process" in "\n".join(lines)

    # Generator 1 leaves: its reason, and its heartbeat gone.
    link.ident = "b"
    leave(link, 1, "it was asked to leave (SIGTERM)")
    assert store.exists(left_key(1)) and not store.exists("alive/generator1")
    m.poll(force=True)
    assert [g.index for g in m.live()] == [0]
    assert lines[-1] == (
        "trainer: generator 1 left (it was asked to leave (SIGTERM)); going on with 1 generator(s)"
    )

    # Too few: generator 0 lost too; the trainer's error names both.
    clock.now += 10
    m.poll(force=True)
    with pytest.raises(
        RoleStopped,
        match=r"0 generator\(s\) live while publishing policy "
        r"version 2, fewer than rl.min_generators=1: generator 0 lost: .*; "
        r"generator 1 left \(it was asked",
    ):
        m.announce(2)


def test_a_restarted_async_generator_numbers_its_batches_past_its_predecessor(store):
    assert first_batch(store, 0) == 1  # a fresh run
    for k in (1, 2, 3):
        store.put_state_dict({"k": torch.zeros(1)}, "rollouts/0", version=k)
    # The predecessor may have died putting batch 4 (aborted: never reusable): start at 5.
    assert first_batch(store, 0) == 5


def _torn_put(address: str, state_dict, key: str, version: int) -> None:
    """A writer that dies mid-put: its bytes are written, its connection closes before the
    commit, and the store aborts the version."""
    writer = tidal.store.connect(address)

    class Died(Exception):
        pass

    def hook(connection, op, fields):
        if op is ops.PUT_COMMIT:
            raise Died

    testing.on_request(writer, hook)
    with pytest.raises(Died):
        writer.put_state_dict(state_dict, key, version=version)
    writer.close()


def test_a_prefetching_generator_never_swaps_in_a_torn_version(store):
    """Version 1 of the policy is torn mid-publish (its writer gone before the commit): the
    Stager never stages it, reports it, keeps version 0 live, and stages version 2 when it
    comes. A sync reader's wait says the same."""
    v0, v1, v2 = tiny_model(seed=0), tiny_model(seed=1), tiny_model(seed=2)
    live = tiny_model(seed=0)
    store.put_state_dict(v0.state_dict(), "policy", version=0)
    _torn_put(store.address, v1.state_dict(), "policy", 1)
    assert store.versions("policy") == [0]
    stager = Stager(store, "policy", live.state_dict(), held=0, last=2, slice_s=0.1)
    stager.start()
    try:
        deadline = time.monotonic() + 30
        while not stager.torn:  # the prefetch thread reports it (bounded wait)
            assert time.monotonic() < deadline and stager.error is None, stager.error
            time.sleep(0.01)
        assert stager.torn[0][0] == 1 and "aborted" in stager.torn[0][1]
        assert stager.swap() is None  # nothing staged: version 0 stays live
        for name, w in v0.state_dict().items():
            assert torch.equal(live.state_dict()[name], w), name
        store.put_state_dict(v2.state_dict(), "policy", version=2)
        assert stager.wait_staged(30) == 2 and stager.swap() == 2
    finally:
        stager.close()
    for name, w in v2.state_dict().items():
        assert torch.equal(live.state_dict()[name], w), name

    # A sync generator waiting for the torn version is told, once, and never reads it.
    said: list[str] = []
    cfg = tiny()
    link = Link(store, "generator 0", watch=[], loop=cfg.rl, log=said.append)
    with pytest.raises(TimeoutError):
        link.loop = apply_overrides(cfg, ["--rl.wait_timeout_s", "1"]).rl
        link.wait_version("policy", 1, "policy version 1", into={})
    assert len(said) == 1 and "version 1 of key 'policy' is gone (aborted" in said[0], said


def test_the_last_generator_lost_for_a_pause_is_waited_for_until_dead_after_s(store):
    """Lost (rl.lost_after_s = 3) is not gone: the last generator may come back until
    rl.dead_after_s (6 here) of silence, and only then does the run stop for want of one."""
    cfg = apply_overrides(tiny(), ["--rl.dead_after_s", "6"])
    clock = Clock()
    m = Members(store, cfg, log=lambda line: None, clock=clock)
    beat(store, 0, "a", 1.0)
    m.poll(force=True)
    beat(store, 0, "a", 2.0)
    m.poll(force=True)
    clock.now += 3.5
    m.poll(force=True)
    assert not m.is_live(0, "a") and not m.gone(0, "a")
    m.require("waiting")  # it may come back: no error yet
    beat(store, 0, "a", 3.0)
    m.poll(force=True)
    assert m.is_live(0, "a")
    clock.now += 6.5
    m.poll(force=True)
    assert m.gone(0, "a")
    with pytest.raises(RoleStopped, match="fewer than rl.min_generators=1: generator 0 lost"):
        m.require("waiting")


def test_a_generator_warming_up_beats_and_joins_once_ready(store):
    """A generator beats from its start but says it is ready only after its warm-up
    (compiles, CUDA graphs): until then it is no member (no prompts, the trainer's steps do
    not wait for its compiles), yet the run does not stop for want of it while it beats. A
    restart under the same index drops the old process at once; the new one joins when
    ready."""
    cfg = apply_overrides(tiny(), ["--rl.dead_after_s", "6"])
    clock, lines = Clock(), []
    m = Members(store, cfg, log=lines.append, clock=clock)
    link = Link(store, "generator 0", watch=[], loop=cfg.rl, ready=False)
    link.ident = "a"
    for _ in range(3):
        link.beat()  # what its beating thread puts every rl.heartbeat_s
        m.poll(force=True)
        clock.now += 1.0
    assert store.get_state_dict("alive/generator0")["ready"] is False
    assert m.live() == [] and lines == [] and not m.gone(0, "a")
    m.require("waiting")  # it is coming: no error
    link.set_ready()
    link.beat()
    m.poll(force=True)
    assert m.is_live(0, "a") and lines == ["trainer: generator 0 joined (1 live)"]

    beat(store, 0, "b", 10.0, ready=False)  # restarted: the new process warms up
    m.poll(force=True)
    assert m.gone(0, "a") and not m.is_live(0, "b") and m.live() == []
    assert "generator 0 restarted as a new process" in lines[-1]
    m.require("waiting")
    beat(store, 0, "b", 11.0)
    m.poll(force=True)
    assert m.is_live(0, "b") and lines[-1] == "trainer: generator 0 joined again (1 live)"

    beat(store, 0, "c", 12.0, ready=False)  # restarted again, and silent while warming up
    m.poll(force=True)
    clock.now += 6.5
    m.poll(force=True)
    with pytest.raises(RoleStopped, match="fewer than rl.min_generators=1"):
        m.require("waiting")


def test_min_generators_above_the_count_is_a_clear_error():
    with pytest.raises(ValueError, match="rl.min_generators=3 exceeds generator.count=2"):
        apply_overrides(tiny(), ["--generator.count", "2", "--rl.min_generators", "3"])
    with pytest.raises(ValueError, match="rl.lost_after_s=0.4 must exceed twice rl.heartbeat_s"):
        apply_overrides(tiny(), ["--rl.lost_after_s", "0.4"])
