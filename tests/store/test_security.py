"""A hostile local client against a store server (issue 9, section 0).

Each test replays an attack with raw sockets (framing by hand) or raw connections
(``testing.raw``: after hello, ops sent by hand), then shows the store is unharmed
(:func:`healthy`): the server's file descriptors and connection threads and the
controller's leases, slots and plans return to their baseline (polled with a deadline:
cleanup runs in server threads), committed data keeps its bytes and its ``ls`` listing, and
legitimate clients keep being served. Servers built here use small caps and timeouts so
that nothing waits long; the file-descriptor exhaustion runs ``tidal store serve`` in a
child process with a low ``RLIMIT_NOFILE``.
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import torch

import tidal.cli
import tidal.store
from tidal.store import StoreError, VolumeLostError, ops, testing, wire
from tidal.store.cli import main as store_main
from tidal.store.controller import Controller
from tidal.store.server import SERVER_THREAD, Server
from tidal.store.standalone import run_volume, serve_registration
from tidal.store.transports.shm import path_of
from tidal.store.volume import Volume, new_store_id

from .conftest import until

HELLO = {"op": "hello", "token": None, "proto": wire.PROTOCOL_VERSION}
W = torch.arange(250, dtype=torch.float32)  # 1000 bytes, one slot
SD = {"a": torch.full((3, 4), 7, dtype=torch.int64), "b": [torch.ones(5)], "step": 3}


# ------------------------------------------------------------------------------ helpers


def _fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _server_threads() -> int:
    """Threads serving a connection in this process's servers (one per connection)."""
    names = [t.name.removeprefix(f"{SERVER_THREAD}-") for t in threading.enumerate()]
    return sum(n.isdigit() for n in names)


def _frame(header_len: int, payload_len: int = 0, magic: bytes = wire.MAGIC) -> bytes:
    return wire.PREFIX.pack(magic, header_len, payload_len)


def _msg(obj: Any, payload_len: int = 0) -> bytes:
    """A well-framed message whose header is any msgpack value."""
    body = msgpack.packb(obj, use_bin_type=True)
    return _frame(len(body), payload_len) + body


def _sock(address: str, hello: bool = True, token: str | None = None) -> socket.socket:
    sock = socket.create_connection(wire.parse_address(address), timeout=10)
    if hello:
        sock.sendall(_msg({**HELLO, "token": token}))
        assert _reply(sock)["ok"]
    return sock


def _reply(sock: socket.socket) -> dict[str, Any]:
    reply, plen = wire.recv_header(sock)
    assert plen == 0
    return reply


def _send_all(sock: socket.socket, data: bytes) -> None:
    """Send ``data`` and end our side; the server may have closed first (it refuses bad
    input as soon as it sees it), which is no failure here."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sock.sendall(data)
    with contextlib.suppress(OSError):  # ENOTCONN once the server reset it
        sock.shutdown(socket.SHUT_WR)


def _said_then_closed(sock: socket.socket, timeout: float = 10.0) -> dict[str, Any] | None:
    """What the server said before it closed ``sock`` (None: nothing); fails if the server
    keeps it open past ``timeout``."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {timeout} s")
    finally:
        sock.close()
    if len(data) < wire.PREFIX.size:
        return None
    _, header_len, _ = wire.PREFIX.unpack(data[: wire.PREFIX.size])
    return msgpack.unpackb(data[wire.PREFIX.size : wire.PREFIX.size + header_len])


