"""A volume's reserve of allocated part files (tidal/store/reserve.py): new slots take them,
destroyed slots refill it up to its size, and nothing is left behind.

``PART_BYTES`` is made three pages, as in test_parts.py, so a reserve of a few tens of KB is
several files and slots span several parts.
"""

import errno
import os

import pytest
import torch

import tidal.store
from tests.store.conftest import shm_segments
from tidal.store import StoreError, testing, volume
from tidal.store.volume import Volume, new_store_id

PART = 3 * 4096


@pytest.fixture(autouse=True)
def small_parts(monkeypatch):
    monkeypatch.setattr(volume, "PART_BYTES", PART)


def _reserve_files() -> set[str]:
    return {f for f in shm_segments(os.getpid()) if "-reserve." in f}


def _allocated(name: str) -> int:
    """Bytes of tmpfs pages a file holds."""
    return os.stat(os.path.join("/dev/shm", name)).st_blocks * 512


def _sd(v: int) -> dict[str, torch.Tensor]:
    return {
        "a": torch.full((5, 1001), float(v)),  # 20020 bytes: a full part and a short one
        "b": torch.arange(PART // 8) + v,  # exactly one part
    }


def test_new_slots_take_allocated_files_and_destroyed_ones_refill_the_reserve():
    before = shm_segments(os.getpid())
    with tidal.store.connect(keep=1, reserve=4 * PART) as store:
        files = _reserve_files()
        assert len(files) == 4 and all(_allocated(f) >= PART for f in files)  # touched
        assert testing.reserved(store) == 4 * PART
        store.put_state_dict(_sd(0), "p")
        assert testing.reserved(store) == PART  # 3 parts taken: a (2) and b (1)
        got = store.get_state_dict("p")
        assert torch.equal(got["a"], _sd(0)["a"]) and torch.equal(got["b"], _sd(0)["b"])
        store.put_state_dict(_sd(1), "p")  # the ring's second slots: the last file, then new
        assert testing.reserved(store) == 0
        store.delete("p")  # full-size parts go back, up to the reserve's size; the rest goes
        assert 2 * PART <= testing.reserved(store) <= 4 * PART
        for v in range(3):  # and are taken again by another key's slots
            store.put_state_dict(_sd(v), "q")
            assert torch.equal(store.get_state_dict("q")["a"], _sd(v)["a"])
    assert shm_segments(os.getpid()) == before  # close unlinked the reserve and the slots


def test_a_reserve_that_does_not_fit_is_refused_and_leaves_nothing(monkeypatch):
    before = shm_segments(os.getpid())
    calls = []

    def full(fd, offset, length):
        calls.append(fd)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(StoreError, match="cannot reserve .* bytes of shared memory in /dev/shm"):
        Volume("v0", new_store_id(), reserve=6 * PART)
    assert shm_segments(os.getpid()) == before
    with pytest.raises(ValueError, match="reserve must be a number of bytes >= 0"):
        Volume("v0", new_store_id(), reserve=-1)


def test_a_reserve_file_removed_behind_the_volumes_back_is_skipped():
    vol = Volume("v0", new_store_id(), reserve=2 * PART)
    try:
        first = sorted(_reserve_files())[0]
        os.unlink(os.path.join("/dev/shm", first))  # another process of this user did that
        vol.create(1, 2 * PART)  # two parts: the remaining file, then a fresh one
        assert vol.reserved == 0
        assert torch.equal(vol.segment(1), torch.zeros(2 * PART, dtype=torch.uint8))
    finally:
        vol.close()
    assert not _reserve_files()


def test_reserve_files_of_a_dead_store_are_reaped_like_its_slots():
    name = "tidal-4026531836.123x0abcde-v0-reserve.3"
    assert volume.owner_of(name) == (4026531836, 123)
    assert volume.owner_of(name[:-10] + "-7.2") == (4026531836, 123)  # a slot's part file
    assert volume.owner_of(name + "x") is None
    assert volume.owner_of(name.replace("reserve.3", "reserve.0")) is None


def test_a_part_takes_a_file_of_its_own_size_before_a_full_one(tmp_path):
    from tidal.store.reserve import Reserve

    r = Reserve(str(tmp_path), "tidal-1.2x0abcde-v0", 4096)
    r.fill([4096, 4096])
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert r.take(a, 100) and os.path.getsize(a) == 100 and r.bytes == 4096  # full, truncated
    assert r.give(a, 100) and not os.path.exists(a) and r.bytes == 4096 + 100
    assert r.take(b, 100) and r.bytes == 4096  # the 100-byte file, not the full one
    assert not r.give(b, 4097)  # larger than a part: never kept
    r.target = 4096 + 50
    assert not r.give(b, 100)  # past the target: the caller unlinks it
    r.close()
    assert sorted(os.listdir(tmp_path)) == ["b"]


def test_a_reserve_sized_for_a_state_dict_holds_every_part_its_first_put_needs():
    sd = _sd(0)
    sd["big"] = torch.zeros(3 * PART // 4 + 5)  # float32: 3 full parts and 20 bytes
    sizes = volume.reserve_for(sd)
    assert sorted(sizes) == sorted([PART, 20020 - PART, PART, PART, PART, PART, 20])
    with tidal.store.connect(keep=1, reserve=sd) as store:
        assert testing.reserved(store) == sum(sizes)
        store.put_state_dict(sd, "p")
        assert testing.reserved(store) == 0 and not _reserve_files()  # each one used
        assert torch.equal(store.get_state_dict("p")["big"], sd["big"])
    with pytest.raises(ValueError, match="reserve files hold 1 to"):
        Volume("v0", new_store_id(), reserve=[PART + 1])


def _wait_reserved(vol: Volume, nbytes: int, timeout: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while vol.reserved < nbytes:
        assert time.monotonic() < deadline, f"pool holds {vol.reserved} bytes, not {nbytes}"
        time.sleep(0.02)


def test_a_pool_fills_in_the_background_and_refills_after_new_slots_take_it():
    before = shm_segments(os.getpid())
    vol = Volume("v0", new_store_id(), pool=4 * PART)
    try:
        _wait_reserved(vol, 4 * PART)
        files = _reserve_files()
        assert len(files) == 4 and all(_allocated(f) >= PART for f in files)  # written
        vol.create(1, 2 * PART)  # two full parts, taken from the pool
        assert vol.reserved == 2 * PART
        _wait_reserved(vol, 4 * PART)  # topped up once no slot was created for a while
        vol.segment(1)[:] = 7
        assert int(vol.segment(1).sum()) == 7 * 2 * PART
    finally:
        vol.close()
    assert shm_segments(os.getpid()) == before  # the pool's files and the slot unlinked


def test_a_pool_waits_while_puts_commit(monkeypatch):
    """Steady puts create no slot but seal theirs at every commit: the pool does not refill
    behind them (it competed with them for the cores), and does once they stop."""
    import time

    monkeypatch.setattr(volume, "POOL_IDLE_S", 2.0)
    vol = Volume("v0", new_store_id(), pool=4 * PART)
    try:
        _wait_reserved(vol, 4 * PART)
        vol.create(1, 2 * PART)  # taken from the pool
        end = time.monotonic() + 3.0
        while time.monotonic() < end:  # a put committing every 50 ms
            vol.seal([1])
            assert vol.reserved == 2 * PART, "the pool refilled while puts were committing"
            time.sleep(0.05)
        _wait_reserved(vol, 4 * PART)  # refilled once they stopped
    finally:
        vol.close()


def test_a_pool_makes_files_of_the_sizes_new_slots_asked_for(tmp_path):
    from tidal.store.reserve import Reserve

    mib = 1 << 20
    r = Reserve(str(tmp_path), "tidal-1.2x0abcde-v0", 4 * mib)
    assert r.classes == [4 * mib, 2 * mib, mib]
    assert r.next_size(12 * mib) == 4 * mib  # at first a share of each class
    assert not r.take(str(tmp_path / "a"), 2 * mib - 4096)  # empty: records the demand
    assert r.next_size(12 * mib) == 2 * mib  # then the class that was asked for
    assert r.class_of(mib // 2) is None and r.class_of(3 * mib) == 4 * mib
    n = r.number()
    assert r.allocate(n, 2 * mib) is None
    r.add(n, 2 * mib)
    assert r.take(str(tmp_path / "b"), 2 * mib - 4096)  # the near size, truncated
    assert os.path.getsize(tmp_path / "b") == 2 * mib - 4096
    r.close()


def test_a_bad_pool_is_refused():
    with pytest.raises(ValueError, match="pool must be a number of bytes"):
        Volume("v0", new_store_id(), pool=-1)
