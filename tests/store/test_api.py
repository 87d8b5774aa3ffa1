"""Single-process API tests: round trips, versions, retention, errors, caching, async."""

import os
import threading

import pytest
import torch

import tidal.store
from tidal.store import KeyNotFoundError, VersionNotFoundError, ops, testing
from tidal.store.boxes import check_cover, flatten, intersect, unflatten

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES += [torch.float8_e4m3fn, torch.float8_e5m2]


def _rand(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 4
    if dtype == torch.bool:
        return x > 0
    if not dtype.is_floating_point:
        return (x * 100).to(dtype)
    return x.to(dtype)


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.element_size() == 1:  # fp8 has no equality kernel on every build: compare bytes
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a, b)


def test_round_trip_dtypes_and_shapes(transport_store):
    s = transport_store
    for i, dtype in enumerate(DTYPES):
        for shape in [(5, 7), (3,), (), (0,), (0, 4), (2, 3, 4)]:
            x = _rand(shape, dtype, seed=i)
            key = f"rt/{dtype}/{shape}"
            s.put(key, x)
            assert _same(s.get(key), x), key
            into = torch.zeros(shape, dtype=dtype)
            assert s.get(key, into=into) is into
            assert _same(into, x), key


def test_non_contiguous_source_and_destination(transport_store):
    s = transport_store
    base = _rand((8, 6), torch.float32)
    src = base.t()  # 6x8, column-major
    s.put("nc", src)
    assert torch.equal(s.get("nc"), src)
    dst_base = torch.zeros(8, 6)
    dst = dst_base.t()  # non-contiguous destination
    s.get("nc", into=dst)
    assert torch.equal(dst, src)
    # A strided slice as a source: only its elements are stored.
    sl = base[::2, 1::2]
    s.put("slice", sl)
    assert torch.equal(s.get("slice"), sl)


def test_versions_retention_delete_keys_exists(store):
    x = torch.arange(12.0).view(3, 4)
    assert store.put("a/w", x) == 0
    assert store.put("a/w", x + 1) == 1
    assert store.put("a/w", x + 2) == 2
    assert store.versions("a/w") == [1, 2]  # keep=2
    assert torch.equal(store.get("a/w"), x + 2)
    assert torch.equal(store.get("a/w", version=1), x + 1)
    with pytest.raises(VersionNotFoundError, match="evicted"):
        store.get("a/w", version=0)
    with pytest.raises(VersionNotFoundError, match="never written"):
        store.get("a/w", version=9)
    assert store.put("a/w", x + 7, version=7, keep=3) == 7
    assert store.versions("a/w") == [1, 2, 7]
    assert store.put("a/w", x + 8) == 8  # keep=3 sticks to the key
    assert store.versions("a/w") == [2, 7, 8]
    with pytest.raises(ValueError, match="immutable"):
        store.put("a/w", x, version=8)
    store.put("a/b", x)
    store.put("c", x)
    assert store.keys("a/") == ["a/b", "a/w"]
    assert store.keys() == ["a/b", "a/w", "c"]
    assert store.exists("a/w") and store.exists("a/w", 8) and not store.exists("a/w", 0)
    assert not store.exists("zzz")
    assert store.delete("a/w", version=8) == 1
    with pytest.raises(VersionNotFoundError, match="deleted"):
        store.get("a/w", version=8)
    assert torch.equal(store.get("a/w"), x + 7)
    assert store.delete("a/w") == 2
    assert not store.exists("a/w")
    with pytest.raises(KeyNotFoundError, match="a/w"):
        store.get("a/w")
    with pytest.raises(KeyNotFoundError):
        store.delete("a/w")
    assert store.keys() == ["a/b", "c"]
    # A deleted key can be written again from version 0.
    assert store.put("a/w", x) == 0


