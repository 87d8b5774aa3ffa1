"""Hostile local clients against a store server: ops out of role, and paths from the wire.

See tests/store/hostile.py for how each attack is judged.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tidal.cli
import tidal.store
from tidal.store import StoreError, VolumeLostError, ops, testing
from tidal.store.standalone import run_volume
from tidal.store.volume import new_store_id

from .conftest import until
from .hostile import (
    FakeVolume,
    W,
    acquire_raw,
    alive_volumes,
    baseline_of,
    begin_raw,
    declaration,
    healthy,
    msg_bytes,
    open_fds,
    raw_sock,
    read_key,
    read_reply,
    vol_write_request,
)

# ------------------------------------------------------------------------ ops out of role


def test_only_the_writer_connection_reports_commits_or_aborts_its_write(victim):
    """Another connection, even naming the same writer, cannot report, commit or abort a
    pending write; the writer's own commit then publishes its bytes."""
    store, saved, base = victim
    writer = testing.raw(store.address)
    declared, begun = begin_raw(writer, store, "k", writer="w1")
    slot, version = begun["slots"][0], begun["version"]
    testing.write_slot(declared["volume"], slot, W * 2)
    other = testing.raw(store.address)
    fields = {"key": "k", "version": version, "writer": "w1"}
    for op, extra in [
        (ops.PUT_PROGRESS, {"slots": [slot]}),
        (ops.PUT_COMMIT, {"reserve": True}),
        (ops.PUT_ABORT, {}),
    ]:
        with pytest.raises(ValueError, match="on another connection"):
            other.request(op, **fields, **extra)
        with pytest.raises(ValueError, match="no pending write"):
            other.request(op, **{**fields, "writer": "w2"}, **extra)
    # Nor join it as a second writer of a one-writer version, nor reuse its plan.
    plan = other.request(
        ops.PUT_DECLARE,
        key="k",
        kind="tensor",
        writers=1,
        keep=None,
        host=testing.host(store),
        volume=None,
        tensors=[declaration(250)],
    )["plan"]
    with pytest.raises(ValueError, match="already has its 1 writers"):
        other.request(
            ops.PUT_BEGIN,
            key="k",
            plan=plan,
            version=version,
            writer="w2",
            reservation=None,
            objects=[],
        )
    with pytest.raises(ValueError, match="not one of this connection"):
        other.request(
            ops.PUT_BEGIN,
            key="k",
            plan=declared["plan"],
            version=None,
            writer="w1",
            reservation=None,
            objects=[],
        )
    assert not store.exists("k")
    assert writer.request(ops.PUT_COMMIT, **fields, reserve=False)["visible"]
    assert torch.equal(read_key(store, "k"), W * 2)
    with pytest.raises(ValueError, match="no pending write"):
        other.request(ops.PUT_ABORT, **fields)
    other.close()
    writer.close()
    assert torch.equal(read_key(store, "k"), W * 2)
    store.delete("k")
    healthy(store, saved, base)


def test_reservations_and_leases_of_another_connection(victim):
    """A reservation or a lease is used or released only by the connection that holds it."""
    store, saved, base = victim
    owner, thief = testing.raw(store.address), testing.raw(store.address)
    declared = None
    for v in range(2):  # the second commit reserves slots for the third put
        declared, begun = begin_raw(owner, store, "r", writer="w1")
        done = owner.request(
            ops.PUT_COMMIT, key="r", version=begun["version"], writer="w1", reserve=v == 1
        )
    reservation = done["next"]
    assert reservation is not None and declared is not None
    tplan = thief.request(
        ops.PUT_DECLARE,
        key="r",
        kind="tensor",
        writers=1,
        keep=None,
        host=testing.host(store),
        volume=None,
        tensors=[declaration(250)],
    )["plan"]
    with pytest.raises(ValueError, match="not held by this connection"):
        thief.request(
            ops.PUT_BEGIN,
            key="r",
            plan=tplan,
            version=None,
            writer="w2",
            reservation=reservation["id"],
            objects=[],
        )
    # The owner's reservation still works.
    begun = owner.request(
        ops.PUT_BEGIN,
        key="r",
        plan=declared["plan"],
        version=None,
        writer="w1",
        reservation=reservation["id"],
        objects=[],
    )
    assert begun["slots"] == reservation["slots"]
    owner.request(ops.PUT_ABORT, key="r", version=begun["version"], writer="w1")
    lease = acquire_raw(owner, "w")["lease"]
    held = testing.leases(store)
    with pytest.raises(ValueError, match="not held by this connection"):
        thief.request(ops.RELEASE, lease=lease)
    assert testing.leases(store) == held
    assert owner.request(ops.RELEASE, lease=lease)["lost"] is False
    with pytest.raises(ValueError, match="not held by this connection"):
        owner.request(ops.RELEASE, lease=lease)  # twice
    owner.close()
    thief.close()
    store.delete("r")
    healthy(store, saved, base)