def _closed_soon(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes ``sock`` within ``timeout`` seconds (reading what it says)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if select.select([sock], [], [], left)[0]:
            try:
                if not sock.recv(1 << 16):
                    return True
            except ConnectionResetError:
                return True
    return False


def _decl(n: int) -> dict[str, Any]:
    return {"name": [], "shape": [n], "dtype": "float32", "offsets": [0], "sizes": [n]}


def _begin(conn, store, key: str, n: int = 250, writer: str = "evil", **declare):
    """Declare and begin a one-tensor put of ``key`` on ``conn``: (declared, begun)."""
    fields = {"kind": "tensor", "writers": 1, "keep": None, "host": testing.host(store),
              "volume": None, "tensors": [_decl(n)], **declare}  # fmt: skip
    declared = conn.request(ops.PUT_DECLARE, key=key, **fields)
    begun = conn.request(ops.PUT_BEGIN, key=key, plan=declared["plan"], version=None,
                         writer=writer, reservation=None, objects=[])  # fmt: skip
    return declared, begun


def _acquire(conn, key: str) -> dict[str, Any]:
    return conn.request(ops.ACQUIRE, key=key, version="latest", known_sig=None, wait_ms=None)


def _read(store, key: str, **kw: Any) -> torch.Tensor:
    """``key`` read by a fresh client (whose closing unmaps what it read: the attacked
    handle's mappings would hold file descriptors of deleted segments until swept)."""
    with tidal.store.connect(store.address, timeout=20) as fresh:
        return fresh.get(key, **kw)


def _vol_write(slot: int, grant: bytes, nbytes: int, offset: int = 0) -> dict[str, Any]:
    return {"op": "vol_write", "slot": slot, "offset": offset, "nbytes": nbytes, "grant": grant}


@dataclass
class Baseline:
    """What a store holds before an attack, to compare with after it."""

    fds: int
    threads: int
    counts: dict[str, int]
    listed: set[tuple[str, int]]
    counts_of: Callable[[], dict[str, int]]


def _baseline(store, counts_of: Callable[[], dict[str, int]] | None = None) -> Baseline:
    counts_of = counts_of or testing.controller(store).counts
    listed = {(e["key"], e["version"]) for e in store.ls()["entries"]}
    return Baseline(_fds(), _server_threads(), counts_of(), listed, counts_of)


def _saved(store) -> dict[str, Any]:
    """Committed data every attack must leave as it is."""
    store.put("w", W)
    store.put_state_dict(SD, "sd")
    assert torch.equal(store.get("w"), W)  # the handle's connections are all open now
    return {"w": W, "sd": SD}


def healthy(
    store, saved: dict[str, Any], base: Baseline, embedded: bool = True, token: str | None = None
) -> None:
    """The store after an attack: the server holds no more fds or threads than before,
    leases / slots / plans are back, committed data keeps its bytes and listing, and fresh
    clients of every transport are served."""
    until(lambda: _fds() <= base.fds, f"fds stay above the baseline {base.fds}: {_fds()}", 20)
    until(lambda: _server_threads() <= base.threads,
          f"server threads stay above {base.threads}: {_server_threads()}", 20)  # fmt: skip
    until(lambda: base.counts_of() == base.counts,
          f"controller holds {base.counts_of()}, had {base.counts}", 20)  # fmt: skip
    if embedded:
        assert testing.leases(store) == base.counts["leases"]
    assert {(e["key"], e["version"]) for e in store.ls()["entries"]} == base.listed
    for transport in ("shm", "tcp"):
        with tidal.store.connect(store.address, token=token, transport=transport,
                                 timeout=20) as fresh:  # fmt: skip
            assert torch.equal(fresh.get("w"), saved["w"])
            sd = fresh.get_state_dict("sd")
            assert torch.equal(sd["a"], saved["sd"]["a"]) and sd["step"] == saved["sd"]["step"]
            fresh.put(f"legit/{transport}", W + 1)
            assert torch.equal(fresh.get(f"legit/{transport}"), W + 1)
            assert store.exists(f"legit/{transport}")
            fresh.delete(f"legit/{transport}")
    assert torch.equal(store.get("w"), saved["w"])  # the attacked handle too


@pytest.fixture
def victim(capfd):
    """An embedded store holding committed data; at the end, no server thread printed a
    traceback (every error path was an expected one)."""
    store = tidal.store.connect(keep=2)
    saved = _saved(store)
    yield store, saved, _baseline(store)
    store.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "failed:" not in err, err


@contextlib.contextmanager
def serving(token: str | None = None, **kw: Any) -> Iterator[tuple[Server, list[str]]]:
    """A server of this test (controller + volume v0) and the warnings it logged."""
    logs: list[str] = []
    sid = new_store_id()
    server = Server(controller=Controller(sid), volume=Volume("v0", sid), token=token,
                    log=logs.append, **kw)  # fmt: skip
    try:
        yield server, logs
    finally:
        server.close()
    bugs = [m for m in logs if "failed:" in m]
    assert not bugs, bugs


class HeldVolume(Volume):
    """A volume whose creates and destroys wait while ``go`` is clear (a stopped process)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.go = threading.Event()
        self.go.set()
        self.waiting = threading.Event()  # a request of the controller's is held up

    def _gate(self) -> None:
        if not self.go.is_set():
            self.waiting.set()
            assert self.go.wait(30), "the test never let the volume go"

    def create(self, slot: int, nbytes: int) -> None:
        self._gate()
        super().create(slot, nbytes)

    def destroy(self, slots: list[int]) -> None:
        self._gate()
        super().destroy(slots)


class FakeVolume:
    """A volume process played by the test: a real volume in ``shm_dir``, registered over a
    connection the test opened, served by ``standalone.serve_registration`` in a thread."""

    def __init__(self, store, volume_id: str, shm_dir: str, store_id: str | None = None) -> None:
        self.vol = HeldVolume(volume_id, store_id or new_store_id(), shm_dir=str(shm_dir))
        self.conn = testing.raw(store.address)
        self.conn.request(ops.REGISTER_VOLUME, volume_id=volume_id, address="tcp://127.0.0.1:9",
                          host=testing.host(store), shm_dir=self.vol.shm_dir,
                          store_id=self.vol.store_id)  # fmt: skip
        assert self.conn.sock is not None
        self.thread = threading.Thread(target=serve_registration, args=(self.conn.sock, self.vol),
                                       daemon=True)  # fmt: skip
        self.thread.start()

    def close(self) -> None:
        self.vol.go.set()
        with contextlib.suppress(OSError):
            assert self.conn.sock is not None
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()
        self.thread.join(10)
        self.vol.close()


def _alive_volumes(store) -> dict[str, bool]:
    return {v["volume"]: v["alive"] for v in store.ls()["volumes"]}


# ------------------------------------------------------------------ frames of every kind

# (name, bytes, what the error reply says) for a connection that has not said hello yet.
BEFORE_HELLO = [
    ("prefix cut", b"TDS1\x10\x00", "inside a message prefix"),
    ("header cut", _frame(100) + b"\x81" * 10, "after 10 of 100 bytes"),
    ("payload in hello", _msg(HELLO, 10) + b"x" * 10, "exceeds the limit of 0"),
    ("header over 64 KiB", _frame(1 << 17), "exceeds the limit"),
    ("bad magic", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad magic"),
    ("undecodable header", _frame(4) + b"\xc1" * 4, "undecodable"),
    ("header not a map", _msg([1, 2, 3]), "must be a map"),
    ("op a list", _msg({"op": [1]}), "unknown op"),
    ("op a map", _msg({"op": {"a": 1}}), "unknown op"),
    ("op missing", _msg({"token": None}), "unknown op"),
    ("keys first", _msg({"op": "keys", "prefix": ""}), "first message must be 'hello'"),
    ("vol_destroy first", _msg({"op": "vol_destroy", "slots": [1]}), "must be 'hello'"),
    ("old protocol", _msg({**HELLO, "proto": 1}), "protocol version 1"),
    ("hello extra field", _msg({**HELLO, "evil": 1}), "unknown fields"),
    ("hello token not str", _msg({**HELLO, "token": 5}), "field 'token'"),
]


@pytest.mark.parametrize("name,data,said", BEFORE_HELLO, ids=[c[0] for c in BEFORE_HELLO])
def test_bad_frames_before_hello(victim, name, data, said):
    """Cut or garbage first messages get an error reply and a closed socket; the server
    holds nothing of the connection afterwards."""
    store, saved, base = victim
    for _ in range(20):  # a leak of one fd per connection would show as 20
        sock = _sock(store.address, hello=False)
        _send_all(sock, data)
        reply = _said_then_closed(sock)
        assert reply is not None and not reply["ok"] and said in reply["error"], reply
    healthy(store, saved, base)


def _holding(store) -> tuple[Any, dict[str, Any]]:
    """A raw connection holding a lease on "w" and a pending write of key "hostile"."""
    conn = testing.raw(store.address)
    lease = _acquire(conn, "w")["lease"]
    declared, begun = _begin(conn, store, "hostile")
    assert not store.exists("hostile")  # pending
    return conn, {"lease": lease, "slot": begun["slots"][0], "grant": begun["grant"],
                  "volume": declared["volume"]}  # fmt: skip


# (name, bytes for a connection holding a lease and a pending write, error reply).
AFTER_HELLO: list[tuple[str, Callable[[dict[str, Any]], bytes], str | None]] = [
    ("prefix cut", lambda h: b"TDS1\x00", "inside a message prefix"),
    ("header cut", lambda h: _frame(100) + b"\x81" * 10, "after 10 of 100 bytes"),
    ("payload cut", lambda h: _msg(_vol_write(h["slot"], h["grant"], 1000), 1000) + b"x" * 10,
     "after 10 of 1000 bytes"),
    ("payload cut, wrong grant",
     lambda h: _msg(_vol_write(h["slot"], bytes(16), 1000), 1000) + b"x" * 10, None),
    ("payload on an op without", lambda h: _msg({"op": "keys", "prefix": ""}, 100),
     "takes no payload"),
    ("payload over the limit", lambda h: _frame(10, (1 << 40) + 1), "exceeds the limit"),
    ("header over 32 MiB", lambda h: _frame(wire.MAX_HEADER_BYTES + 1), "exceeds the limit"),
    ("bad magic", lambda h: b"\x00" * 16, "bad magic"),
    ("undecodable header", lambda h: _frame(3) + b"\xc1\xc1\xc1", "undecodable"),
    ("nbytes not the payload",
     lambda h: _msg(_vol_write(h["slot"], h["grant"], 10), 20) + b"x" * 15, None),
]  # fmt: skip


@pytest.mark.parametrize("name,data,said", AFTER_HELLO, ids=[c[0] for c in AFTER_HELLO])
def test_bad_frames_after_hello_release_what_the_connection_held(victim, name, data, said):
    """A connection holding a lease and a pending write sends a cut or garbage frame: it is
    closed, its lease released, its write aborted, its plan and slots freed."""
    store, saved, base = victim
    for _ in range(5):
        conn, held = _holding(store)
        sock = conn.sock
        _send_all(sock, data(held))
        reply = _said_then_closed(sock)
        if said is not None:
            assert reply is not None and said in reply["error"], reply
        conn.close()
    assert not store.exists("hostile")
    healthy(store, saved, base)


OFF_SCHEMA = [
    ({"op": "pickle", "data": b"x"}, "unknown op"),
    ({"op": [1, 2]}, "unknown op"),
    ({"op": None}, "unknown op"),
    ([1, 2, 3], "must be a map"),
    ("just a string", "must be a map"),
    ({"op": "acquire", "key": "w"}, "missing field 'version'"),
    ({"op": "keys", "prefix": "", "evil": 1}, "unknown fields"),
    ({"op": "keys", "prefix": msgpack.ExtType(1, b"x")}, "field 'prefix'"),
    ({"op": "release", "lease": 1 << 63}, "field 'lease'"),
    ({"op": "release", "lease": True}, "field 'lease'"),
    ({"op": "hello", "token": None, "proto": wire.PROTOCOL_VERSION}, "said hello already"),
    ({"op": "vol_destroy", "slots": [1, 2, 3]}, "registration connection"),
]


def test_well_framed_off_schema_messages_keep_the_connection(victim):
    """Well framed but off-schema: an error reply each, and the connection (with its lease)
    keeps working."""
    store, saved, base = victim
    conn, held = _holding(store)
    for bad, said in OFF_SCHEMA:
        conn.sock.sendall(_msg(bad))
        reply = _reply(conn.sock)
        assert not reply["ok"] and said in reply["error"], (bad, reply)
    conn.sock.sendall(_msg({"op": "keys", "prefix": ""}))
    assert _reply(conn.sock)["keys"] == ["sd", "w"]
    assert conn.request(ops.RELEASE, lease=held["lease"])["lost"] is False
    conn.close()
    healthy(store, saved, base)


def test_fuzzed_fields_of_every_op_get_protocol_errors(victim):
    """Every op with fields of every wrong type (seeded): a ProtocolError reply, never an
    internal error, and the connection stays usable."""
    store, saved, base = victim
    plausible = {
        "address": "tcp://127.0.0.1:9", "grant": bytes(16), "handles": [], "host": "h",
        "itemsize": 4, "keep": None, "key": "w", "kind": "tensor", "known_sig": None,
        "lease": 1, "nbytes": 0, "objects": [], "offset": 0, "offsets": [0], "plan": 1,
        "prefix": "", "proto": wire.PROTOCOL_VERSION, "reservation": None, "reserve": False,
        "segments": [], "shape": [1], "shm_dir": "/dev/shm", "sizes": [1], "slot": 1,
        "slots": [], "store_id": "1.1xabcdef", "tensors": [], "token": None, "version": 0,
        "volume": None, "volume_id": "vz", "wait_ms": 0, "writer": "w", "writers": 1,
    }  # fmt: skip
    deep: Any = 0
    for _ in range(100):
        deep = [deep]
    hostile = [None, True, -1, -(1 << 63), (1 << 64) - 1, 1.5, float("nan"), "", "x" * 5000,
               "a\x00b", b"", b"\x00" * 64, [], [None], [[1]] * 3, {}, {"a": [1]}, deep,
               msgpack.ExtType(5, b"x"), {"slot": 1, "uuid": "u", "handle": b"h" * 64, "x": 1},
               [{"name": ["a"], "shape": [1], "dtype": "evil", "offsets": [0], "sizes": [1]}],
               [{"slot": 1, "nbytes": -5}], "../../etc/passwd", ["a", None]]  # fmt: skip
    rng = random.Random(9)
    conn = testing.raw(store.address)
    sent = 0
    for op in ops.OPS.values():
        if op in (ops.HELLO, ops.BYE):
            continue
        for _ in range(60):
            header = {"op": op.name}
            for f in op.request:
                header[f] = rng.choice(hostile) if rng.random() < 0.4 else plausible[f]
            if rng.random() < 0.1:
                header[rng.choice(["evil", "op2", "x" * 300])] = rng.choice(hostile)
            try:
                ops.check_request(header, 0)
                continue  # a valid request: nothing hostile to send
            except wire.ProtocolError:
                pass
            conn.sock.sendall(_msg(header))
            reply = _reply(conn.sock)
            assert not reply["ok"] and reply["etype"] == "ProtocolError", (header, reply)
            sent += 1
    assert sent > 500
    assert conn.request(ops.KEYS, prefix="")["keys"] == ["sd", "w"]
    conn.close()
    healthy(store, saved, base)


def test_random_bytes_before_and_after_hello(victim):
    """Seeded random garbage, some of it framed with the right magic: each connection is
    closed and leaves nothing behind."""
    store, saved, base = victim
    rng = random.Random(90)
    for i in range(120):
        sock = _sock(store.address, hello=i % 2 == 1)
        n = rng.randrange(0, 300)
        junk = bytes(rng.randrange(256) for _ in range(n))
        if i % 3 == 0:
            junk = _frame(rng.choice([0, 1, 7, n, 1 << 20]), rng.choice([0, 1, 1 << 45])) + junk
        _send_all(sock, junk)
        _said_then_closed(sock)
    healthy(store, saved, base)


def test_stalled_messages_are_dropped():
    """A message started and never finished (header or payload) is dropped after
    ``io_timeout``; an idle connection between messages is not."""
    with serving(io_timeout=0.3, hello_timeout=5.0) as (server, _):
        with tidal.store.connect(server.address) as store:
            saved = _saved(store)
            base = _baseline(store, server.controller.counts)
            idle = _sock(store.address)
            for data in (_frame(100) + b"\x81" * 10, b"TDS1"):
                conn = testing.raw(store.address)
                _acquire(conn, "w")
                conn.sock.sendall(data)  # and then nothing
                assert _closed_soon(conn.sock, 10), data
                conn.close()
            conn, held = _holding(store)
            conn.sock.sendall(_msg(_vol_write(held["slot"], held["grant"], 1000), 1000) + b"x")
            assert _closed_soon(conn.sock, 10)
            conn.close()
            assert not _closed_soon(idle, 0.6)  # idle between messages: kept
            idle.sendall(_msg({"op": "keys", "prefix": ""}))
            assert _reply(idle)["keys"] == ["sd", "w"]
            idle.close()
            healthy(store, saved, base, embedded=False)


def test_a_peer_that_never_reads_its_replies_is_dropped():
    """Requests sent without ever reading a reply: once a reply cannot be sent within
    ``io_timeout`` the connection is closed (a reply cut in the middle would corrupt the
    stream), and what it held is released."""
    with serving(io_timeout=0.3) as (server, _):
        with tidal.store.connect(server.address) as store:
            saved = _saved(store)
            base = _baseline(store, server.controller.counts)
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
            s.connect(wire.parse_address(server.address))
            s.sendall(_msg(HELLO) + _msg({"op": "acquire", "key": "w", "version": "latest",
                                          "known_sig": None, "wait_ms": None}))  # fmt: skip
            until(lambda: server.controller.counts()["leases"] > base.counts["leases"],
                  "the unread acquire never arrived")  # fmt: skip
            flood = _msg({"op": "keys", "prefix": "", "evil": "x" * 200}) * 1000
            s.settimeout(0.2)
            deadline = time.monotonic() + 20
            dropped = False
            while not dropped and time.monotonic() < deadline:
                try:
                    s.sendall(flood)
                except TimeoutError:
                    continue  # the server is not reading: it is stuck sending a reply
                except (BrokenPipeError, ConnectionResetError):
                    dropped = True
            s.close()
            assert dropped, "a peer that never reads stayed connected"
            healthy(store, saved, base, embedded=False)


# ------------------------------------------------ idle and unauthenticated connections


def test_idle_unauthenticated_connections_are_capped_and_expire():
    """Connections that never say hello: at most ``max_pending`` at once (the next is
    refused, saying why), each dropped after ``hello_timeout`` even when it trickles bytes;
    clients with the token connect again once they are gone."""
    with serving(token="s3cret", max_pending=4, hello_timeout=0.5) as (server, logs):
        with tidal.store.connect(server.address, token="s3cret") as store:
            saved = _saved(store)
            base = _baseline(store, server.controller.counts)
            idle = [_sock(server.address, hello=False) for _ in range(4)]
            until(lambda: _server_threads() >= base.threads + 4, "idle connections not taken")
            refused = _sock(server.address, hello=False)
            said = _said_then_closed(refused)
            assert said is not None and "4 connections are waiting to say hello" in said["error"]
            with pytest.raises(StoreError, match="refused the connection"):
                tidal.store.connect(server.address, token="s3cret")
            for s in idle:
                s.close()
            healthy(store, saved, base, embedded=False, token="s3cret")
            # Left open, they are dropped at the hello deadline, with a reason.
            idle = [_sock(server.address, hello=False) for _ in range(4)]
            for s in idle:
                said = _said_then_closed(s)
                assert said is not None and "no hello within 0.5 s" in said["error"]
            # A peer trickling its hello a byte at a time does not stretch the deadline.
            slow = _sock(server.address, hello=False)
            hello = _msg({**HELLO, "token": "s3cret"})
            sent = 0
            while sent < len(hello) and not _closed_soon(slow, 0.05):  # > 2 s for all of it
                slow.sendall(hello[sent : sent + 1])
                sent += 1
            assert sent < len(hello), "the trickled hello was served"
            slow.close()
            # Wrong and missing tokens: refused and closed.
            for token in (None, "nope", "s3cre", "s3cret" * 100):
                s = _sock(server.address, hello=False)
                s.sendall(_msg({**HELLO, "token": token}))
                said = _said_then_closed(s)
                assert said is not None and said["etype"] == "AuthError", said
            healthy(store, saved, base, embedded=False, token="s3cret")
            assert any("refused a connection" in m for m in logs)


def test_open_connections_are_capped():
    """At most ``max_connections`` open (said hello or not): the next is refused, saying
    why, while open ones are still served; once some close, clients get in again."""
    with serving(max_connections=6) as (server, _):
        with tidal.store.connect(server.address) as store:  # main and (after a put) writer
            saved = _saved(store)
            base = _baseline(store, server.controller.counts)
            others = [_sock(server.address) for _ in range(4)]
            with pytest.raises(StoreError, match="6 connections are open"):
                tidal.store.connect(server.address)
            said = _said_then_closed(_sock(server.address, hello=False))
            assert said is not None and "6 connections are open" in said["error"]
            assert torch.equal(store.get("w"), W)  # open connections are still served
            others.pop().close()
            until(lambda: _server_threads() <= base.threads + 3, "closed connection lingers")
            conn = testing.raw(server.address)
            assert conn.request(ops.KEYS, prefix="")["keys"] == ["sd", "w"]
            conn.close()
            for s in others:
                s.close()
            # A fresh TCP client needs 4 connections (main, writer, 2 to the volume): 6 in all.
            healthy(store, saved, base, embedded=False)


_EMFILE_CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, ({n}, {n}))
from tidal.store.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _first_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the child printed nothing in {timeout} s"
    return proc.stdout.readline()


def test_running_out_of_fds_is_survived(tmp_path):
    """``tidal store serve --token-file`` under ``ulimit -n 64``: hundreds of cut frames leak
    nothing; connections that exhaust its fds stall new clients only while they are open;
    once they close, the server serves again."""
    limit = 64
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    env = {**os.environ, "TIDAL_STORE_TOKEN": ""}
    proc = subprocess.Popen(
        [sys.executable, "-c", _EMFILE_CHILD.format(n=limit), "serve", "--port", "0",
         "--token-file", str(token_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    held: list[socket.socket] = []
    try:
        line = _first_line(proc)
        assert line.startswith("tidal store serving at tcp://"), line
        address = line.split()[4]
        fds = lambda: _fds(proc.pid)  # noqa: E731
        base = fds()
        with tidal.store.connect(address, token="s3cret") as store:
            store.put("x", W)
        until(lambda: fds() <= base + 1, "fds of a closed client linger")  # +1: x's segment
        base = fds()
        # The attack: frames announcing more bytes than they send (before hello,
        # and after it for a client that has the token), then gone.
        for i in range(300):
            s = _sock(address, hello=i % 2 == 1, token="s3cret")
            s.sendall(_msg({"op": "keys", "prefix": ""})[:-3] if i % 2 else _frame(1000) + b"x")
            s.close()
        until(lambda: fds() <= base, f"server fds stay above {base} after cut frames")
        # Exhaust: connections that never say hello, more than the server has fds for.
        for _ in range(limit + 8):
            held.append(_sock(address, hello=False))
        until(lambda: fds() >= limit, "the server never ran out of fds")
        with pytest.raises(StoreError, match="did not answer 'hello'"):
            tidal.store.connect(address, token="s3cret", timeout=0.5)
        for s in held:
            s.close()
        held.clear()
        with tidal.store.connect(address, token="s3cret", timeout=30) as store:
            assert torch.equal(store.get("x"), W)
            store.put("y", W + 1)
            assert [e["key"] for e in store.ls()["entries"]] == ["x", "y"]
        with pytest.raises(tidal.store.AuthError):
            tidal.store.connect(address)
        until(lambda: fds() <= base + 1, "server fds stay above the baseline")  # +1: y
    finally:
        for s in held:
            s.close()
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "out of file descriptors" in err and "Traceback" not in err, err


# ------------------------------------------------------------------------ ops out of role


def test_only_the_writer_connection_reports_commits_or_aborts_its_write(victim):
    """Another connection, even naming the same writer, cannot report, commit or abort a
    pending write; the writer's own commit then publishes its bytes."""
    store, saved, base = victim
    writer = testing.raw(store.address)
    declared, begun = _begin(writer, store, "k", writer="w1")
    slot, version = begun["slots"][0], begun["version"]
    testing.write_slot(declared["volume"], slot, W * 2)
    other = testing.raw(store.address)
    fields = {"key": "k", "version": version, "writer": "w1"}
    for op, extra in [(ops.PUT_PROGRESS, {"slots": [slot]}), (ops.PUT_COMMIT, {"reserve": True}),
                      (ops.PUT_ABORT, {})]:  # fmt: skip
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
        tensors=[_decl(250)],
    )["plan"]
    with pytest.raises(ValueError, match="already has its 1 writers"):
        other.request(ops.PUT_BEGIN, key="k", plan=plan, version=version, writer="w2",
                      reservation=None, objects=[])  # fmt: skip
    with pytest.raises(ValueError, match="not one of this connection"):
        other.request(ops.PUT_BEGIN, key="k", plan=declared["plan"], version=None, writer="w1",
                      reservation=None, objects=[])  # fmt: skip
    assert not store.exists("k")
    assert writer.request(ops.PUT_COMMIT, **fields, reserve=False)["visible"]
    assert torch.equal(_read(store, "k"), W * 2)
    with pytest.raises(ValueError, match="no pending write"):
        other.request(ops.PUT_ABORT, **fields)
    other.close()
    writer.close()
    assert torch.equal(_read(store, "k"), W * 2)
    store.delete("k")
    healthy(store, saved, base)


