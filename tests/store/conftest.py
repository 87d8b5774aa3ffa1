import os

import pytest

import tidal.store


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