def test_bad_input_errors(store):
    x = torch.zeros(4, 5)
    store.put("w", x)
    with pytest.raises(ValueError, match=r"global shape \[5, 4\].*\[4, 5\]"):
        store.get("w", into=torch.zeros(5, 4))
    with pytest.raises(ValueError, match="float64"):
        store.get("w", into=torch.zeros(4, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match="holds a tensor; use get"):
        store.get_state_dict("w")
    store.put_state_dict({"a": x}, "sd0")
    with pytest.raises(TypeError, match="holds a state dict; use get_state_dict"):
        store.get("sd0")
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        store.put("w2", [1, 2, 3])
    with pytest.raises(TypeError, match="holds a tensor"):
        store.put_state_dict({"a": x}, "w")
    with pytest.raises(ValueError, match="key must be"):
        store.put("", x)
    with pytest.raises(ValueError, match="explicit version"):
        store.put("multi", x, writers=2)
    with pytest.raises(TypeError, match="is a object"):
        store.put_state_dict({"a": x, "step": object()}, "sd")
    with pytest.raises(ValueError, match="version must be a non-negative int"):
        store.get("w", version=-1)
    with pytest.raises(ValueError, match=r"version must be an int in \[0, "):
        store.put("w", x, version=-1)
    with pytest.raises(ValueError, match=r"keep must be an int in \[1, "):
        store.put("w", x, keep=0)
    with pytest.raises(ValueError, match=r"writers must be an int in \[1, "):
        store.put("w", x, writers=0)
    with pytest.raises(ValueError, match=r"version must be an int in \[0, "):
        store.put("w", x, version=True)
    # Nothing stored was disturbed by the failures.
    assert torch.equal(store.get("w"), x)


def test_state_dict_round_trip_and_partial_into(transport_store):
    s = transport_store
    sd = {
        "emb": _rand((10, 4), torch.bfloat16),
        "layers": [
            {"w": _rand((4, 4), torch.float32, i), "b": _rand((4,), torch.float32)}
            for i in range(3)
        ],
        "step": torch.tensor(5),
    }
    v = s.put_state_dict(sd, "model")
    out = s.get_state_dict("model", version=v)
    assert torch.equal(out["emb"], sd["emb"])
    assert isinstance(out["layers"], list) and len(out["layers"]) == 3
    for a, b in zip(out["layers"], sd["layers"], strict=True):
        assert torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])
    assert out["step"].item() == 5
    into = {"layers": [{"w": torch.zeros(4, 4)}]}  # a subset: only this tensor is read
    s.get_state_dict("model", into=into)
    assert torch.equal(into["layers"][0]["w"], sd["layers"][0]["w"])
    with pytest.raises(KeyError, match="no tensor 'missing.x'"):
        s.get_state_dict("model", into={"missing": {"x": torch.zeros(1)}})


def test_dtype_on_put_and_cast_on_get(transport_store):
    """An fp32 state dict published as bf16 (cast while copying), read back into fp32 and
    float64 destinations only with cast=True; without it a dtype mismatch is a clear error.
    Through each transport."""
    store = transport_store
    sd = {"w": _rand((64, 33), torch.float32, 1), "b": _rand((33,), torch.float32, 2), "step": 7}
    store.put_state_dict(sd, "p", dtype=torch.bfloat16)
    as_bf16 = {k: sd[k].to(torch.bfloat16) for k in ("w", "b")}
    out = store.get_state_dict("p")
    assert out["step"] == 7
    for k, v in as_bf16.items():
        assert out[k].dtype == torch.bfloat16 and torch.equal(out[k], v)
    into = {"w": torch.zeros(64, 33), "b": torch.zeros(33, dtype=torch.float64)}
    with pytest.raises(ValueError, match="float32.*bfloat16; pass cast=True"):
        store.get_state_dict("p", into=into)
    assert not into["w"].any()  # nothing written by the refused read
    store.get_state_dict("p", into=into, cast=True)
    for k, v in as_bf16.items():
        assert into[k].dtype != torch.bfloat16 and torch.equal(into[k], v.to(into[k].dtype))
    part = torch.zeros(64, 33)
    assert store.get_state_dict("p", into={"w": part}, cast=True)["w"] is part
    assert torch.equal(part, as_bf16["w"].float())
    one = torch.zeros(33, dtype=torch.float16)
    store.put("t", sd["b"])
    store.get("t", into=one, cast=True)
    assert torch.equal(one, sd["b"].half())


def test_read_plan_cache_no_extra_metadata(store):
    sd = {f"l{i}.w": torch.full((16, 8), float(i)) for i in range(20)}
    into = {k: torch.empty_like(v) for k, v in sd.items()}
    store.put_state_dict(sd, "m")
    store.get_state_dict("m", into=into)
    assert store.metadata_fetches == 1 and store.plans_built == 1
    for step in range(1, 4):
        store.put_state_dict({k: v + step for k, v in sd.items()}, "m")
        store.get_state_dict("m", into=into)
        assert torch.equal(into["l3.w"], sd["l3.w"] + step)
    # New versions of the same layout: no layout from the controller, no new plan.
    assert store.metadata_fetches == 1 and store.plans_built == 1
    store.get_state_dict("m", into={"l3.w": torch.empty(16, 8)})  # another destination
    assert store.metadata_fetches == 1 and store.plans_built == 2


def test_async_variants(store):
    x = torch.randn(64, 64)
    fut = store.put_async("x", x)
    assert fut.result(timeout=30) == 0
    into = torch.empty(64, 64)
    assert store.get_async("x", into=into).result(timeout=30) is into
    assert torch.equal(into, x)
    sd = {"a": x, "b": x * 2}
    store.put_state_dict_async(sd, "sd").result(timeout=30)
    got = store.get_state_dict_async("sd").result(timeout=30)
    assert torch.equal(got["b"], x * 2)