def test_volume_ops_are_served_on_no_port(victim, tmp_path):
    """vol_create / vol_destroy / vol_grant / vol_seal (and register_volume on a volume's
    port) are refused on the controller's port and on a volume process's data port; what
    the volumes hold is unchanged."""
    store, saved, _ = victim
    ready = threading.Event()
    where: dict[str, str] = {}
    t = threading.Thread(
        target=run_volume,
        args=(store.address, "vp"),
        daemon=True,
        kwargs={"shm_dir": str(tmp_path), "ready": lambda a: (where.update(a=a), ready.set())},
    )
    t.start()
    assert ready.wait(30), "the volume process never registered"
    base = baseline_of(store)  # with the volume process's server and registration
    with tidal.store.connect(store.address, volume="vp") as w:
        w.put("remote", W * 3)
    slots = list(range(1, 64))
    hostile = [
        (ops.VOL_DESTROY, {"slots": slots}),
        (ops.VOL_CREATE, {"segments": [{"slot": 1 << 40, "nbytes": 1 << 30}]}),
        (ops.VOL_GRANT, {"slots": slots, "grant": bytes(16)}),
        (ops.VOL_SEAL, {"slots": slots}),
    ]
    segments = sorted(os.listdir(tmp_path))
    for address, where_ in [
        (store.address, "registration connection"),
        (where["a"], "registration connection"),
    ]:
        conn = testing.raw(address)
        for op, fields in hostile:
            with pytest.raises(ValueError, match=where_):
                conn.request(op, **fields)
        conn.close()
    vconn = testing.raw(where["a"])
    with pytest.raises(ValueError, match="served by a controller"):
        vconn.request(
            ops.REGISTER_VOLUME,
            volume_id="evil",
            address="tcp://127.0.0.1:9",
            host="h",
            shm_dir=str(tmp_path),
            store_id=new_store_id(),
        )
    with pytest.raises(ValueError, match="served by a controller"):
        vconn.request(ops.KEYS, prefix="")
    vconn.close()
    # A grant guessed for the remote volume's committed slot is refused on its port too.
    reader = testing.raw(store.address)
    slot = acquire_raw(reader, "remote")["slots"][0]
    s = raw_sock(where["a"])
    s.sendall(msg_bytes(vol_write_request(slot, bytes(16), 8), 8) + b"\xff" * 8)
    assert "not open for writing" in read_reply(s)["error"]
    s.close()
    reader.close()
    assert sorted(os.listdir(tmp_path)) == segments
    assert torch.equal(read_key(store, "remote"), W * 3)
    with tidal.store.connect(store.address, transport="tcp") as r:
        assert torch.equal(r.get("remote"), W * 3)
        assert torch.equal(r.get("w"), W)
    store.delete("remote")
    assert alive_volumes(store) == {"v0": True, "vp": True}
    healthy(store, saved, base)