def test_reservations_and_leases_of_another_connection(victim):
    """A reservation or a lease is used or released only by the connection that holds it."""
    store, saved, base = victim
    owner, thief = testing.raw(store.address), testing.raw(store.address)
    declared = None
    for v in range(2):  # the second commit reserves slots for the third put
        declared, begun = _begin(owner, store, "r", writer="w1")
        done = owner.request(ops.PUT_COMMIT, key="r", version=begun["version"], writer="w1",
                             reserve=v == 1)  # fmt: skip
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
        tensors=[_decl(250)],
    )["plan"]
    with pytest.raises(ValueError, match="not held by this connection"):
        thief.request(ops.PUT_BEGIN, key="r", plan=tplan, version=None, writer="w2",
                      reservation=reservation["id"], objects=[])  # fmt: skip
    # The owner's reservation still works.
    begun = owner.request(ops.PUT_BEGIN, key="r", plan=declared["plan"], version=None,
                          writer="w1", reservation=reservation["id"], objects=[])  # fmt: skip
    assert begun["slots"] == reservation["slots"]
    owner.request(ops.PUT_ABORT, key="r", version=begun["version"], writer="w1")
    lease = _acquire(owner, "w")["lease"]
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
    t = threading.Thread(target=run_volume, args=(store.address, "vp"), daemon=True,
                         kwargs={"shm_dir": str(tmp_path),
                                 "ready": lambda a: (where.update(a=a), ready.set())})  # fmt: skip
    t.start()
    assert ready.wait(30), "the volume process never registered"
    base = _baseline(store)  # with the volume process's server and registration
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
    for address, where_ in [(store.address, "registration connection"),
                            (where["a"], "registration connection")]:  # fmt: skip
        conn = testing.raw(address)
        for op, fields in hostile:
            with pytest.raises(ValueError, match=where_):
                conn.request(op, **fields)
        conn.close()
    vconn = testing.raw(where["a"])
    with pytest.raises(ValueError, match="served by a controller"):
        vconn.request(ops.REGISTER_VOLUME, volume_id="evil", address="tcp://127.0.0.1:9",
                      host="h", shm_dir=str(tmp_path), store_id=new_store_id())  # fmt: skip
    with pytest.raises(ValueError, match="served by a controller"):
        vconn.request(ops.KEYS, prefix="")
    vconn.close()
    # A grant guessed for the remote volume's committed slot is refused on its port too.
    reader = testing.raw(store.address)
    slot = _acquire(reader, "remote")["slots"][0]
    s = _sock(where["a"])
    s.sendall(_msg(_vol_write(slot, bytes(16), 8), 8) + b"\xff" * 8)
    assert "not open for writing" in _reply(s)["error"]
    s.close()
    reader.close()
    assert sorted(os.listdir(tmp_path)) == segments
    assert torch.equal(_read(store, "remote"), W * 3)
    with tidal.store.connect(store.address, transport="tcp") as r:
        assert torch.equal(r.get("remote"), W * 3)
        assert torch.equal(r.get("w"), W)
    store.delete("remote")
    assert _alive_volumes(store) == {"v0": True, "vp": True}
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
        declared, begun = _begin(writer, store, "imm", writer="w1")
        testing.write_slot(declared["volume"], begun["slots"][0], W + v)
        grants.append((begun["slots"][0], begun["grant"]))
        done = writer.request(ops.PUT_COMMIT, key="imm", version=v, writer="w1", reserve=v == 1)
    reserved = done["next"]
    committed = [slot for slot, _ in grants]
    s = _sock(store.address)
    tries = [
        (slot, g)
        for slot in committed
        for g in [bytes(16), b"\xff" * 16, grants[0][1], grants[1][1], reserved["grant"]]
    ]
    for slot, grant in tries:  # fmt: skip
        s.sendall(_msg(_vol_write(slot, grant, 1000), 1000) + b"\xee" * 1000)
        reply = _reply(s)
        assert not reply["ok"] and "not open for writing" in reply["error"], (slot, reply)
    # Right grant, wrong place: outside the slot.
    s.sendall(
        _msg(_vol_write(reserved["slots"][0], reserved["grant"], 8, offset=996), 8) + b"x" * 8
    )
    assert "exceeds slot" in _reply(s)["error"]
    # The reserved slot of the next put takes its grant: the refusals above were real.
    s.sendall(
        _msg(_vol_write(reserved["slots"][0], reserved["grant"], 1000), 1000) + b"\x01" * 1000
    )
    assert _reply(s)["ok"]
    s.close()
    for v in range(2):
        assert torch.equal(_read(store, "imm", version=v), W + v)
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
        thief.request(ops.PUT_DECLARE, key="g", kind="tensor", writers=1, keep=None,
                      host=testing.host(store), volume="cuda.1.aa", tensors=[_decl(4)])  # fmt: skip
    handle = {"slot": 1, "uuid": "GPU-evil", "handle": b"\xaa" * ops.HANDLE_BYTES}
    with pytest.raises(ValueError, match="GPU memory of another writer"):
        thief.request(ops.PUT_HANDLES, volume_id="cuda.1.aa", handles=[handle])
    # The owner may not hand out handles for slots that are not its volume's either.
    w_slot = _acquire(owner, "w")["slots"][0]
    with pytest.raises(ValueError, match="not a slot of volume"):
        owner.request(ops.PUT_HANDLES, volume_id="cuda.1.aa", handles=[{**handle, "slot": w_slot}])
    assert _alive_volumes(store) == {"v0": True, "cuda.1.aa": True}
    thief.close()
    owner.close()
    until(lambda: _alive_volumes(store) == {"v0": True}, "a closed writer's device volume stays")
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
    fields = {"volume_id": "evil", "address": "tcp://127.0.0.1:9", "host": testing.host(store),
              "shm_dir": "/dev/shm", "store_id": new_store_id(), **bad}  # fmt: skip
    sid = _acquire_volume(store)["store_id"]
    ours = lambda: {f for f in os.listdir("/dev/shm") if sid in f}  # noqa: E731
    before = ours()
    conn = testing.raw(store.address)
    if said is None:  # accepted: the paths are ones a volume could make
        conn.request(ops.REGISTER_VOLUME, **fields)
        assert _alive_volumes(store)["evil"]
    else:
        with pytest.raises((ValueError, tidal.store.ProtocolError), match=said):
            conn.request(ops.REGISTER_VOLUME, **fields)
        assert "evil" not in _alive_volumes(store)
    conn.close()
    until(lambda: "evil" not in _alive_volumes(store), "a closed registration stays listed")
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
        lease = _acquire(reader, "on-vis")["lease"]
        assert _read(store, "on-vis").equal(W * 5)
        visitor.close()  # the volume process goes away
        until(lambda: not _alive_volumes(store).get("vis", True), "the dead volume stays alive")
        with pytest.raises(VolumeLostError, match="vis"):
            _read(store, "on-vis")
        assert not [e for e in store.ls()["entries"] if e["key"] == "on-vis"]
        assert _alive_volumes(store) == {"v0": True, "vis": False}  # a lease holds it
        assert reader.request(ops.RELEASE, lease=lease)["lost"] is True
        assert _alive_volumes(store) == {"v0": True}  # then it is forgotten
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
        reply = _acquire(conn, "w")
        conn.request(ops.RELEASE, lease=reply["lease"])
        return reply["volumes"][0]
    finally:
        conn.close()