def test_threads_read_only_whole_versions(store):
    """Readers in threads during writes of new versions: every read is one whole version."""
    n, versions = 1 << 16, 60
    errors: list[str] = []
    done = threading.Event()
    store.put("c", torch.zeros(n))

    def reader() -> None:
        into = torch.empty(n)
        while not done.is_set():
            store.get("c", into=into)
            if not torch.equal(into, torch.full((n,), into[0].item())):
                errors.append(f"mixed versions: {into.unique()[:5]}")

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for v in range(1, versions):
        store.put("c", torch.full((n,), float(v)))
    done.set()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert store.get("c")[0].item() == versions - 1


def test_deleted_version_while_leased_keeps_bytes(store):
    """A version deleted while a reader holds it keeps its bytes until released; the next
    writer does not get its slot."""
    x = torch.arange(1000.0)
    store.put("k", x)
    conn = testing.raw(store.address)
    acquire = {"key": "k", "known_sig": None, "wait_ms": None}
    reply = conn.request(ops.ACQUIRE, version=0, **acquire)
    store.delete("k", version=0)
    store.put("k", x + 1, version=1)
    assert reply["slots"][0] not in conn.request(ops.ACQUIRE, version=1, **acquire)["slots"]
    # The leased version still holds version 0's bytes.
    seg = torch.empty(1000)
    testing_read = testing.read_slot(reply["volumes"][0], reply["slots"][0], seg)
    assert torch.equal(testing_read, x)
    conn.request(ops.RELEASE, lease=reply["lease"])
    with pytest.raises(VersionNotFoundError, match="deleted"):
        store.get("k", version=0)
    with pytest.raises(ValueError, match="not held by this connection"):
        store_conn = testing.raw(store.address)
        store_conn.request(ops.RELEASE, lease=reply["lease"] + 1)
    conn.close()


def test_slots_are_reused_as_a_ring(store):
    from tests.store.conftest import shm_segments

    before = shm_segments(os.getpid())
    for v in range(10):
        store.put("ring", torch.full((1000,), float(v)))
    created = shm_segments(os.getpid()) - before
    assert len(created) == 3  # keep=2 plus the one being written


def test_embedded_store_frees_memory_on_close():
    from tests.store.conftest import shm_segments

    before = shm_segments(os.getpid())
    s = tidal.store.connect()
    s.put("x", torch.ones(1000))
    assert len(shm_segments(os.getpid()) - before) == 1
    s.close()
    assert shm_segments(os.getpid()) - before == set()


def test_connect_reads_env(monkeypatch, store):
    store.put("env", torch.ones(3))
    monkeypatch.setenv("TIDAL_STORE", store.address)
    with tidal.store.connect() as other:
        assert other.address == store.address
        assert torch.equal(other.get("env"), torch.ones(3))


def test_layout_helpers():
    assert intersect((0, 0), (4, 4), (2, 3), (4, 4)) == ((2, 3), (2, 1))
    assert intersect((0,), (2,), (2,), (2,)) is None
    assert check_cover((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))]) is None
    assert "cover 8 of 16" in check_cover((4, 4), [((0, 0), (2, 4))])
    assert "overlap" in check_cover((4,), [((0,), (3,)), ((2,), (2,))])
    sd = {"a": {"b": torch.ones(1)}, "l": [torch.zeros(1), torch.ones(2)]}
    flat = flatten(sd)
    assert [p for p, _ in flat] == [("a", "b"), ("l", 0), ("l", 1)]
    back = unflatten(flat)
    assert isinstance(back["l"], list) and torch.equal(back["l"][1], torch.ones(2))


def _declare(conn, rows, writers=2, key="mw"):
    """A plan for rows lo:hi of a 6 x 4 float32 tensor, declared on a raw connection."""
    lo, hi = rows
    decl = {
        "name": [],
        "shape": [6, 4],
        "dtype": "float32",
        "offsets": [lo, 0],
        "sizes": [hi - lo, 4],
    }
    return conn.request(
        ops.PUT_DECLARE,
        key=key,
        kind="tensor",
        writers=writers,
        keep=None,
        host="h",
        volume=None,
        tensors=[decl],
    )


def _begin(conn, plan, version, writer, key="mw"):
    return conn.request(
        ops.PUT_BEGIN,
        key=key,
        plan=plan,
        version=version,
        writer=writer,
        reservation=None,
        objects=[],
    )


def _commit(conn, version, writer, key="mw"):
    return conn.request(ops.PUT_COMMIT, key=key, version=version, writer=writer, reserve=False)[
        "visible"
    ]


