"""Faults and bad input: killed volumes, malformed/oversized messages, tokens, CLI."""

import os
import signal
import socket
import struct
import subprocess
import sys
import time

import msgpack
import pytest
import torch

import tidal.store
from tidal.store import (
    AuthError,
    KeyNotFoundError,
    StoreError,
    VolumeLostError,
    ops,
    testing,
    wire,
)
from tidal.store.controller import Controller
from tidal.store.server import Server
from tidal.store.volume import Volume, new_store_id, reap_stale


def _start(args):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal.store", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, proc.stdout.readline()  # the process prints its address once serving


def test_killed_volume_gives_clear_errors_and_store_keeps_serving():
    from tests.store.conftest import shm_segments

    with tidal.store.connect() as store:
        proc, line = _start(["volume", "--controller", store.address, "--id", "vk"])
        try:
            assert "joined" in line, line + proc.stderr.read()
            with tidal.store.connect(store.address, volume="vk") as writer:
                big = torch.randn(4 << 20)  # 16 MB on the external volume
                writer.put("big", big)
            store.put("small", torch.ones(10))  # on the embedded volume v0
            ours = {f for f in shm_segments(proc.pid) if "-vk-" in f and "-reserve." not in f}
            assert len(ours) == 1  # the slot (the volume's pool files aside)
            assert torch.equal(store.get("big"), big)  # shared memory
            with tidal.store.connect(store.address, transport="tcp") as r:
                assert torch.equal(r.get("big"), big)  # TCP from the volume process
            # A stopped volume: the read times out with a clear error instead of hanging.
            os.kill(proc.pid, signal.SIGSTOP)
            # ... and a put that needs a new segment there does not stall the controller.
            blocked = tidal.store.connect(store.address, volume="vk")
            pending = blocked.put_async("new", torch.ones(5000))
            deadline = time.perf_counter() + 30
            while time.perf_counter() < deadline:  # until the controller holds the put
                try:
                    assert store.versions("new") == []  # pending: not visible
                    break
                except KeyNotFoundError:
                    continue
            t0 = time.perf_counter()
            assert "small" in store.keys() and not pending.done()
            assert time.perf_counter() - t0 < 15.0  # generous: CI machines are loaded
            with tidal.store.connect(store.address, transport="tcp", timeout=1.0) as r:
                with pytest.raises(StoreError, match="did not answer"):
                    r.get("big")
                # A read in flight when the volume process dies.
                with tidal.store.connect(store.address, transport="tcp", timeout=20.0) as r2:
                    fut = r2.get_async("big")
                    proc.kill()
                    proc.wait(timeout=20)
                    with pytest.raises(StoreError):
                        fut.result(timeout=20)
            # The put raced the volume's death: on a loaded machine it can complete before the
            # kill lands. Either way it ends (no hang), and if it failed it says why.
            try:
                pending.result(timeout=30)
            except StoreError:
                pass
            blocked.close()
            # Afterwards: a clear error naming the lost volume; other keys still readable.
            with pytest.raises(VolumeLostError, match="vk"):
                store.get("big")
            assert torch.equal(store.get("small"), torch.ones(10))
            # The dead volume is forgotten once none of its slots is left.
            assert {v["volume"]: v["alive"] for v in store.ls()["volumes"]} == {"v0": True}
            # A killed process cannot unlink its segments; the next store on the host does.
            reap_stale()
            assert not {f for f in shm_segments(proc.pid) if "-vk-" in f}
            store.put("after", torch.zeros(3))  # new writes go to live volumes
            assert store.ls("after")["entries"][0]["volumes"] == ["v0"]
        finally:
            proc.kill()
            proc.wait()


def _raw(address: str, hello: bool = True) -> socket.socket:
    host, port = wire.parse_address(address)
    sock = socket.create_connection((host, port), timeout=10)
    if hello:
        wire.send(sock, {"op": "hello", "token": None, "proto": wire.PROTOCOL_VERSION})
        reply, _ = wire.recv_header(sock)
        assert reply["ok"]
    return sock


def _reply(sock: socket.socket) -> dict:
    reply, plen = wire.recv_header(sock)
    assert plen == 0
    return reply


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # closed with our unread bytes in its buffer
        return True


