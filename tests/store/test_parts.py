"""Slots stored in several part files (tidal/store/volume.py, ``PART_BYTES``).

``PART_BYTES`` is made three pages here, so tensors of a few tens of KB span several parts
and every path that writes or reads a slot (cold pwrite, mapped ring writes, populate, first
reads by preadv, mapped reads, zero-copy views, TCP) crosses part boundaries. The embedded
store runs in this process, so the server and the clients see the same value.
"""

import os
import subprocess
import sys

import pytest
import torch

import tidal.store
from tests.store.conftest import shm_segments
from tidal.store import StoreError, ops, testing, volume
from tidal.store.volume import Volume, map_segment, new_store_id, part_path, reap_stale

PART = 3 * 4096
EXACT = (3, 3 * 1024)  # float32: 36864 bytes, exactly 3 parts
UNEVEN = (5, 1001)  # float32: 20020 bytes, a full part and 7732 bytes
MANY = (64, 1000)  # float32: 256000 bytes, 21 parts, the last one short


@pytest.fixture(autouse=True)
def small_parts(monkeypatch):
    monkeypatch.setattr(volume, "PART_BYTES", PART)


def _sd(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {
        "exact": torch.randn(EXACT, generator=g),
        "uneven": torch.randn(UNEVEN, generator=g),
        "many": torch.randn(MANY, generator=g).to(torch.bfloat16),  # 11 parts
        "small": torch.arange(7) + v,  # one part
        "empty": torch.empty(0, 3),  # no file at all
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def _parts(nbytes: int) -> int:
    return -(-nbytes // PART)


def _slot_files() -> int:
    """Part files a slot of each tensor of ``_sd`` takes."""
    return sum(_parts(t.numel() * t.element_size()) for t in _sd(0).values())


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_cold_and_ring_puts_round_trip(transport):
    """Fresh slots (pwrite per part, or TCP writes into a populated multi-part mapping), then
    reused ones (mapped writes), read back by the writer and by another handle."""
    before = shm_segments(os.getpid())
    with (
        tidal.store.connect(keep=1, transport=transport) as writer,
        tidal.store.connect(writer.address, transport=transport) as reader,
    ):
        for v in range(4):
            writer.put_state_dict(_sd(v), "sd")
            _same(reader.get_state_dict("sd"), _sd(v))
            _same(writer.get_state_dict("sd"), _sd(v))
            if v == 0:  # every slot's bytes are in files of PART_BYTES at most
                files = shm_segments(os.getpid()) - before
                assert len(files) == _slot_files()
                for f in files:
                    assert os.path.getsize(f"/dev/shm/{f}") <= PART
        into = {k: torch.zeros_like(t) for k, t in _sd(3).items()}
        reader.get_state_dict("sd", into=into)
        _same(into, _sd(3))
    assert shm_segments(os.getpid()) == before  # close unlinked every part


def test_fresh_slots_written_through_a_mapping():
    """Sources pwrite cannot take as they are (non-contiguous, a cast) go through a mapping
    of the fresh slot, populated over the pool with pieces that stop at each part's end."""
    x = torch.randn(MANY[1], MANY[0])
    with tidal.store.connect(keep=1) as store:
        store.put("t", x.t())  # non-contiguous
        assert torch.equal(store.get("t"), x.t())
        store.put("cast", x, dtype=torch.bfloat16)
        assert torch.equal(store.get("cast"), x.to(torch.bfloat16))


def test_first_reads_use_preadv_and_later_ones_the_mapping():
    with tidal.store.connect(keep=2) as writer, tidal.store.connect(writer.address) as reader:
        writer.put_state_dict(_sd(0), "sd")
        _same(reader.get_state_dict("sd"), _sd(0))
        assert testing.mapped_segments(reader) == 0  # read with preadv, part by part
        # A non-contiguous destination cannot be read into with preadv: it maps.
        dst = torch.zeros(MANY[1], MANY[0], dtype=torch.bfloat16).t()
        got = reader.get_state_dict("sd", into={**_sd(1), "many": dst})
        assert torch.equal(got["many"], _sd(0)["many"])
        assert testing.mapped_segments(reader) > 0


def test_zero_copy_views_span_parts():
    with tidal.store.connect(keep=1) as writer, tidal.store.connect(writer.address) as reader:
        writer.put_state_dict(_sd(0), "sd")
        views = reader.get_state_dict("sd", copy=False)
        _same(views, _sd(0))
        many = views["many"]  # one flat range over 11 mappings
        assert many.is_contiguous()
        assert torch.equal(many[-1], _sd(0)["many"][-1])


def _declare(conn, rows, shape):
    decl = {
        "name": [],
        "shape": list(shape),
        "dtype": "float32",
        "offsets": [rows[0], 0],
        "sizes": [rows[1] - rows[0], shape[1]],
    }
    return conn.request(
        ops.PUT_DECLARE,
        key="sharded",
        kind="tensor",
        writers=2,
        keep=None,
        host="h",
        volume=None,
        tensors=[decl],
    )


def test_a_get_across_two_writers_shards():
    """Two writers' row shards, each over several parts, read back whole and into a
    non-contiguous destination (boxes of each shard, mapped)."""
    shape = (40, 1000)
    full = torch.randn(shape)
    with tidal.store.connect(keep=1) as store:
        conns = [testing.raw(store.address) for _ in range(2)]
        for i, (conn, rows) in enumerate(zip(conns, [(0, 13), (13, 40)], strict=True)):
            declared = _declare(conn, rows, shape)
            begun = conn.request(
                ops.PUT_BEGIN,
                key="sharded",
                plan=declared["plan"],
                version=0,
                writer=f"w{i}",
                reservation=None,
                objects=[],
            )
            slot = begun["slots"][0]
            testing.write_slot(declared["volume"], slot, full[rows[0] : rows[1]])
            conn.request(ops.PUT_COMMIT, key="sharded", version=0, writer=f"w{i}", reserve=False)
        assert torch.equal(store.get("sharded"), full)
        into = torch.zeros(shape[1], shape[0]).t()
        store.get("sharded", into=into)
        assert torch.equal(into, full)
        for conn in conns:
            conn.close()


def _put_files(store, key: str, x: torch.Tensor) -> list[str]:
    """Put ``x`` (one slot) and return the part files it made, part 0 first."""
    before = shm_segments(os.getpid())
    store.put(key, x)
    names = shm_segments(os.getpid()) - before
    base = min(names, key=len)
    files = [base] + [f"{base}.{k}" for k in range(1, len(names))]
    assert set(files) == names
    return [f"/dev/shm/{f}" for f in files]


def test_a_missing_or_changed_part_is_named():
    with tidal.store.connect(keep=1) as writer:
        files = _put_files(writer, "x", torch.randn(UNEVEN[0] * 4, UNEVEN[1]))  # 80080 bytes
        assert len(files) == 7
        os.truncate(files[5], 100)
        with tidal.store.connect(writer.address) as reader:
            with pytest.raises(StoreError, match=f"segment {files[5]} has 100 bytes, expected"):
                reader.get("x")
        os.unlink(files[3])
        with tidal.store.connect(writer.address) as reader:
            with pytest.raises(StoreError, match=f"{files[3]} is gone"):
                reader.get("x")
            with pytest.raises(StoreError, match=f"{files[3]} is gone"):
                reader.get("x", copy=False)


def test_volume_parts_on_disk(tmp_path):
    """A slot's parts, in order, are the bytes of its one flat mapping; destroy unlinks
    every part; a create that fails removes the parts it made and nothing else."""
    vol = Volume("v0", new_store_id(), shm_dir=str(tmp_path))
    try:
        vol.create(1, 4 * PART + 5)
        vol.create(2, 2 * PART)
        vol.create(3, 0)  # no file
        assert len(os.listdir(tmp_path)) == 5 + 2
        data = torch.randint(0, 256, (4 * PART + 5,), dtype=torch.uint8)
        vol.segment(1).copy_(data)
        for k in range(5):
            with open(part_path(vol.path(1), k), "rb") as f:
                assert f.read() == data[k * PART : (k + 1) * PART].numpy().tobytes()
        mapped = torch.frombuffer(map_segment(vol.path(1), 4 * PART + 5), dtype=torch.uint8)
        assert torch.equal(mapped, data)
        vol.destroy([1])
        assert sorted(os.listdir(tmp_path)) == sorted(
            os.path.basename(part_path(vol.path(2), k)) for k in range(2)
        )
        planted = vol.path(4, 2)
        open(planted, "w").close()
        with pytest.raises(StoreError, match=f"cannot create segment {planted}"):
            vol.create(4, 3 * PART)
        assert not os.path.exists(vol.path(4)) and not os.path.exists(vol.path(4, 1))
        assert os.path.exists(planted)
        os.unlink(planted)
    finally:
        vol.close()
    assert os.listdir(tmp_path) == []


def test_part_names_are_built_from_checked_ids(tmp_path):
    vol = Volume("v-1.2", new_store_id(), shm_dir=str(tmp_path))
    assert part_path(vol.path(12), 0) == vol.path(12)
    assert part_path(vol.path(12), 3) == vol.path(12) + ".3" == vol.path(12, 3)
    for bad in [vol.path(12, 1), str(tmp_path / "x"), vol.path(12) + "/..", "/dev/shm/../x"]:
        with pytest.raises(StoreError):
            part_path(bad, 1)


def test_reap_stale_removes_parts_of_dead_stores(tmp_path):
    from tidal.store.volume import pid_namespace

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # a pid that no longer runs
    ns = pid_namespace()
    dead = f"tidal-{ns}.{proc.pid}xabc123-v0-7"
    live = f"tidal-{ns}.{os.getpid()}xabc123-v0-7"
    reaped = [dead, f"{dead}.1", f"{dead}.12"]
    kept = [f"{live}.1", f"{dead}.0", f"{dead}.01", f"{dead}.1.2", f"{dead}.x", f"{dead}.1x"]
    for name in reaped + kept:
        (tmp_path / name).touch()
    assert reap_stale(str(tmp_path)) == len(reaped)
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


@pytest.mark.parametrize("streaming", [False, True])
def test_first_reads_of_boxes_that_start_inside_a_part(tmp_path, streaming):
    """Row boxes of a stored shard (a resharded read), read with preadv by a process that has
    not mapped the slot: each starts and ends wherever the rows do, not at a part's start."""
    from tidal.store.ops import VolumeInfo
    from tidal.store.segments import Segments
    from tidal.store.transports import ReadJob
    from tidal.store.transports.shm import ShmTransport

    shape = (40, 1000)  # float32: 160000 bytes, 14 parts
    full = torch.randn(shape)
    vol = Volume("v0", new_store_id(), shm_dir=str(tmp_path))
    record = VolumeInfo("v0", "shm", "h", "", vol.shm_dir, vol.store_id)
    try:
        vol.create(1, full.numel() * 4)
        vol.segment(1).copy_(full.view(-1).view(torch.uint8))
        for lo, hi in [(0, 40), (3, 4), (7, 29), (13, 40), (39, 40)]:
            shm = ShmTransport("h", Segments())  # nothing mapped, nothing read before
            dst = torch.zeros(hi - lo, shape[1])
            job = ReadJob(1, shape, torch.float32, (lo, 0), (hi - lo, shape[1]), dst)
            shm.read(record, [job], (lambda slot: None) if streaming else None)
            assert torch.equal(dst, full[lo:hi]), (lo, hi)
            assert len(shm.segments) == 0  # read with preadv, not mapped
            shm.close()
    finally:
        vol.close()


def test_a_symlink_planted_as_a_part_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * PART)
    with tidal.store.connect(keep=1) as writer:
        files = _put_files(writer, "x", torch.randn(3 * PART // 4))  # 3 parts
        os.unlink(files[1])
        os.symlink(victim, files[1])
        with tidal.store.connect(writer.address) as reader:
            with pytest.raises(StoreError, match=f"cannot open shared-memory segment {files[1]}"):
                reader.get("x")
            with pytest.raises(StoreError, match=f"segment {files[1]}"):
                reader.get("x", copy=False)
    assert victim.read_bytes() == b"v" * PART


def test_populate_maps_pages_several_a_fault_and_writable(tmp_path, monkeypatch):
    """``populate`` read-faults the pages of a slot that has them in (``MADV_POPULATE_READ``:
    the kernel's fault-around maps 16 pages a fault where a write fault maps one; 1,025
    faults here against 16,385 with ``MADV_POPULATE_WRITE``), and a tmpfs page needs no
    write notification, so they come in writable: the copy after it takes no fault of its
    own (mapped read-only, it would take one a page)."""
    import resource

    monkeypatch.setattr(volume, "PART_BYTES", 64 << 20)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = volume.segment_path(shm, new_store_id(), "vp", 1)
    nbytes = 64 << 20
    pages = nbytes // 4096
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.pwrite(fd, b"\0" * nbytes, 0)  # the pages exist, as in a pool file or a ring slot
        finally:
            os.close(fd)
        seg = volume.as_bytes(map_segment(path, nbytes))

        def faults() -> int:
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

        f0 = faults()
        volume.populate([(seg.data_ptr(), nbytes, path)])
        f1 = faults()
        seg.fill_(7)
        f2 = faults()
        assert f2 - f1 < pages // 64, f"the copy took {f2 - f1} faults for {pages} pages"
        assert f1 - f0 < pages // 4, f"populate took {f1 - f0} faults for {pages} pages"
        assert int(seg[::4096].sum()) == 7 * pages
    finally:
        os.unlink(path)