@pytest.mark.parametrize("plant", ["symlink", "file of the wrong size", "file of the right size",
                                   "directory", "fifo"])  # fmt: skip
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
        tensors=[_decl(250)],
    )
    path = path_of(declared["volume"], declared["plan"] + 1)  # the next id is the slot's
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
            conn.request(ops.PUT_BEGIN, key="p", plan=declared["plan"], version=None,
                         writer="w1", reservation=None, objects=[])  # fmt: skip
        assert testing.controller(store).counts()["slots"] == base.counts["slots"]
        assert victim_file.read_bytes() == b"precious" * 125
        conn.close()
        with tidal.store.connect(store.address) as w:
            w.put("p", W * 7)  # the next slot id: works
        assert _read(store, "p").equal(W * 7)
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
    q_slot = _acquire(conn, "q")["slots"][0]
    w_slot = _acquire(conn, "w")["slots"][0]
    conn.close()
    ring = [s for s in range(1, q_slot) if os.path.exists(path_of(vol, s))
            and s not in (w_slot, q_slot)]  # fmt: skip
    with _hijacked(path_of(vol, w_slot), plant, str(victim_file)):
        with tidal.store.connect(store.address, transport="shm", timeout=20) as fresh:
            with pytest.raises(StoreError, match="segment"):
                fresh.get("w")
        with tidal.store.connect(store.address, transport="tcp") as r:
            assert torch.equal(r.get("w"), W)
    assert victim_file.read_bytes() == b"precious" * 125
    if ring:  # a put into a hijacked ring slot
        with _hijacked(path_of(vol, ring[-1]), plant, str(victim_file)):
            with tidal.store.connect(store.address, timeout=20) as w:
                with pytest.raises(StoreError, match="segment"):
                    w.put("q", W * 9, keep=1)
        assert victim_file.read_bytes() == b"precious" * 125
    assert _read(store, "q").equal(W + 1)
    store.delete("q")
    healthy(store, saved, base)