def test_committed_slots_are_never_written_over_tcp(victim):
    """vol_write into a committed slot with a guessed grant, with the stale grant of its own
    (committed) write, or with the grant of the writer's next reservation: refused, the
    payload drained, the bytes and listing unchanged. The pending slot takes the right
    grant (the check can fail)."""
    store, saved, base = victim
    writer = testing.raw(store.address)
    grants = []
    for v in range(2):
        declared, begun = begin_raw(writer, store, "imm", writer="w1")
        testing.write_slot(declared["volume"], begun["slots"][0], W + v)
        grants.append((begun["slots"][0], begun["grant"]))
        done = writer.request(ops.PUT_COMMIT, key="imm", version=v, writer="w1", reserve=v == 1)
    reserved = done["next"]
    committed = [slot for slot, _ in grants]
    s = raw_sock(store.address)
    tries = [
        (slot, g)
        for slot in committed
        for g in [bytes(16), b"\xff" * 16, grants[0][1], grants[1][1], reserved["grant"]]
    ]
    for slot, grant in tries:
        s.sendall(msg_bytes(vol_write_request(slot, grant, 1000), 1000) + b"\xee" * 1000)
        reply = read_reply(s)
        assert not reply["ok"] and "not open for writing" in reply["error"], (slot, reply)
    # Right grant, wrong place: outside the slot.
    s.sendall(
        msg_bytes(vol_write_request(reserved["slots"][0], reserved["grant"], 8, offset=996), 8)
        + b"x" * 8
    )
    assert "exceeds slot" in read_reply(s)["error"]
    # The reserved slot of the next put takes its grant: the refusals above were real.
    s.sendall(
        msg_bytes(vol_write_request(reserved["slots"][0], reserved["grant"], 1000), 1000)
        + b"\x01" * 1000
    )
    assert read_reply(s)["ok"]
    s.close()
    for v in range(2):
        assert torch.equal(read_key(store, "imm", version=v), W + v)
    assert {(e["key"], e["version"]) for e in store.ls("imm")["entries"]} == {
        ("imm", 0),
        ("imm", 1),
    }
    writer.close()
    store.delete("imm")
    healthy(store, saved, base)


def test_device_volumes_of_another_writer(victim):
    """A connection's device volume (GPU memory; no GPU is needed to register one) is
    written, declared into or given IPC handles only by that connection."""
    store, saved, base = victim
    owner, thief = testing.raw(store.address), testing.raw(store.address)
    owner.request(ops.DEVICE_VOLUME, volume_id="cuda.1.aa", host=testing.host(store))
    with pytest.raises(ValueError, match="already registered"):
        thief.request(ops.DEVICE_VOLUME, volume_id="cuda.1.aa", host=testing.host(store))
    with pytest.raises(ValueError, match="already registered"):
        thief.request(ops.DEVICE_VOLUME, volume_id="v0", host=testing.host(store))
    with pytest.raises(ValueError, match="GPU memory of another writer"):
        thief.request(
            ops.PUT_DECLARE,
            key="g",
            kind="tensor",
            writers=1,
            keep=None,
            host=testing.host(store),
            volume="cuda.1.aa",
            tensors=[declaration(4)],
        )
    handle = {
        "slot": 1,
        "uuid": "GPU-evil",
        "handle": b"\xaa" * ops.HANDLE_BYTES,
        "offset": 0,
        "span": 512,
        "event": b"\xbb" * ops.HANDLE_BYTES,
    }
    with pytest.raises(ValueError, match="GPU memory of another writer"):
        thief.request(ops.PUT_HANDLES, volume_id="cuda.1.aa", handles=[handle])
    # The owner may not hand out handles for slots that are not its volume's either.
    w_slot = acquire_raw(owner, "w")["slots"][0]
    with pytest.raises(ValueError, match="not a slot of volume"):
        owner.request(ops.PUT_HANDLES, volume_id="cuda.1.aa", handles=[{**handle, "slot": w_slot}])
    assert alive_volumes(store) == {"v0": True, "cuda.1.aa": True}
    thief.close()
    owner.close()
    until(lambda: alive_volumes(store) == {"v0": True}, "a closed writer's device volume stays")
    healthy(store, saved, base)


# ---------------------------------------------------------------------- paths from the wire

