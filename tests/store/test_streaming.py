"""Streaming reads: get(..., wait=) copies a version while its writer is still writing it."""

import threading

import pytest
import torch

import tidal.store
from tests.store.conftest import until_waited_for
from tidal.store import ops, progress, testing
from tidal.store.errors import VersionNotFoundError


def _sd(v: float) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((256, 1024), v + i) for i in range(6)}  # 1 MiB each


def test_waiting_reader_streams_a_version_as_it_is_written(monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_BYTES", 1)  # report after every tensor
    with tidal.store.connect() as writer, tidal.store.connect(writer.address) as reader:
        writer.put_state_dict(_sd(0.0), "m")  # version 0: the layout is known
        into = {k: torch.zeros(256, 1024) for k in _sd(0.0)}
        # Hold the writer's commit until the reader has copied every tensor and waits for
        # the commit: the bytes were read while the version was still invisible.
        copied_all = threading.Event()

        def reader_sends(conn, op, fields):
            if op is ops.WAIT and fields["slots"] == []:  # the wait for the commit
                copied_all.set()

        def writer_sends(conn, op, fields):
            if op is ops.PUT_COMMIT:
                assert copied_all.wait(30), "the reader did not stream the pending version"
                assert reader.versions("m") == list(range(fields["version"]))  # invisible

        testing.on_request(reader, reader_sends)
        testing.on_request(writer, writer_sends)
        # Version 1 takes put_begin's slots; version 2 copies into the slots version 1's
        # commit reserved, its put_begin in flight: both stream.
        for v in (1, 2):
            copied_all.clear()
            pending = reader.get_state_dict_async("m", into=into, version=v, wait=30)
            until_waited_for(writer, "m", v)  # writers report progress only then
            assert writer.put_state_dict(_sd(10.0 * v), "m") == v
            pending.result(timeout=30)
            assert copied_all.is_set()
            for k, t in _sd(10.0 * v).items():
                assert torch.equal(into[k], t), (v, k)
        testing.on_request(writer, None)
        # A version nobody waits for is read as before, and waiting on a committed one too.
        assert torch.equal(reader.get_state_dict("m", version=1, wait=1)["w3"], _sd(10.0)["w3"])


def test_waiting_reader_of_an_aborted_version_gets_a_clear_error():
    with tidal.store.connect() as writer, tidal.store.connect(writer.address) as reader:
        writer.put("t", torch.zeros(4))  # version 0
        result: dict = {}

        def read():
            try:
                reader.get("t", version=1, wait=30)
            except Exception as e:  # noqa: BLE001 - the test inspects it
                result["error"] = e

        thread = threading.Thread(target=read)
        thread.start()
        conn = testing.raw(writer.address)
        decl = {"name": [], "shape": [4], "dtype": "float32", "offsets": [0], "sizes": [4]}
        plan = conn.request(
            ops.PUT_DECLARE,
            key="t",
            kind="tensor",
            writers=1,
            keep=None,
            host="h",
            volume=None,
            tensors=[decl],
        )["plan"]
        begin = conn.request(
            ops.PUT_BEGIN, key="t", plan=plan, version=1, writer="w1", reservation=None, objects=[]
        )
        assert begin["version"] == 1
        conn.request(ops.PUT_ABORT, key="t", version=1, writer="w1")
        thread.join(timeout=30)
        assert isinstance(result.get("error"), VersionNotFoundError)
        assert "aborted" in str(result["error"])
        assert torch.equal(reader.get("t"), torch.zeros(4))  # version 0 untouched
        conn.close()


def test_wait_times_out_with_a_clear_error():
    with tidal.store.connect() as store:
        store.put("t", torch.zeros(2))
        with pytest.raises(VersionNotFoundError, match="version 5 of key 't' was not written"):
            store.get("t", version=5, wait=0.3)
        with pytest.raises(ValueError, match="wait= needs a version number"):
            store.get("t", wait=1)


def test_writers_report_progress_only_when_a_reader_waits(monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_BYTES", 1)  # a report per tensor, if any
    with tidal.store.connect() as s:
        reports: list[list[int]] = []
        testing.on_request(
            s, lambda conn, op, f: reports.append(f["slots"]) if op is ops.PUT_PROGRESS else None
        )
        for _ in range(3):  # nobody waits: no round trips for progress, reserved or not
            s.put_state_dict(_sd(0.0), "m")
        assert reports == []
        pending = s.get_state_dict_async("m", version=3, wait=30)
        until_waited_for(s, "m", 3)
        s.put_state_dict(_sd(1.0), "m")
        assert torch.equal(pending.result(timeout=30)["w2"], _sd(1.0)["w2"])
        assert sum(len(r) for r in reports) >= 5  # every tensor but (at most) the last


def test_a_reserved_shard_another_writer_stored_first_is_not_reported(monkeypatch):
    """Two writers of each version hold the same (replicated) tensors: the first to begin
    stores them, and only its commit reserves their slots for the next put. When the other
    writer begins first next time, the reserved slots are taken back as replicas: the
    reserving writer must neither write on into them nor report them to a streaming reader.
    (It reported them, and the put failed with "slots [...] are not this writer's": a policy
    publish of a tensor-parallel trainer under `tidal rl`, tests/rl/test_loop_options.py.)"""
    monkeypatch.setattr(progress, "PROGRESS_BYTES", 1)  # report after every tensor
    with (
        tidal.store.connect() as a,
        tidal.store.connect(a.address) as b,
        tidal.store.connect(a.address) as reader,
    ):
        into = {k: torch.zeros(256, 1024) for k in _sd(0.0)}
        for v, order in enumerate([(a, b), (a, b), (b, a), (a, b), (b, a)]):
            pending = reader.get_state_dict_async("m", into=into, version=v, wait=30)
            until_waited_for(a, "m", v)
            for w in order:
                assert w.put_state_dict(_sd(10.0 * v), "m", version=v, writers=2) == v
            pending.result(timeout=30)
            for k, t in _sd(10.0 * v).items():
                assert torch.equal(into[k], t), (v, k)