def test_zero_copy_read_of_a_planted_fifo_does_not_hang(victim, tmp_path):
    store, saved, base = victim
    vol = _acquire_volume(store)
    conn = testing.raw(store.address)
    path = path_of(vol, _acquire(conn, "w")["slots"][0])
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
    declared, begun = _begin(writer, store, "late", writer="w1")
    slot, grant = begun["slots"][0], begun["grant"]
    testing.write_slot(declared["volume"], slot, W)
    s = _sock(store.address)
    s.sendall(_msg(_vol_write(slot, grant, 1000), 1000) + b"\x11" * 500)
    seen = torch.empty(250)
    until(lambda: testing.read_slot(declared["volume"], slot, seen).view(torch.uint8)[:500]
          .eq(0x11).all().item(), "the first half never landed")  # fmt: skip
    writer.send(ops.PUT_COMMIT, key="late", version=0, writer="w1", reserve=False)
    deadline = time.monotonic() + 1.0  # a commit that waits for the write stays invisible
    while not store.exists("late") and time.monotonic() < deadline:
        select.select([], [], [], 0.01)
    visible = _read(store, "late") if store.exists("late") else None
    s.sendall(b"\x22" * 500)
    assert _reply(s)["ok"] in (True, False)
    writer.receive(ops.PUT_COMMIT)
    final = _read(store, "late")
    changed = visible is not None and not torch.equal(visible, final)
    assert not changed, "the bytes of a committed version changed"
    s.close()
    writer.close()
    store.delete("late")
    healthy(store, saved, base)


