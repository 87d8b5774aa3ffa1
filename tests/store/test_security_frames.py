"""Hostile local clients against a store server: malformed, fuzzed, stalled and idle
connections, and running out of file descriptors.

See tests/store/hostile.py for how each attack is judged.
"""

from __future__ import annotations

import os
import random
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch

import tidal.cli
import tidal.store
from tidal.store import StoreError, ops, testing, wire

from .conftest import until
from .hostile import (
    HELLO,
    W,
    acquire_raw,
    baseline_of,
    begin_raw,
    closed_soon,
    frame_bytes,
    healthy,
    msg_bytes,
    open_fds,
    raw_sock,
    read_reply,
    said_then_closed,
    saved_data,
    send_all,
    server_threads,
    serving,
    vol_write_request,
)

# ------------------------------------------------------------------ frames of every kind

# (name, bytes, what the error reply says) for a connection that has not said hello yet.
BEFORE_HELLO = [
    ("prefix cut", b"TDS1\x10\x00", "inside a message prefix"),
    ("header cut", frame_bytes(100) + b"\x81" * 10, "after 10 of 100 bytes"),
    ("payload in hello", msg_bytes(HELLO, 10) + b"x" * 10, "exceeds the limit of 0"),
    ("header over 64 KiB", frame_bytes(1 << 17), "exceeds the limit"),
    ("bad magic", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad magic"),
    ("undecodable header", frame_bytes(4) + b"\xc1" * 4, "undecodable"),
    ("header not a map", msg_bytes([1, 2, 3]), "must be a map"),
    ("op a list", msg_bytes({"op": [1]}), "unknown op"),
    ("op a map", msg_bytes({"op": {"a": 1}}), "unknown op"),
    ("op missing", msg_bytes({"token": None}), "unknown op"),
    ("keys first", msg_bytes({"op": "keys", "prefix": ""}), "first message must be 'hello'"),
    ("vol_destroy first", msg_bytes({"op": "vol_destroy", "slots": [1]}), "must be 'hello'"),
    ("old protocol", msg_bytes({**HELLO, "proto": 1}), "protocol version 1"),
    ("hello extra field", msg_bytes({**HELLO, "evil": 1}), "unknown fields"),
    ("hello token not str", msg_bytes({**HELLO, "token": 5}), "field 'token'"),
]


@pytest.mark.parametrize("name,data,said", BEFORE_HELLO, ids=[c[0] for c in BEFORE_HELLO])
def test_bad_frames_before_hello(victim, name, data, said):
    """Cut or garbage first messages get an error reply and a closed socket; the server
    holds nothing of the connection afterwards."""
    store, saved, base = victim
    for _ in range(20):  # a leak of one fd per connection would show as 20
        sock = raw_sock(store.address, hello=False)
        send_all(sock, data)
        reply = said_then_closed(sock)
        assert reply is not None and not reply["ok"] and said in reply["error"], reply
    healthy(store, saved, base)


def _holding(store) -> tuple[Any, dict[str, Any]]:
    """A raw connection holding a lease on "w" and a pending write of key "hostile"."""
    conn = testing.raw(store.address)
    lease = acquire_raw(conn, "w")["lease"]
    declared, begun = begin_raw(conn, store, "hostile")
    assert not store.exists("hostile")  # pending
    return conn, {
        "lease": lease,
        "slot": begun["slots"][0],
        "grant": begun["grant"],
        "volume": declared["volume"],
    }


# (name, bytes for a connection holding a lease and a pending write, error reply).
AFTER_HELLO: list[tuple[str, Callable[[dict[str, Any]], bytes], str | None]] = [
    ("prefix cut", lambda h: b"TDS1\x00", "inside a message prefix"),
    ("header cut", lambda h: frame_bytes(100) + b"\x81" * 10, "after 10 of 100 bytes"),
    (
        "payload cut",
        lambda h: msg_bytes(vol_write_request(h["slot"], h["grant"], 1000), 1000) + b"x" * 10,
        "after 10 of 1000 bytes",
    ),
    (
        "payload cut, wrong grant",
        lambda h: msg_bytes(vol_write_request(h["slot"], bytes(16), 1000), 1000) + b"x" * 10,
        None,
    ),
    (
        "payload on an op without",
        lambda h: msg_bytes({"op": "keys", "prefix": ""}, 100),
        "takes no payload",
    ),
    ("payload over the limit", lambda h: frame_bytes(10, (1 << 40) + 1), "exceeds the limit"),
    ("header over 32 MiB", lambda h: frame_bytes(wire.MAX_HEADER_BYTES + 1), "exceeds the limit"),
    ("bad magic", lambda h: b"\x00" * 16, "bad magic"),
    ("undecodable header", lambda h: frame_bytes(3) + b"\xc1\xc1\xc1", "undecodable"),
    (
        "nbytes not the payload",
        lambda h: msg_bytes(vol_write_request(h["slot"], h["grant"], 10), 20) + b"x" * 15,
        None,
    ),
]


@pytest.mark.parametrize("name,data,said", AFTER_HELLO, ids=[c[0] for c in AFTER_HELLO])
def test_bad_frames_after_hello_release_what_the_connection_held(victim, name, data, said):
    """A connection holding a lease and a pending write sends a cut or garbage frame: it is
    closed, its lease released, its write aborted, its plan and slots freed."""
    store, saved, base = victim
    for _ in range(5):
        conn, held = _holding(store)
        sock = conn.sock
        send_all(sock, data(held))
        reply = said_then_closed(sock)
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
        conn.sock.sendall(msg_bytes(bad))
        reply = read_reply(conn.sock)
        assert not reply["ok"] and said in reply["error"], (bad, reply)
    conn.sock.sendall(msg_bytes({"op": "keys", "prefix": ""}))
    assert read_reply(conn.sock)["keys"] == ["sd", "w"]
    assert conn.request(ops.RELEASE, lease=held["lease"])["lost"] is False
    conn.close()
    healthy(store, saved, base)


def test_fuzzed_fields_of_every_op_get_protocol_errors(victim):
    """Every op with fields of every wrong type (seeded): a ProtocolError reply, never an
    internal error, and the connection stays usable."""
    store, saved, base = victim
    plausible = {
        "address": "tcp://127.0.0.1:9",
        "grant": bytes(16),
        "handles": [],
        "host": "h",
        "itemsize": 4,
        "keep": None,
        "key": "w",
        "kind": "tensor",
        "known_sig": None,
        "lease": 1,
        "nbytes": 0,
        "objects": [],
        "offset": 0,
        "offsets": [0],
        "plan": 1,
        "prefix": "",
        "proto": wire.PROTOCOL_VERSION,
        "reservation": None,
        "reserve": False,
        "segments": [],
        "shape": [1],
        "shm_dir": "/dev/shm",
        "sizes": [1],
        "slot": 1,
        "slots": [],
        "store_id": "1.1xabcdef",
        "tensors": [],
        "token": None,
        "version": 0,
        "volume": None,
        "volume_id": "vz",
        "wait_ms": 0,
        "writer": "w",
        "writers": 1,
    }
    deep: Any = 0
    for _ in range(100):
        deep = [deep]
    hostile = [
        None,
        True,
        -1,
        -(1 << 63),
        (1 << 64) - 1,
        1.5,
        float("nan"),
        "",
        "x" * 5000,
        "a\x00b",
        b"",
        b"\x00" * 64,
        [],
        [None],
        [[1]] * 3,
        {},
        {"a": [1]},
        deep,
        msgpack.ExtType(5, b"x"),
        {"slot": 1, "uuid": "u", "handle": b"h" * 64, "x": 1},
        [{"name": ["a"], "shape": [1], "dtype": "evil", "offsets": [0], "sizes": [1]}],
        [{"slot": 1, "nbytes": -5}],
        "../../etc/passwd",
        ["a", None],
    ]
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
            conn.sock.sendall(msg_bytes(header))
            reply = read_reply(conn.sock)
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
        sock = raw_sock(store.address, hello=i % 2 == 1)
        n = rng.randrange(0, 300)
        junk = bytes(rng.randrange(256) for _ in range(n))
        if i % 3 == 0:
            junk = (
                frame_bytes(rng.choice([0, 1, 7, n, 1 << 20]), rng.choice([0, 1, 1 << 45])) + junk
            )
        send_all(sock, junk)
        said_then_closed(sock)
    healthy(store, saved, base)


def test_stalled_messages_are_dropped():
    """A message started and never finished (header or payload) is dropped after
    ``io_timeout``; an idle connection between messages is not."""
    with serving(io_timeout=0.3, hello_timeout=5.0) as (server, _):
        with tidal.store.connect(server.address) as store:
            saved = saved_data(store)
            base = baseline_of(store, server.controller.counts)
            idle = raw_sock(store.address)
            for data in (frame_bytes(100) + b"\x81" * 10, b"TDS1"):
                conn = testing.raw(store.address)
                acquire_raw(conn, "w")
                conn.sock.sendall(data)  # and then nothing
                assert closed_soon(conn.sock, 10), data
                conn.close()
            conn, held = _holding(store)
            conn.sock.sendall(
                msg_bytes(vol_write_request(held["slot"], held["grant"], 1000), 1000) + b"x"
            )
            assert closed_soon(conn.sock, 10)
            conn.close()
            assert not closed_soon(idle, 0.6)  # idle between messages: kept
            idle.sendall(msg_bytes({"op": "keys", "prefix": ""}))
            assert read_reply(idle)["keys"] == ["sd", "w"]
            idle.close()
            healthy(store, saved, base, embedded=False)


def test_a_peer_that_never_reads_its_replies_is_dropped():
    """Requests sent without ever reading a reply: once a reply cannot be sent within
    ``io_timeout`` the connection is closed (a reply cut in the middle would corrupt the
    stream), and what it held is released."""
    with serving(io_timeout=0.3) as (server, _):
        with tidal.store.connect(server.address) as store:
            saved = saved_data(store)
            base = baseline_of(store, server.controller.counts)
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
            s.connect(wire.parse_address(server.address))
            s.sendall(
                msg_bytes(HELLO)
                + msg_bytes(
                    {
                        "op": "acquire",
                        "key": "w",
                        "version": "latest",
                        "known_sig": None,
                        "wait_ms": None,
                    }
                )
            )
            until(
                lambda: server.controller.counts()["leases"] > base.counts["leases"],
                "the unread acquire never arrived",
            )
            flood = msg_bytes({"op": "keys", "prefix": "", "evil": "x" * 200}) * 1000
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
            saved = saved_data(store)
            base = baseline_of(store, server.controller.counts)
            idle = [raw_sock(server.address, hello=False) for _ in range(4)]
            until(lambda: server_threads() >= base.threads + 4, "idle connections not taken")
            refused = raw_sock(server.address, hello=False)
            said = said_then_closed(refused)
            assert said is not None and "4 connections are waiting to say hello" in said["error"]
            with pytest.raises(StoreError, match="refused the connection"):
                tidal.store.connect(server.address, token="s3cret")
            for s in idle:
                s.close()
            healthy(store, saved, base, embedded=False, token="s3cret")
            # Left open, they are dropped at the hello deadline, with a reason.
            idle = [raw_sock(server.address, hello=False) for _ in range(4)]
            for s in idle:
                said = said_then_closed(s)
                assert said is not None and "no hello within 0.5 s" in said["error"]
            # A peer trickling its hello a byte at a time does not stretch the deadline.
            slow = raw_sock(server.address, hello=False)
            hello = msg_bytes({**HELLO, "token": "s3cret"})
            sent = 0
            while sent < len(hello) and not closed_soon(slow, 0.05):  # > 2 s for all of it
                slow.sendall(hello[sent : sent + 1])
                sent += 1
            assert sent < len(hello), "the trickled hello was served"
            slow.close()
            # Wrong and missing tokens: refused and closed.
            for token in (None, "nope", "s3cre", "s3cret" * 100):
                s = raw_sock(server.address, hello=False)
                s.sendall(msg_bytes({**HELLO, "token": token}))
                said = said_then_closed(s)
                assert said is not None and said["etype"] == "AuthError", said
            healthy(store, saved, base, embedded=False, token="s3cret")
            assert any("refused a connection" in m for m in logs)


def test_open_connections_are_capped():
    """At most ``max_connections`` open (said hello or not): the next is refused, saying
    why, while open ones are still served; once some close, clients get in again."""
    with serving(max_connections=6) as (server, _):
        with tidal.store.connect(server.address) as store:  # main and (after a put) writer
            saved = saved_data(store)
            base = baseline_of(store, server.controller.counts)
            others = [raw_sock(server.address) for _ in range(4)]
            with pytest.raises(StoreError, match="6 connections are open"):
                tidal.store.connect(server.address)
            said = said_then_closed(raw_sock(server.address, hello=False))
            assert said is not None and "6 connections are open" in said["error"]
            assert torch.equal(store.get("w"), W)  # open connections are still served
            others.pop().close()
            until(lambda: server_threads() <= base.threads + 3, "closed connection lingers")
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
        [
            sys.executable,
            "-c",
            _EMFILE_CHILD.format(n=limit),
            "serve",
            "--port",
            "0",
            "--token-file",
            str(token_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    held: list[socket.socket] = []
    try:
        line = _first_line(proc)
        assert line.startswith("tidal store serving at tcp://"), line
        address = line.split()[4]
        fds = lambda: open_fds(proc.pid)  # noqa: E731
        base = fds()
        with tidal.store.connect(address, token="s3cret") as store:
            store.put("x", W)
        until(lambda: fds() <= base + 1, "fds of a closed client linger")  # +1: x's segment
        base = fds()
        # The attack: frames announcing more bytes than they send (before hello,
        # and after it for a client that has the token), then gone.
        for i in range(300):
            s = raw_sock(address, hello=i % 2 == 1, token="s3cret")
            s.sendall(
                msg_bytes({"op": "keys", "prefix": ""})[:-3] if i % 2 else frame_bytes(1000) + b"x"
            )
            s.close()
        until(lambda: fds() <= base, f"server fds stay above {base} after cut frames")
        # Exhaust: connections that never say hello, more than the server has fds for.
        for _ in range(limit + 8):
            held.append(raw_sock(address, hello=False))
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