def test_multi_writer_versions(store):
    """Two writers of one version: visible only after both commit; a writer that closes
    after committing does not abort it; one that leaves before committing does."""
    full = torch.arange(24.0).view(6, 4)
    a, b = testing.raw(store.address), testing.raw(store.address)

    def half(conn, rows, writer):
        lo, hi = rows
        declared = _declare(conn, rows)
        slot = _begin(conn, declared["plan"], 0, writer)["slots"][0]
        testing.write_slot(declared["volume"], slot, full[lo:hi])
        return _commit(conn, 0, writer)

    assert half(a, (0, 2), "wa") is False
    a.close(graceful=True)  # committed, then gone: the version stays pending, not aborted
    assert not store.exists("mw", 0)
    with pytest.raises(VersionNotFoundError, match="1 of 2 writers"):
        store.get("mw", version=0)
    assert half(b, (2, 6), "wb") is True
    assert torch.equal(store.get("mw"), full)
    b.close()
    # A writer that disconnects before committing aborts the version.
    c = testing.raw(store.address)
    _begin(c, _declare(c, (0, 2))["plan"], 1, "wc")
    c.close(graceful=True)  # "bye": the server cleans up before it answers
    with pytest.raises(VersionNotFoundError, match="aborted: a writer disconnected"):
        store.get("mw", version=1)
    # Writers whose shards leave a gap: the last commit fails, readers never see it.
    d = testing.raw(store.address)
    _begin(d, _declare(d, (0, 2), writers=1)["plan"], 2, "wd")
    with pytest.raises(ValueError, match="cover 8 of 24"):
        _commit(d, 2, "wd")
    d.close()
    assert store.versions("mw") == [0]


def test_a_layout_cached_while_pending_reads_the_committed_version_right(store):
    """Writers that begin in the other order than their shards' offsets: a reader that
    cached the layout during a waiting read of the pending version (shards in arrival order)
    and reads the committed one (shards sorted by offsets, same layout signature) gets every
    row in its place. (Before the fix the two writers' rows came back swapped: an RL
    generator reading a 2-rank FSDP trainer's weights got each parameter's halves swapped.)"""
    from tidal.store.errors import WaitExpiredError

    full = torch.arange(24.0).view(6, 4)
    a, b = testing.raw(store.address), testing.raw(store.address)
    begun = []
    for conn, rows, writer in ((b, (2, 6), "wb"), (a, (0, 2), "wa")):  # the later rows first
        declared = _declare(conn, rows)
        slot = _begin(conn, declared["plan"], 0, writer)["slots"][0]
        testing.write_slot(declared["volume"], slot, full[rows[0] : rows[1]])
        begun.append((conn, writer))
    with tidal.store.connect(store.address) as reader:
        with pytest.raises(WaitExpiredError, match="not completely written"):
            reader.get("mw", into=torch.zeros(6, 4), version=0, wait=0.2)  # caches the layout
        assert [_commit(conn, 0, w) for conn, w in begun] == [False, True]
        assert torch.equal(reader.get("mw", version=0), full)
        assert torch.equal(reader.get("mw", into=torch.zeros(6, 4), version=0), full)
        assert reader.metadata_fetches == 1  # the cached layout was used, in the right order
    a.close()
    b.close()


def test_reader_unmaps_deleted_segments(store):
    with tidal.store.connect(store.address) as reader:
        store.put("gone", torch.ones(1000))
        assert torch.equal(reader.get("gone"), torch.ones(1000))  # the first read: preadv
        assert testing.mapped_segments(reader) == 0
        assert torch.equal(reader.get("gone"), torch.ones(1000))  # then through a mapping
        assert testing.mapped_segments(reader) == 1
        store.delete("gone")
        store.put("gone", torch.ones(10, 10))  # a new layout for the key
        reader.get("gone")
        reader.get("gone")
        assert testing.mapped_segments(reader) == 1  # the deleted slot's mapping was dropped


def test_a_transport_implements_write_read_and_close():
    """`Transport`'s three methods are abstract; its hooks have working defaults."""
    from tidal.store.transports import Transport, WriteJob

    class Partial(Transport):
        def write(self, vol, jobs, progress, grant):
            pass

    with pytest.raises(TypeError, match="abstract"):  # read and close are missing
        Partial()

    class Whole(Partial):
        def read(self, vol, jobs, gate):
            pass

        def close(self):
            pass

    t = Whole()
    jobs = [WriteJob(slot=i, src=torch.zeros(4), dtype=torch.float32) for i in range(3)]
    t.prepare_write(jobs)
    t.slots_freed([0])
    early, rest = t.split_early(jobs)
    assert early + rest == jobs and early