BAD_REGISTRATIONS = [
    ({"shm_dir": "/tmp/../etc"}, "not a normalized absolute path"),
    ({"shm_dir": "/dev/shm/../../tmp"}, "not a normalized absolute path"),
    ({"shm_dir": "relative/dir"}, "not a normalized absolute path"),
    ({"shm_dir": "/dev//shm"}, "not a normalized absolute path"),
    ({"shm_dir": "/dev/shm/"}, "not a normalized absolute path"),
    ({"shm_dir": "/dev/shm/./x"}, "not a normalized absolute path"),
    ({"shm_dir": ""}, "not a normalized absolute path"),
    ({"shm_dir": "/dev/shm/tidal-"}, None),  # a directory that does not exist: fine, empty
    ({"store_id": "x/../../y"}, "store id"),
    ({"store_id": ".."}, "store id"),
    ({"store_id": "1.2xabcdef/../z"}, "store id"),
    ({"store_id": ""}, "store id"),
    ({"store_id": "*"}, "store id"),
    ({"volume_id": "a/b"}, "field 'volume_id'"),
    ({"volume_id": ".."}, "field 'volume_id'"),
    ({"volume_id": "../../etc"}, "field 'volume_id'"),
    ({"volume_id": "a\x00b"}, "field 'volume_id'"),
]


@pytest.mark.parametrize("bad,said", BAD_REGISTRATIONS, ids=[str(b) for b, _ in BAD_REGISTRATIONS])
def test_register_volume_with_hostile_paths_is_refused(victim, bad, said):
    """A registration whose directory or ids could steer a segment path elsewhere is refused
    (and its connection closed); nothing is listed, nothing on disk changes."""
    store, saved, base = victim
    fields = {
        "volume_id": "evil",
        "address": "tcp://127.0.0.1:9",
        "host": testing.host(store),
        "shm_dir": "/dev/shm",
        "store_id": new_store_id(),
        **bad,
    }
    sid = _acquire_volume(store)["store_id"]
    ours = lambda: {f for f in os.listdir("/dev/shm") if sid in f}  # noqa: E731
    before = ours()
    conn = testing.raw(store.address)
    if said is None:  # accepted: the paths are ones a volume could make
        conn.request(ops.REGISTER_VOLUME, **fields)
        assert alive_volumes(store)["evil"]
    else:
        with pytest.raises((ValueError, tidal.store.ProtocolError), match=said):
            conn.request(ops.REGISTER_VOLUME, **fields)
        assert "evil" not in alive_volumes(store)
    conn.close()
    until(lambda: "evil" not in alive_volumes(store), "a closed registration stays listed")
    assert ours() == before
    healthy(store, saved, base)


def test_a_volume_that_leaves_makes_the_server_unlink_nothing(victim, tmp_path):
    """A registered volume that leaves (with versions on it, named like the store's own
    segments) makes the controller delete nothing: only the process that created a segment
    unlinks it, and only segments it created. A dead volume is listed only while a lease
    holds one of its versions, then forgotten."""
    store, saved, base = victim
    sid = _acquire_volume(store)["store_id"]
    # Files named as segments of the store's own volume v0 and of the visitor's, never made.
    canaries = [f"/dev/shm/tidal-{sid}-v0-{n}" for n in (999_999, 1)] + [
        str(tmp_path / f"tidal-{sid}-vis-{n}") for n in range(1, 6)
    ]
    for c in canaries:
        with open(c, "x") as f:
            f.write("canary")
    try:
        visitor = FakeVolume(store, "vis", str(tmp_path), store_id=sid)
        with tidal.store.connect(store.address, volume="vis") as w:
            w.put("on-vis", W * 5)  # slot ids above 5: no canary is in its way
        reader = testing.raw(store.address)
        lease = acquire_raw(reader, "on-vis")["lease"]
        assert read_key(store, "on-vis").equal(W * 5)
        visitor.close()  # the volume process goes away
        until(lambda: not alive_volumes(store).get("vis", True), "the dead volume stays alive")
        with pytest.raises(VolumeLostError, match="vis"):
            read_key(store, "on-vis")
        assert not [e for e in store.ls()["entries"] if e["key"] == "on-vis"]
        assert alive_volumes(store) == {"v0": True, "vis": False}  # a lease holds it
        assert reader.request(ops.RELEASE, lease=lease)["lost"] is True
        assert alive_volumes(store) == {"v0": True}  # then it is forgotten
        reader.close()
        for c in canaries:
            assert open(c).read() == "canary", c
        healthy(store, saved, base)
        store.close()  # the store's own volume unlinks what it made, nothing else
        for c in canaries:
            assert open(c).read() == "canary", c
    finally:
        for c in canaries:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(c)