def test_segments_do_not_each_hold_a_file_descriptor(victim):
    store, saved, base = victim
    many = {f"t{i}": torch.full((4,), float(i)) for i in range(64)}
    fds = _fds()
    with tidal.store.connect(store.address) as w:
        w.put_state_dict(many, "many")
        got = w.get_state_dict("many")
        assert all(torch.equal(got[k], v) for k, v in many.items())
        grown = _fds() - fds
    store.delete("many")
    assert grown < 16, f"64 segments took {grown} file descriptors"


# ------------------------------------------------------------- stalls, restarts, timeouts


def test_a_stopped_volume_does_not_stall_the_controller(victim, tmp_path):
    """A registered volume that stops answering (a stopped or hostile process): deleting its
    keys and everything else the controller does stay fast; its memory is freed once it
    answers again."""
    store, saved, base = victim
    stopped = FakeVolume(store, "stop", str(tmp_path))
    with tidal.store.connect(store.address, volume="stop") as w:
        w.put("on-stop", W)
    assert len(os.listdir(tmp_path)) == 1
    stopped.vol.go.clear()
    t0 = time.monotonic()
    assert store.delete("on-stop") == 1  # its destroy waits in the volume's queue
    with tidal.store.connect(store.address, volume="v0") as other:  # not the stopped one
        assert other.keys() == ["sd", "w"]
        other.put("meanwhile", W)
        other.delete("meanwhile")
    assert time.monotonic() - t0 < 10, "the controller waited for the stopped volume"
    assert stopped.vol.waiting.wait(10), "the destroy never reached the volume"
    stopped.vol.go.set()
    until(lambda: not os.listdir(tmp_path), "the destroyed segment stays")
    stopped.close()
    until(lambda: "stop" not in _alive_volumes(store), "the volume that left stays listed")
    healthy(store, saved, base)


