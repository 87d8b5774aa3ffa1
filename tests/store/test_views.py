"""Zero-copy reads: get(..., copy=False) returns read-only views of the stored bytes."""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import tidal.store
from tests.store.conftest import shm_segments, until
from tidal.store import VersionNotFoundError, ops, testing


def _leases(store) -> int:
    return testing.leases(store)


def test_view_aliases_the_store_and_holds_its_version():
    with tidal.store.connect(keep=1) as writer, tidal.store.connect(writer.address) as reader:
        x = torch.arange(24.0).view(4, 6)
        writer.put("w", x)
        a = reader.get("w", copy=False)
        b = reader.get("w", version=0, copy=False)
        assert torch.equal(a, x) and a.shape == (4, 6) and a.dtype == torch.float32
        assert a.data_ptr() == b.data_ptr()  # both alias the same segment: nothing copied
        del b
        assert _leases(writer) == 1  # a's lease
        segments = shm_segments(os.getpid())
        for v in range(1, 4):  # version 0 is evicted (keep=1) but a still pins it
            writer.put("w", x + v)
        with pytest.raises(VersionNotFoundError, match="evicted"):
            reader.get("w", version=0)
        assert torch.equal(a, x), "a pinned version's bytes changed"
        assert len(shm_segments(os.getpid()) - segments) == 2  # ring without a's slot
        row = a[1]  # a view of the view keeps the version too
        del a
        gc.collect()
        assert _leases(writer) == 1
        del row
        assert _leases(writer) == 0  # released when the last view went, before del returned
        segments = shm_segments(os.getpid())
        for v in range(4, 8):
            writer.put("w", x + v)
        assert shm_segments(os.getpid()) == segments  # a's slot is back in the ring
        assert torch.equal(reader.get("w", copy=False), x + 7)


def test_state_dict_views_and_a_model_running_on_them():
    with tidal.store.connect() as writer, tidal.store.connect(writer.address) as reader:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        extra = {
            "half": torch.randn(3, 5).to(torch.bfloat16),
            "flags": torch.tensor([True, False, True]),
            "step": torch.tensor(7),
            "empty": torch.zeros(0, 3),
        }
        writer.put_state_dict({"model": model.state_dict(), "extra": extra}, "policy")
        got = reader.get_state_dict("policy", copy=False)
        for k, v in extra.items():
            assert got["extra"][k].dtype == v.dtype and torch.equal(got["extra"][k], v), k
        copy = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        copy.load_state_dict(got["model"], assign=True)  # the model's weights are the views
        del got
        x = torch.randn(2, 8)
        with torch.no_grad():
            assert torch.equal(copy(x), model(x))
        assert _leases(writer) == 1  # the model holds the version
        del copy
        assert _leases(writer) == 0


def test_waiting_zero_copy_read_returns_the_committed_version():
    with tidal.store.connect() as writer, tidal.store.connect(writer.address) as reader:
        writer.put_state_dict({"a": torch.zeros(1000)}, "m")
        pending = reader.get_state_dict_async("m", version=1, wait=30, copy=False)
        writer.put_state_dict({"a": torch.full((1000,), 5.0)}, "m")
        assert torch.equal(pending.result(timeout=30)["a"], torch.full((1000,), 5.0))


def test_views_keep_their_version_after_the_reader_closes():
    with tidal.store.connect(keep=1) as writer:
        reader = tidal.store.connect(writer.address)
        writer.put("w", torch.zeros(1000))
        view = reader.get("w", copy=False)
        reader.close()  # the views connection stays open while a view is alive
        for v in range(1, 5):
            writer.put("w", torch.full((1000,), float(v)))
        assert torch.equal(view, torch.zeros(1000)), "a closed reader's view was overwritten"
        assert _leases(writer) == 1
        del view  # the last view: its release closes the views connection
        until(lambda: _leases(writer) == 0, "the lease was not released")
        assert not testing.connection_open(reader, "views")