def _acquire_volume(store) -> dict[str, Any]:
    conn = testing.raw(store.address)
    try:
        reply = acquire_raw(conn, "w")
        conn.request(ops.RELEASE, lease=reply["lease"])
        return reply["volumes"][0]
    finally:
        conn.close()


@pytest.mark.parametrize(
    "plant", ["symlink", "file of the wrong size", "file of the right size", "directory", "fifo"]
)
def test_something_planted_where_a_segment_will_be_created(victim, tmp_path, plant):
    """Whatever sits where the volume is about to create a segment, it is neither followed,
    nor truncated, nor unlinked: the put fails clearly, its slots are freed at once, and the
    next put works."""
    store, saved, base = victim
    victim_file = tmp_path / "victim"
    victim_file.write_bytes(b"precious" * 125)  # 1000 bytes, as big as the slot
    conn = testing.raw(store.address)
    declared = conn.request(
        ops.PUT_DECLARE,
        key="p",
        kind="tensor",
        writers=1,
        keep=None,
        host=testing.host(store),
        volume=None,
        tensors=[declaration(250)],
    )
    path = testing.slot_path(declared["volume"], declared["plan"] + 1)  # the next id is the slot's
    if plant == "symlink":
        os.symlink(victim_file, path)
    elif plant == "directory":
        os.mkdir(path)
    elif plant == "fifo":
        os.mkfifo(path)
    else:
        with open(path, "wb") as f:
            f.write(b"x" * (1000 if plant.endswith("right size") else 7))
    try:
        with pytest.raises(StoreError, match="cannot create segment"):
            conn.request(
                ops.PUT_BEGIN,
                key="p",
                plan=declared["plan"],
                version=None,
                writer="w1",
                reservation=None,
                objects=[],
            )
        assert testing.controller(store).counts()["slots"] == base.counts["slots"]
        assert victim_file.read_bytes() == b"precious" * 125
        conn.close()
        with tidal.store.connect(store.address) as w:
            w.put("p", W * 7)  # the next slot id: works
        assert read_key(store, "p").equal(W * 7)
        store.delete("p")
        healthy(store, saved, base)
        store.close()  # the volume unlinks its own segments only
        assert os.path.lexists(path) and victim_file.read_bytes() == b"precious" * 125
    finally:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        elif os.path.lexists(path):
            os.unlink(path)


@contextlib.contextmanager
def _hijacked(path: str, plant: str, victim_file: str) -> Iterator[None]:
    """Replace the segment at ``path`` by something else for the block (the volume's own
    mapping keeps the real bytes), then put it back."""
    aside = path + ".aside"
    os.rename(path, aside)
    try:
        if plant == "symlink":
            os.symlink(victim_file, path)
        elif plant == "directory":
            os.mkdir(path)
        elif plant == "fifo":
            os.mkfifo(path)
        else:
            with open(path, "wb") as f:
                f.write(b"x" * 7)
        yield
    finally:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)
        os.rename(aside, path)


@pytest.mark.parametrize("plant", ["symlink", "file of the wrong size", "directory", "fifo"])
def test_clients_refuse_a_hijacked_segment(victim, tmp_path, plant):
    """A segment replaced by a symlink, a file of the wrong size, a directory or a FIFO:
    same-host readers and writers refuse to map it (StoreError), the symlink's target is
    never touched, TCP readers still get the volume's bytes."""
    store, saved, base = victim
    victim_file = tmp_path / "victim"
    victim_file.write_bytes(b"precious" * 125)
    vol = _acquire_volume(store)
    # Two puts of "q" by one-off handles leave the slot of version 0 in q's ring, where the
    # next put takes it: a writer then maps that path.
    for v in range(2):
        with tidal.store.connect(store.address) as w:
            w.put("q", W + v, keep=1)
    conn = testing.raw(store.address)
    q_slot = acquire_raw(conn, "q")["slots"][0]
    w_slot = acquire_raw(conn, "w")["slots"][0]
    conn.close()
    ring = [
        s
        for s in range(1, q_slot)
        if os.path.exists(testing.slot_path(vol, s)) and s not in (w_slot, q_slot)
    ]
    with _hijacked(testing.slot_path(vol, w_slot), plant, str(victim_file)):
        with tidal.store.connect(store.address, transport="shm", timeout=20) as fresh:
            with pytest.raises(StoreError, match="segment"):
                fresh.get("w")
        with tidal.store.connect(store.address, transport="tcp") as r:
            assert torch.equal(r.get("w"), W)
    assert victim_file.read_bytes() == b"precious" * 125
    if ring:  # a put into a hijacked ring slot
        with _hijacked(testing.slot_path(vol, ring[-1]), plant, str(victim_file)):
            with tidal.store.connect(store.address, timeout=20) as w:
                with pytest.raises(StoreError, match="segment"):
                    w.put("q", W * 9, keep=1)
        assert victim_file.read_bytes() == b"precious" * 125
    assert read_key(store, "q").equal(W + 1)
    store.delete("q")
    healthy(store, saved, base)