def test_a_handle_reconnects_after_the_server_restarts():
    """The server closes every connection (stopped, then restarted on the same port): the
    handle's next call goes out on a new connection; with nobody listening it says so."""
    with serving() as (first, _):
        port = int(first.address.rsplit(":", 1)[1])
        store = tidal.store.connect(first.address)
        store.put("x", W)
        store.put("x", W + 1)  # a reservation on the writer connection
    with serving(port=port) as (second, _):  # the same port, right away
        assert store.keys() == []  # a new store: the old one's data went with it
        assert store.put("x", W * 2) == 0
        assert torch.equal(store.get("x"), W * 2)
        assert store.put("x", W * 3) == 1
    with pytest.raises(StoreError, match="cannot reach tidal store.*stopped or restarted"):
        store.keys()
    store.close()


def test_a_handle_reconnects_after_a_timeout(victim, tmp_path):
    """A request that times out (its volume stopped) drops its connection; the handle's next
    call reconnects, and its leases and pending writes are not carried over."""
    store, saved, base = victim
    slow = FakeVolume(store, "slow", str(tmp_path))
    with tidal.store.connect(store.address, volume="slow", timeout=0.5) as h:
        slow.vol.go.clear()
        with pytest.raises(StoreError, match="did not answer 'put_begin' within 0.5 s; "
                                             "the next call reconnects"):  # fmt: skip
            h.put("k", W)
        assert slow.vol.waiting.wait(10)
        assert h.keys() == ["sd", "w"]  # other connections were not affected
        slow.vol.go.set()
        assert h.put("k", W * 4) == 1  # version 0 went with the timed-out connection
        assert torch.equal(h.get("k"), W * 4)
        assert h.versions("k") == [1]
    slow.close()
    until(lambda: not _alive_volumes(store).get("slow", False), "the volume stays alive")
    with pytest.raises(VolumeLostError, match="slow"):
        _read(store, "k")
    store.delete("k")
    until(lambda: "slow" not in _alive_volumes(store), "the dead volume stays listed")
    healthy(store, saved, base)