def test_views_dropped_in_a_store_thread_are_released_by_the_releaser():
    """A drop inside a thread of an in-process server (which may hold the controller's
    lock) must not send the release itself: the releaser thread does."""
    with tidal.store.connect() as s:
        s.put("t", torch.ones(100))
        sent_by: list[str] = []

        def sends(conn, op, fields):
            if op is ops.RELEASE and conn == "views":
                sent_by.append(threading.current_thread().name)

        testing.on_request(s, sends)

        def get_and_drop() -> None:
            view = s.get("t", copy=False)
            assert view.sum() == 100
            del view

        worker = threading.Thread(target=get_and_drop, name="tidal-store-test")
        worker.start()
        worker.join()
        until(lambda: _leases(s) == 0, "the releaser thread did not release the lease")
        assert sent_by == ["tidal-release"]


def test_views_released_from_other_threads():
    with tidal.store.connect(keep=1) as s:
        s.put("t", torch.ones(100))
        held = [s.get("t", copy=False) for _ in range(8)]
        done = threading.Event()

        def drop() -> None:
            held.clear()  # the last references go in this thread
            done.set()

        worker = threading.Thread(target=drop)
        worker.start()
        worker.join()
        assert done.is_set()
        for _ in range(100):  # releases may go through the releaser thread
            if _leases(s) == 0:
                break
            s.versions("t")  # a round trip, lets the releaser thread run
        assert _leases(s) == 0


def _put_two_row_shards(store, key: str, full: torch.Tensor) -> None:
    """Version 0 of ``key`` written by two writers, one row half each (as two ranks of an
    FSDP job would), through the put protocol itself."""
    rows = full.shape[0] // 2
    writers = [testing.raw(store.address) for _ in range(2)]
    for i, w in enumerate(writers):
        decl = {
            "name": [],
            "shape": list(full.shape),
            "dtype": "float32",
            "offsets": [i * rows, 0],
            "sizes": [rows, full.shape[1]],
        }
        d = w.request(
            ops.PUT_DECLARE,
            key=key,
            kind="tensor",
            writers=2,
            keep=None,
            host=testing.host(store),
            volume=None,
            tensors=[decl],
        )
        r = w.request(
            ops.PUT_BEGIN,
            key=key,
            plan=d["plan"],
            version=0,
            writer=f"w{i}",
            reservation=None,
            objects=[],
        )
        testing.write_slot(d["volume"], r["slots"][0], full[i * rows : (i + 1) * rows])
        w.request(ops.PUT_COMMIT, key=key, version=0, writer=f"w{i}", reserve=False)
    for w in writers:
        w.close()


def test_zero_copy_errors():
    with tidal.store.connect() as s:
        s.put("w", torch.ones(4))
        with pytest.raises(ValueError, match="takes no into"):
            s.get("w", into=torch.empty(4), copy=False)
        s.put_state_dict({"a": torch.ones(2)}, "sd")
        with pytest.raises(TypeError, match="use get_state_dict"):
            s.get("sd", copy=False)
        full = torch.arange(12.0).view(4, 3)
        _put_two_row_shards(s, "rows", full)
        with pytest.raises(ValueError, match="stored in 2 shards"):
            s.get("rows", copy=False)
        assert torch.equal(s.get("rows"), full)  # a copying read still works
        assert _leases(s) == 0
        with tidal.store.connect(s.address, transport="tcp") as remote:
            with pytest.raises(ValueError, match="cannot map"):
                remote.get("w", copy=False)
        assert _leases(s) == 0


def test_writing_into_a_view_faults_and_corrupts_nothing():
    with tidal.store.connect() as s:
        s.put("w", torch.arange(1000.0))
        child = textwrap.dedent(
            f"""
            import torch, tidal.store
            s = tidal.store.connect({s.address!r})
            v = s.get("w", copy=False)
            print("got", float(v[3]), flush=True)
            v.add_(1)
            print("wrote", flush=True)
            """
        )
        proc = subprocess.run(
            [sys.executable, "-c", child], capture_output=True, text=True, timeout=120
        )
        assert "got 3.0" in proc.stdout, proc.stderr
        assert "wrote" not in proc.stdout
        assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr[-2000:])
        assert torch.equal(s.get("w"), torch.arange(1000.0))
        assert torch.equal(s.get("w", copy=False), torch.arange(1000.0))
