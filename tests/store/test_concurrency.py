"""Readers in other processes during writes of new versions see only whole versions."""

import os

import torch.multiprocessing as mp

import tidal.store
from tests.store import _procs
from tests.store.conftest import shm_segments


def test_readers_see_whole_versions_during_writes():
    before = shm_segments(os.getpid())
    with tidal.store.connect(keep=2) as store:
        store.put_state_dict(_procs.payload(0), "c", version=0)
        # rank 0 writes versions 1..N-1; ranks 1 (shm) and 2 (tcp) read latest and older
        # versions until they saw the last one, checking every byte of every read.
        mp.spawn(_procs.writer_or_reader, args=(store.address,), nprocs=3)
        assert store.versions("c") == [_procs.VERSIONS - 2, _procs.VERSIONS - 1]
        # Retention held: 2 kept + 1 being written (+ ones leased at the time), not one per put.
        assert store.ls()["entries"][-1]["bytes"] == 8 * _procs.N + 8 * 1000
        # Slots: (2 kept + 1 written + at most 2 leased by the readers) x 2 tensors.
        assert len(shm_segments(os.getpid()) - before) <= 10
