"""Tools for the hostile-client tests (tests/store/test_security_*.py, issue 9, section 0).

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
import select
import socket
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
from tidal.store import ops, testing, wire
from tidal.store.controller import Controller
from tidal.store.server import SERVER_THREAD, Server
from tidal.store.standalone import serve_registration
from tidal.store.volume import Volume, new_store_id

from .conftest import until

HELLO = {"op": "hello", "token": None, "proto": wire.PROTOCOL_VERSION}
W = torch.arange(250, dtype=torch.float32)  # 1000 bytes, one slot
SD = {"a": torch.full((3, 4), 7, dtype=torch.int64), "b": [torch.ones(5)], "step": 3}


# ------------------------------------------------------------------------------ helpers


def open_fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def server_threads() -> int:
    """Threads serving a connection in this process's servers (one per connection)."""
    names = [t.name.removeprefix(f"{SERVER_THREAD}-") for t in threading.enumerate()]
    return sum(n.isdigit() for n in names)


def frame_bytes(header_len: int, payload_len: int = 0, magic: bytes = wire.MAGIC) -> bytes:
    return wire.PREFIX.pack(magic, header_len, payload_len)


def msg_bytes(obj: Any, payload_len: int = 0) -> bytes:
    """A well-framed message whose header is any msgpack value."""
    body = msgpack.packb(obj, use_bin_type=True)
    return frame_bytes(len(body), payload_len) + body


def raw_sock(address: str, hello: bool = True, token: str | None = None) -> socket.socket:
    sock = socket.create_connection(wire.parse_address(address), timeout=10)
    if hello:
        sock.sendall(msg_bytes({**HELLO, "token": token}))
        assert read_reply(sock)["ok"]
    return sock


def read_reply(sock: socket.socket) -> dict[str, Any]:
    reply, plen = wire.recv_header(sock)
    assert plen == 0
    return reply


def send_all(sock: socket.socket, data: bytes) -> None:
    """Send ``data`` and end our side; the server may have closed first (it refuses bad
    input as soon as it sees it), which is no failure here."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sock.sendall(data)
    with contextlib.suppress(OSError):  # ENOTCONN once the server reset it
        sock.shutdown(socket.SHUT_WR)


def said_then_closed(sock: socket.socket, timeout: float = 10.0) -> dict[str, Any] | None:
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


def closed_soon(sock: socket.socket, timeout: float) -> bool:
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


def declaration(n: int) -> dict[str, Any]:
    return {"name": [], "shape": [n], "dtype": "float32", "offsets": [0], "sizes": [n]}


def begin_raw(conn, store, key: str, n: int = 250, writer: str = "evil", **declare):
    """Declare and begin a one-tensor put of ``key`` on ``conn``: (declared, begun)."""
    fields = {
        "kind": "tensor",
        "writers": 1,
        "keep": None,
        "host": testing.host(store),
        "volume": None,
        "tensors": [declaration(n)],
        **declare,
    }
    declared = conn.request(ops.PUT_DECLARE, key=key, **fields)
    begun = conn.request(
        ops.PUT_BEGIN,
        key=key,
        plan=declared["plan"],
        version=None,
        writer=writer,
        reservation=None,
        objects=[],
    )
    return declared, begun


def acquire_raw(conn, key: str) -> dict[str, Any]:
    return conn.request(ops.ACQUIRE, key=key, version="latest", known_sig=None, wait_ms=None)


def read_key(store, key: str, **kw: Any) -> torch.Tensor:
    """``key`` read by a fresh client (whose closing unmaps what it read: the attacked
    handle's mappings would hold file descriptors of deleted segments until swept)."""
    with tidal.store.connect(store.address, timeout=20) as fresh:
        return fresh.get(key, **kw)


def vol_write_request(slot: int, grant: bytes, nbytes: int, offset: int = 0) -> dict[str, Any]:
    return {"op": "vol_write", "slot": slot, "offset": offset, "nbytes": nbytes, "grant": grant}


@dataclass
class Baseline:
    """What a store holds before an attack, to compare with after it."""

    fds: int
    threads: int
    counts: dict[str, int]
    listed: set[tuple[str, int]]
    counts_of: Callable[[], dict[str, int]]


def baseline_of(store, counts_of: Callable[[], dict[str, int]] | None = None) -> Baseline:
    counts_of = counts_of or testing.controller(store).counts
    listed = {(e["key"], e["version"]) for e in store.ls()["entries"]}
    return Baseline(open_fds(), server_threads(), counts_of(), listed, counts_of)


def saved_data(store) -> dict[str, Any]:
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
    until(
        lambda: open_fds() <= base.fds, f"fds stay above the baseline {base.fds}: {open_fds()}", 20
    )
    until(
        lambda: server_threads() <= base.threads,
        f"server threads stay above {base.threads}: {server_threads()}",
        20,
    )
    until(
        lambda: base.counts_of() == base.counts,
        f"controller holds {base.counts_of()}, had {base.counts}",
        20,
    )
    if embedded:
        assert testing.leases(store) == base.counts["leases"]
    assert {(e["key"], e["version"]) for e in store.ls()["entries"]} == base.listed
    for transport in ("shm", "tcp"):
        with tidal.store.connect(
            store.address, token=token, transport=transport, timeout=20
        ) as fresh:
            assert torch.equal(fresh.get("w"), saved["w"])
            sd = fresh.get_state_dict("sd")
            assert torch.equal(sd["a"], saved["sd"]["a"]) and sd["step"] == saved["sd"]["step"]
            fresh.put(f"legit/{transport}", W + 1)
            assert torch.equal(fresh.get(f"legit/{transport}"), W + 1)
            assert store.exists(f"legit/{transport}")
            fresh.delete(f"legit/{transport}")
    assert torch.equal(store.get("w"), saved["w"])  # the attacked handle too


@contextlib.contextmanager
def serving(token: str | None = None, **kw: Any) -> Iterator[tuple[Server, list[str]]]:
    """A server of this test (controller + volume v0) and the warnings it logged."""
    logs: list[str] = []
    sid = new_store_id()
    server = Server(
        controller=Controller(sid), volume=Volume("v0", sid), token=token, log=logs.append, **kw
    )
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
        self.conn.request(
            ops.REGISTER_VOLUME,
            volume_id=volume_id,
            address="tcp://127.0.0.1:9",
            host=testing.host(store),
            shm_dir=self.vol.shm_dir,
            store_id=self.vol.store_id,
        )
        assert self.conn.sock is not None
        self.thread = threading.Thread(
            target=serve_registration, args=(self.conn.sock, self.vol), daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.vol.go.set()
        with contextlib.suppress(OSError):
            assert self.conn.sock is not None
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()
        self.thread.join(10)
        self.vol.close()


def alive_volumes(store) -> dict[str, bool]:
    return {v["volume"]: v["alive"] for v in store.ls()["volumes"]}