def test_malformed_and_oversized_messages(store):
    x = torch.randn(100)
    store.put("safe", x)
    conn = testing.raw(store.address)
    slot = conn.request(ops.ACQUIRE, key="safe", version="latest", known_sig=None, wait_ms=None)[
        "slots"
    ][0]
    conn.close()
    # Bad magic: error, connection closed.
    s = _raw(store.address)
    s.sendall(b"GET / HTTP/1.1\r\n\r\n")
    assert "bad magic" in _reply(s)["error"] and _closed(s)
    # Oversized header and payload: refused before reading them.
    s = _raw(store.address)
    s.sendall(struct.pack("<4sIQ", wire.MAGIC, 1 << 31, 0))
    assert "exceeds the limit" in _reply(s)["error"] and _closed(s)
    s = _raw(store.address)
    s.sendall(struct.pack("<4sIQ", wire.MAGIC, 10, 1 << 50))
    assert "payload" in _reply(s)["error"] and _closed(s)
    # Undecodable header.
    s = _raw(store.address)
    s.sendall(struct.pack("<4sIQ", wire.MAGIC, 4, 0) + b"\xc1\xc1\xc1\xc1")
    assert "undecodable" in _reply(s)["error"] and _closed(s)
    # Well framed but off-schema: an error reply, and the connection keeps working.
    s = _raw(store.address)
    for bad, msg in [
        ({"op": "pickle", "data": b"x"}, "unknown op"),
        ({"op": "get"}, "unknown op"),
        ({"op": "acquire", "key": "safe"}, "missing field 'version'"),
        (
            {"op": "acquire", "key": 3, "version": 0, "known_sig": None, "wait_ms": None},
            "field 'key'",
        ),
        ({"op": "keys", "prefix": "", "evil": 1}, "unknown fields"),
        ([1, 2, 3], "must be a map"),
    ]:
        body = msgpack.packb(bad)
        s.sendall(struct.pack("<4sIQ", wire.MAGIC, len(body), 0) + body)
        r = _reply(s)
        assert not r["ok"] and msg in r["error"], (bad, r)
    wire.send(s, {"op": "keys", "prefix": ""})
    assert _reply(s)["keys"] == ["safe"]
    # A write into a committed slot: refused, payload drained, slot untouched.
    wire.send(
        s,
        {"op": "vol_write", "slot": slot, "offset": 300, "nbytes": 200, "grant": bytes(16)},
        memoryview(b"\xff" * 200),
    )
    assert "not open for writing" in _reply(s)["error"]
    wire.send(
        s,
        {
            "op": "vol_read",
            "slot": slot,
            "shape": [100],
            "itemsize": 4,
            "offsets": [0],
            "sizes": [200],
        },
    )
    assert "exceeds shape" in _reply(s)["error"]
    # Connection without hello.
    s2 = _raw(store.address, hello=False)
    wire.send(s2, {"op": "keys", "prefix": ""})
    assert "first message must be 'hello'" in _reply(s2)["error"]
    # The store kept serving and nothing stored changed.
    assert torch.equal(store.get("safe"), x)
    with tidal.store.connect(store.address) as other:
        assert torch.equal(other.get("safe"), x)


def test_token_and_non_loopback():
    with pytest.raises(ValueError, match="requires a token"):
        Server(controller=Controller("t"), host="0.0.0.0")
    sid = new_store_id()
    server = Server(controller=Controller(sid), volume=Volume("v0", sid), token="s3cret")
    try:
        with pytest.raises(AuthError, match="wrong or missing token"):
            tidal.store.connect(server.address)
        with pytest.raises(AuthError):
            tidal.store.connect(server.address, token="nope")
        with tidal.store.connect(server.address, token="s3cret") as s:
            s.put("x", torch.ones(2))
            assert torch.equal(s.get("x"), torch.ones(2))
    finally:
        server.close()


def test_unreachable_store_is_a_clear_error():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(StoreError, match="cannot reach tidal store"):
        tidal.store.connect(f"tcp://127.0.0.1:{port}")
    with pytest.raises(ValueError, match="tcp://host:port"):
        tidal.store.connect("http://x")


def test_cli_serve_and_ls():
    proc, line = _start(["serve", "--port", "0", "--keep", "3"])
    try:
        assert line.startswith("tidal store serving at tcp://"), line + proc.stderr.read()
        address = line.split()[4]
        with tidal.store.connect(address) as s:
            s.put_state_dict({"w": torch.zeros(250, 4), "b": torch.ones(3)}, "policy")
            s.put("lr", torch.tensor(0.1))
        out = subprocess.run(
            [sys.executable, "-m", "tidal.store", "ls", address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "policy" in out.stdout and "state_dict" in out.stdout
        assert "4.0 KB" in out.stdout and "volume v0" in out.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0
    bad = subprocess.run(
        [sys.executable, "-m", "tidal.store", "serve", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "requires a token" in bad.stderr


def test_segments_of_killed_processes_are_reaped():
    from tidal.store.volume import pid_namespace

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # a pid that no longer runs
    ns = pid_namespace()
    dead = f"/dev/shm/tidal-{ns}.{proc.pid}xabc123-v0-1"
    live = f"/dev/shm/tidal-{ns}.{os.getpid()}xabc123-v0-1"
    other_ns = f"/dev/shm/tidal-{ns + 1}.{proc.pid}xabc123-v0-1"
    for p in (dead, live, other_ns):
        open(p, "w").close()
    try:
        assert reap_stale() >= 1
        assert not os.path.exists(dead)
        assert os.path.exists(live) and os.path.exists(other_ns)
    finally:
        for p in (dead, live, other_ns):
            if os.path.exists(p):
                os.unlink(p)


def test_full_volume_is_a_clear_error():
    sid = new_store_id()
    server = Server(controller=Controller(sid), volume=Volume("v0", sid, capacity=4000))
    try:
        with tidal.store.connect(server.address) as s:
            s.put("fits", torch.ones(500))  # 2000 bytes
            with pytest.raises(StoreError, match="volume v0 is full"):
                s.put("big", torch.ones(1000))  # 4000 more bytes
            assert not s.exists("big")
            assert torch.equal(s.get("fits"), torch.ones(500))
            s.delete("fits")
            s.put("big", torch.ones(1000))  # the memory came back
            assert torch.equal(s.get("big"), torch.ones(1000))
    finally:
        server.close()
