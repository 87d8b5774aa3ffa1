import os
import time
from collections.abc import Callable

import pytest

import tidal.store
from tidal.store import testing


@pytest.fixture
def store():
    s = tidal.store.connect(keep=2)
    yield s
    s.close()


@pytest.fixture(params=["shm", "tcp"])
def transport_store(request):
    """The same embedded store read and written through each transport."""
    s = tidal.store.connect(keep=2, transport=request.param)
    yield s
    s.close()


def shm_segments(pid: int | None = None) -> set[str]:
    """tidal's shared-memory segments, only those of stores made by process `pid` if given
    (other test runs or stores on the machine must not count)."""
    return {
        f
        for f in os.listdir("/dev/shm")
        if f.startswith("tidal-") and (pid is None or f".{pid}x" in f)
    }


def until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Return once ``cond()`` holds (another thread or process makes it so); fail with
    ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def until_waited_for(store, key: str, version: int) -> None:
    """Return once the embedded controller of ``store`` knows a reader waits for the
    version (writers report their progress only then)."""
    until(
        lambda: testing.readers_waiting(store, key, version),
        "the waiting reader never reached the controller",
    )


@pytest.fixture
def victim(capfd):
    """An embedded store holding committed data; at the end, no server thread printed a
    traceback (every error path was an expected one). For tests/store/test_security_*.py."""
    from . import hostile  # it imports this module

    store = tidal.store.connect(keep=2)
    saved = hostile.saved_data(store)
    yield store, saved, hostile.baseline_of(store)
    store.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "failed:" not in err, err
