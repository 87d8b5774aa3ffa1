"""The NIXL transport (tidal/store/transports/nixl.py) between processes of this machine,
forced with ``transport="nixl"`` (UCX over shared memory or TCP; ``tidal[nixl]``)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import tidal.store
from tests.parallel._launch import process, spawn
from tests.store import _nixl_procs
from tidal.store import StoreError
from tidal.store.transports import nixl

needs_nixl = pytest.mark.skipif(
    not nixl.available(),
    reason="NIXL is not installed (pip install 'tidal[nixl]': nixl-cu12 or nixl-cu13)",
)


def _run(target, *args, timeout: float = 120.0) -> None:
    proc = process(target, args)
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
        pytest.fail(f"{target.__name__} did not finish within {timeout:g} s")
    assert proc.exitcode == 0, f"{target.__name__} failed (exit code {proc.exitcode})"


def test_asking_for_nixl_without_it_installed_is_one_clear_line(monkeypatch):
    def missing(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(nixl.importlib, "import_module", missing)
    nixl.forget()  # load() imports again, and fails
    try:
        with tidal.store.connect() as store:
            with pytest.raises(StoreError, match=r"pip install 'tidal\[nixl\]'") as e:
                tidal.store.connect(store.address, transport="nixl")
            assert "\n" not in str(e.value)
            with tidal.store.connect(store.address) as auto:  # auto: nothing changes
                auto.put("w", torch.ones(3))
                assert torch.equal(auto.get("w"), torch.ones(3))
    finally:
        nixl.forget()  # later loads import the real module


def test_the_runs_of_a_strided_box_and_destination():
    from tidal.store.transports import ReadJob

    dst = torch.empty(6, 4).t()[1:3]  # rows of a column-major buffer: 1-element runs
    job = ReadJob(1, (4, 6), torch.float32, (1, 0), (2, 6), dst)
    assert nixl.run_shape(job, dst) == (1, 12) and not nixl.runs_ok(job)
    dst = torch.empty(2, 6)
    job = ReadJob(1, (4, 6), torch.float32, (1, 0), (2, 6), dst)
    assert nixl.run_shape(job, dst) == (12, 1)  # whole rows of a slot: one run
    big = torch.empty(4, 128)
    job = ReadJob(1, (4, 256), torch.float32, (0, 128), (4, 128), big)
    (src, n), (out, _) = nixl.runs(job, big)
    assert list(src) == [512 + i * 1024 for i in range(4)] and list(n) == [512] * 4
    assert list(out - big.data_ptr()) == [i * 512 for i in range(4)]


@needs_nixl
def test_every_dtype_round_trips_between_processes():
    with tidal.store.connect() as store:
        _run(_nixl_procs.put_every_dtype, store.address)
        _run(_nixl_procs.get_every_dtype, store.address)


@needs_nixl
def test_an_fsdp4_put_is_read_as_tp2_shards(tmp_path):
    with tidal.store.connect() as store:
        spawn(_nixl_procs.fsdp4_put, (4, store.address, str(tmp_path / "a")), 4)
        spawn(_nixl_procs.tp2_get, (2, store.address, str(tmp_path / "b")), 2)


@needs_nixl
def test_readers_during_version_churn_never_see_a_torn_version():
    with tidal.store.connect(keep=2) as store:
        procs = [
            process(_nixl_procs.churn_writer, (store.address,)),
            process(_nixl_procs.churn_reader, (store.address,)),
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
        for p in procs:
            if p.is_alive():
                p.kill()
        assert [p.exitcode for p in procs] == [0, 0]


@needs_nixl
def test_a_volume_killed_during_reads_is_a_clear_error_within_5_s():
    with tidal.store.connect() as store:
        parent, child = multiprocessing.Pipe()
        vol = process(_nixl_procs.volume_process, (store.address, child))
        vol.start()
        try:
            assert parent.poll(60), "the volume did not join"
            parent.recv()
            _run(_nixl_procs.put_big, store.address, 64 << 20)
            reader = tidal.store.connect(store.address, transport="nixl", timeout=10)
            out = torch.empty(8 << 20, dtype=torch.int64)
            reader.get("big", into=out, version=0)
            assert int(out[-1]) == (8 << 20) - 1
            errors: list[BaseException] = []
            stop = threading.Event()
            failed_at: list[float] = []

            def loop() -> None:
                while not stop.is_set():
                    try:
                        reader.get("big", into=out, version=0)
                    except StoreError as e:
                        failed_at.append(time.monotonic())
                        errors.append(e)
                        return

            t = threading.Thread(target=loop, daemon=True)
            t.start()
            time.sleep(0.3)  # reads in flight
            killed = time.monotonic()
            vol.kill()
            t.join(10)
            stop.set()
            assert not t.is_alive(), "a read hung after the volume died"
            assert errors and failed_at[0] - killed < 5.0
            assert "vol1" in str(errors[0]) or "volume" in str(errors[0]), str(errors[0])
            assert "\n" not in str(errors[0])
            reader.close()
        finally:
            if vol.is_alive():
                vol.kill()
            vol.join(10)


@pytest.mark.gpu
@needs_nixl
def test_host_slots_are_read_by_nixl_into_another_processs_gpu_tensors():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with tidal.store.connect() as store:
        _run(_nixl_procs.put_every_dtype, store.address)
        _run(_nixl_procs.get_every_dtype_cuda, store.address)


@needs_nixl
def test_auto_reads_a_volume_without_nixl_over_tcp(monkeypatch, caplog):
    from tidal.store.volume import Volume

    def refuse(self, slots):
        raise StoreError(f"volume {self.volume_id!r}: NIXL is not installed here")

    monkeypatch.setattr(Volume, "nixl_describe", refuse)
    monkeypatch.setattr(nixl, "has_rdma", lambda root="": True)
    with tidal.store.connect() as store:
        store.put("w", torch.arange(1000.0))
        reader = tidal.store.connect(store.address)  # auto
        monkeypatch.setattr(reader.session.shm, "reaches", lambda vol: False)  # as if off-host
        with caplog.at_level("WARNING", logger="tidal.store"):
            assert torch.equal(reader.get("w"), torch.arange(1000.0))
            assert torch.equal(reader.get("w"), torch.arange(1000.0))
        warned = [r.getMessage() for r in caplog.records if "over TCP" in r.getMessage()]
        assert len(warned) == 1 and "transport nixl" in warned[0], warned
        forced = tidal.store.connect(store.address, transport="nixl")
        with pytest.raises(StoreError, match="transport nixl: .*NIXL is not installed here"):
            forced.get("w")
        forced.close()
        reader.close()


@needs_nixl
def test_reads_into_fresh_tensors_keep_a_bounded_number_of_registrations():
    with tidal.store.connect() as store:
        store.put_state_dict({"a": torch.arange(4096.0), "b": torch.ones(64, 64)}, "k")
        with tidal.store.connect(store.address, transport="nixl") as reader:
            t = reader.session.nixl()
            into = {"a": torch.empty(4096), "b": torch.empty(64, 64)}
            for _ in range(3):  # into the same tensors: one request, registered once
                reader.get_state_dict("k", into=into)
            assert t.cached_layouts == 1 and t.registrations == 2
            for _ in range(3 * nixl.MAX_LAYOUTS):  # fresh tensors every time
                got = reader.get_state_dict("k")
                assert torch.equal(got["a"], torch.arange(4096.0))
            assert t.cached_layouts == nixl.MAX_LAYOUTS
            assert t.registrations == 2 * nixl.MAX_LAYOUTS
            assert t.messages == 1  # the volume was asked once


@needs_nixl
def test_a_store_that_served_nixl_reads_idles_at_no_cpu():
    """NIXL's own progress thread polls without a pause, a core per agent for the agent's
    life; tidal's agents run without it (the volume's is progressed by a thread that
    sleeps), so after reads on two lanes the volume and the reader idle, and closing them
    ends the threads they started."""

    def tasks() -> int:
        return len(os.listdir("/proc/self/task"))

    with tidal.store.connect() as store:
        store.put("w", torch.ones(1 << 21))  # 8 MiB: split across the lanes
        with tidal.store.connect(store.address, transport="nixl") as reader:
            assert torch.equal(reader.get("w"), torch.ones(1 << 21))
            assert len(reader.session.nixl().agents()) == nixl.lanes() >= 2
            busy = tasks()
            cpu = time.process_time()
            time.sleep(1.0)
            assert time.process_time() - cpu < 0.25  # NIXL's thread: about 1 s per agent
    deadline = time.monotonic() + 5
    while tasks() >= busy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tasks() < busy


@needs_nixl
def test_a_volume_progresses_its_agent_for_reads_that_need_it():
    """Over UCX's TCP (the volume's process restricted to it) a READ needs the volume's agent
    to make progress; NIXL's progress thread is off, and the volume's own thread gives it
    (with that thread idle, this read did not finish within its 15 s)."""
    with tidal.store.connect() as store:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tidal.store", "volume", "--controller", store.address]
            + ["--id", "vt", "--pool-gb", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "UCX_TLS": "tcp"},
        )
        try:
            line = proc.stdout.readline()  # printed once it serves ("" if it exits)
            assert "joined" in line, line + proc.stderr.read()
            with tidal.store.connect(store.address, volume="vt") as writer:
                writer.put("w", torch.ones(1 << 21))
            with tidal.store.connect(store.address, transport="nixl", timeout=15) as reader:
                assert torch.equal(reader.get("w"), torch.ones(1 << 21))
        finally:
            proc.kill()
            proc.wait(30)


@needs_nixl
@pytest.mark.parametrize("failure", ["registration", "peer"])
def test_a_registration_or_peer_failure_is_one_line_and_auto_falls_back(monkeypatch, failure):
    def fail(*args, **kwargs):
        raise RuntimeError("NIXL_ERR_BACKEND (simulated)")

    with tidal.store.connect() as store:
        store.put("w", torch.arange(1000.0))
        for transport in ("nixl", "auto"):
            reader = tidal.store.connect(store.address, transport=transport)
            agent = reader.session.nixl().agent()
            if failure == "registration":
                monkeypatch.setattr(agent, "register_memory", fail)
            else:
                monkeypatch.setattr(agent, "add_remote_agent", fail)
            if transport == "nixl":
                with pytest.raises(StoreError, match="transport nixl: cannot") as e:
                    reader.get("w")
                assert "'v0'" in str(e.value) and "\n" not in str(e.value)
            else:
                monkeypatch.setattr(nixl, "has_rdma", lambda root="": True)
                monkeypatch.setattr(reader.session.shm, "reaches", lambda vol: False)
                assert torch.equal(reader.get("w"), torch.arange(1000.0))  # over TCP
            reader.close()


def test_split_cuts_descriptors_into_equal_byte_ranges():
    local = np.array([[1000, 3 << 12, 0], [90000, 1 << 12, 0]], dtype=np.int64)
    far = np.array([[500, 3 << 12, 0], [70000, 1 << 12, 0]], dtype=np.int64)
    parts = nixl.split(local, far, 2)
    assert [p[0].tolist() for p in parts] == [
        [[1000, 2 << 12, 0]],
        [[1000 + (2 << 12), 1 << 12, 0], [90000, 1 << 12, 0]],
    ]
    assert parts[1][1].tolist() == [[500 + (2 << 12), 1 << 12, 0], [70000, 1 << 12, 0]]
    assert [len(p[0]) for p in nixl.split(local, far, 1)] == [2]
    small = np.array([[0, 100, 0]], dtype=np.int64)
    assert len(nixl.split(small, small, 4)) == 1  # nothing to cut under 4 KiB


def test_lanes_setting_is_checked(monkeypatch):
    monkeypatch.setenv(nixl.LANES_ENV, "3")
    assert nixl.lanes() == 3
    monkeypatch.setenv(nixl.LANES_ENV, "0")
    with pytest.raises(StoreError, match="TIDAL_NIXL_LANES='0'"):
        nixl.lanes()
