"""Readers in other processes during writes of new versions see only whole versions; threads
of one handle waiting at once do not hold each other up."""

import os
import threading
import time

import torch

import tidal.store
from tests.parallel._launch import spawn
from tests.store import _procs
from tests.store.conftest import shm_segments


def test_readers_see_whole_versions_during_writes():
    before = shm_segments(os.getpid())
    with tidal.store.connect(keep=2) as store:
        store.put_state_dict(_procs.payload(0), "c", version=0)
        # rank 0 writes versions 1..N-1; ranks 1 (shm) and 2 (tcp) read latest and older
        # versions until they saw the last one, checking every byte of every read.
        spawn(_procs.writer_or_reader, (store.address,), 3)
        assert store.versions("c") == [_procs.VERSIONS - 2, _procs.VERSIONS - 1]
        # Retention held: 2 kept + 1 being written (+ ones leased at the time), not one per put.
        assert store.ls()["entries"][-1]["bytes"] == 8 * _procs.N + 8 * 1000
        # Slots: (2 kept + 1 written + at most 2 leased by the readers) x 2 tensors.
        assert len(shm_segments(os.getpid()) - before) <= 10


def test_a_thread_waiting_long_does_not_delay_another_threads_wait():
    # An RL generator's prefetch thread waits for the next policy version while its loop
    # waits for a queue slot on the same handle: the slot must be seen when it is written,
    # not when the other wait ends.
    with tidal.store.connect() as writer, tidal.store.connect(writer.address) as reader:
        seen: dict[str, float] = {}

        def wait_for(key: str, seconds: float) -> None:
            reader.get_state_dict(key, into={}, version=1, wait=seconds)
            seen[key] = time.monotonic()

        slow = threading.Thread(target=wait_for, args=("policy", 10.0))
        slow.start()
        time.sleep(0.2)  # the slow wait is in flight
        quick = threading.Thread(target=wait_for, args=("slot", 10.0))
        quick.start()
        time.sleep(0.2)
        put_at = time.monotonic()
        writer.put_state_dict({"x": torch.ones(2)}, "slot", version=1)
        quick.join(timeout=10)
        assert "slot" in seen and "policy" not in seen
        assert seen["slot"] - put_at < 1.0, seen["slot"] - put_at
        writer.put_state_dict({"x": torch.ones(2)}, "policy", version=1)
        slow.join(timeout=10)
        assert "policy" in seen