def test_zero_copy_read_of_a_planted_fifo_does_not_hang(victim, tmp_path):
    store, saved, base = victim
    vol = _acquire_volume(store)
    conn = testing.raw(store.address)
    path = testing.slot_path(vol, acquire_raw(conn, "w")["slots"][0])
    conn.close()
    got: dict[str, Any] = {}

    def view() -> None:
        try:
            with tidal.store.connect(store.address, timeout=20) as fresh:
                fresh.get("w", copy=False)
        except StoreError as e:
            got["error"] = e

    with _hijacked(path, "fifo", str(tmp_path / "unused")):
        t = threading.Thread(target=view, daemon=True)
        t.start()
        t.join(3)
        hung = t.is_alive()
        if hung:  # let it go: a writer on the FIFO ends the blocked open
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            t.join(20)
    assert not hung, "a zero-copy read blocked on the FIFO"
    assert "not a regular file" in str(got["error"])
    healthy(store, saved, base)


def test_a_write_in_flight_cannot_change_a_version_after_its_commit(victim):
    """The grant holder (the version's own writer, over TCP) starts a vol_write, commits
    while it is still sending, then sends the rest: the bytes a reader can see once the
    version is visible must never change afterwards."""
    store, saved, base = victim
    writer = testing.raw(store.address)
    declared, begun = begin_raw(writer, store, "late", writer="w1")
    slot, grant = begun["slots"][0], begun["grant"]
    testing.write_slot(declared["volume"], slot, W)
    s = raw_sock(store.address)
    s.sendall(msg_bytes(vol_write_request(slot, grant, 1000), 1000) + b"\x11" * 500)
    seen = torch.empty(250)
    until(
        lambda: (
            testing.read_slot(declared["volume"], slot, seen)
            .view(torch.uint8)[:500]
            .eq(0x11)
            .all()
            .item()
        ),
        "the first half never landed",
    )
    writer.send(ops.PUT_COMMIT, key="late", version=0, writer="w1", reserve=False)
    deadline = time.monotonic() + 1.0  # a commit that waits for the write stays invisible
    while not store.exists("late") and time.monotonic() < deadline:
        select.select([], [], [], 0.01)
    visible = read_key(store, "late") if store.exists("late") else None
    s.sendall(b"\x22" * 500)
    assert read_reply(s)["ok"] in (True, False)
    writer.receive(ops.PUT_COMMIT)
    final = read_key(store, "late")
    changed = visible is not None and not torch.equal(visible, final)
    assert not changed, "the bytes of a committed version changed"
    s.close()
    writer.close()
    store.delete("late")
    healthy(store, saved, base)


def test_segments_do_not_each_hold_a_file_descriptor(victim):
    store, saved, base = victim
    many = {f"t{i}": torch.full((4,), float(i)) for i in range(64)}
    fds = open_fds()
    with tidal.store.connect(store.address) as w:
        w.put_state_dict(many, "many")
        got = w.get_state_dict("many")
        assert all(torch.equal(got[k], v) for k, v in many.items())
        grown = open_fds() - fds
    store.delete("many")
    assert grown < 16, f"64 segments took {grown} file descriptors"