def test_a_bound_request_is_never_resent_on_a_new_connection(victim):
    """A lease or a pending write belongs to its connection: after the server dropped that
    connection, releasing or committing on a new one would be refused as someone else's,
    so the client says the connection was lost instead."""
    store, saved, base = victim
    conn = testing.raw(store.address)
    lease = _acquire(conn, "w")["lease"]
    _, begun = _begin(conn, store, "b", writer="w1")
    server_side = testing.leases(store)
    # The connection dies under the client's feet (as in a restart of the server).
    killer = socket.fromfd(conn.sock.fileno(), socket.AF_INET, socket.SOCK_STREAM)
    killer.shutdown(socket.SHUT_RDWR)
    killer.close()
    until(lambda: testing.leases(store) < server_side, "the dropped connection kept its lease")
    with pytest.raises(StoreError, match="was lost before 'release'"):
        conn.request(ops.RELEASE, lease=lease)
    with pytest.raises(StoreError, match="was lost before 'put_commit'"):
        conn.request(ops.PUT_COMMIT, key="b", version=begun["version"], writer="w1",
                     reserve=False)  # fmt: skip
    assert conn.request(ops.KEYS, prefix="")["keys"] == ["sd", "w"]  # unbound: reconnects
    conn.close()
    healthy(store, saved, base)


# ------------------------------------------------------------------------ the smaller items


def test_bad_counts_are_value_errors(victim):
    store, saved, base = victim
    for call in [
        lambda: store.put("w", W, version=-1),
        lambda: store.put("w", W, keep=0),
        lambda: store.put_state_dict(SD, "sd", version=-1),
        lambda: store.put_state_dict(SD, "sd", keep=0),
        lambda: store.get("w", version=-1),
        lambda: store.get_state_dict("sd", version=-1),
        lambda: store.exists("w", version=-1),
        lambda: store.delete("w", version=-1),
        lambda: tidal.store.connect(keep=0),
    ]:
        with pytest.raises(ValueError, match="version|keep") as e:
            call()
        assert not isinstance(e.value, StoreError), e.value  # not a ProtocolError
    healthy(store, saved, base)


@pytest.mark.parametrize("call", [
    lambda s: s.put("w", W, version=1 << 63),
    lambda s: s.put("w", W, version=1 << 70),
    lambda s: s.get("w", version=1 << 63),
    lambda s: s.exists("w", version=1 << 70),
    lambda s: s.put("w", W, keep=1 << 21),
    lambda s: s.put("w", W, writers=1 << 21, version=5),
], ids=["put version 2**63", "put version 2**70", "get version 2**63", "exists version 2**70",
        "keep 2**21", "writers 2**21"])  # fmt: skip
def test_counts_past_the_wire_limits_are_value_errors(victim, call):
    store, saved, base = victim
    with pytest.raises(ValueError) as e:
        call(store)
    assert not isinstance(e.value, StoreError), e.value


def test_a_closed_handle_says_so():
    store = tidal.store.connect()
    store.put("w", W)
    store.close()
    store.close()  # twice is fine
    for call in [
        lambda: store.put("w", W),
        lambda: store.put_state_dict(SD, "sd"),
        lambda: store.get("w"),
        lambda: store.get_state_dict("sd"),
        lambda: store.keys(),
        lambda: store.versions("w"),
        lambda: store.exists("w"),
        lambda: store.delete("w"),
        lambda: store.ls(),
        lambda: store.put_async("w", W),
        lambda: store.get_async("w"),
    ]:
        with pytest.raises(StoreError, match=r"closed \(store\.close\(\) was called\)"):
            call()


def _busy_port() -> tuple[socket.socket, int]:
    sock = socket.create_server(("127.0.0.1", 0))
    return sock, sock.getsockname()[1]


def test_cli_errors_are_clear(capsys, tmp_path, monkeypatch):
    """``tidal store`` alone, a missing --shm-dir, a port in use, bad token files: a clear
    message and exit code, no traceback."""
    for run in (lambda: store_main([]), lambda: tidal.cli.main(["store"])):
        assert run() == 2
        err = capsys.readouterr().err
        assert "usage: tidal store" in err and "choose a command" in err
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512), hard))
    try:
        assert store_main(["serve", "--shm-dir", str(tmp_path / "missing")]) == 2
        # serve lifts its soft fd limit first (each segment holds an fd): here, to the hard.
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] in (hard, 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    err = capsys.readouterr().err
    assert "does not exist or is not writable (--shm-dir)" in err and "Traceback" not in err
    busy, port = _busy_port()
    with busy:
        assert store_main(["serve", "--port", str(port), "--shm-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: address already in use" in err, err
    assert "Traceback" not in err and not os.listdir(tmp_path)
    monkeypatch.delenv("TIDAL_STORE_TOKEN", raising=False)
    monkeypatch.delenv("TIDAL_STORE", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with serving(token="s3cret") as (server, _):
        with tidal.store.connect(server.address, token="s3cret") as s:
            s.put("tok", W)
        assert store_main(["ls", server.address, "--token-file", str(token_file)]) == 0
        assert "tok" in capsys.readouterr().out
        monkeypatch.setenv("TIDAL_STORE_TOKEN", "s3cret")
        monkeypatch.setenv("TIDAL_STORE", server.address)
        assert store_main(["ls"]) == 0
        assert "tok" in capsys.readouterr().out
        monkeypatch.setenv("TIDAL_STORE_TOKEN", "wrong")
        assert store_main(["ls"]) == 1
        assert "wrong or missing token" in capsys.readouterr().err
        (tmp_path / "empty").write_text("\n")
        assert store_main(["ls", "--token-file", str(tmp_path / "empty")]) == 2
        assert "is empty" in capsys.readouterr().err
        assert store_main(["ls", "--token-file", str(tmp_path / "nope")]) == 2
        assert "cannot read --token-file" in capsys.readouterr().err


def test_ls_into_head_ends_quietly():
    """``tidal store ls | head -1`` through a shell pipe: head leaves early, ls exits 0
    without a BrokenPipeError (the listing is larger than a pipe's buffer). The token comes
    from the environment."""
    with serving(token="s3cret") as (server, _):
        with tidal.store.connect(server.address, token="s3cret") as s:
            for i in range(100):
                s.put(f"{i:03d}/" + "k" * 1000, torch.ones(1))
        env = {**os.environ, "TIDAL_STORE_TOKEN": "s3cret", "TIDAL_STORE": server.address}
        out = subprocess.run(
            ["bash", "-o", "pipefail", "-c", f"{sys.executable} -m tidal.store ls | head -1"],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("KEY") and out.stdout.count("\n") == 1
    assert "BrokenPipe" not in out.stderr and "Traceback" not in out.stderr, out.stderr
