"""Connections that wait for their peer with no timeout carry TCP keepalive probes
(`wire.keep_alive`): a server's idle client connection and a volume's registration
connection to its controller. A peer whose host dies sends no FIN; the probes end such a
wait (about a minute) instead of leaving it forever. CPU only, loopback, well under a second."""

from __future__ import annotations

import os
import socket
import threading
import time

from tidal.store import wire
from tidal.store.controller import Controller
from tidal.store.server import Server
from tidal.store.standalone import serve_registration
from tidal.store.volume import Volume, new_store_id


def _keepalive(sock: socket.socket) -> dict[str, int]:
    got = {"SO_KEEPALIVE": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)}
    for name in wire.KEEPALIVE:
        if hasattr(socket, name):
            got[name] = sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, name))
    return got


def _want() -> dict[str, int]:
    return {"SO_KEEPALIVE": 1} | {n: v for n, v in wire.KEEPALIVE.items() if hasattr(socket, n)}


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname(), timeout=5)
        served, _ = listener.accept()
    return client, served


def _served_end(client: socket.socket) -> socket.socket | None:
    """This process's accepted end of `client`'s connection (the in-process server's)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.getpeername() == client.getsockname():
                return sock
        except OSError:
            pass
        sock.close()
    return None


def test_keep_alive_sets_the_probes_and_skips_other_sockets():
    client, served = _pair()
    with client, served:
        wire.keep_alive(served)
        assert _keepalive(served) == _want()
        assert _keepalive(client)["SO_KEEPALIVE"] == 0  # only where asked
    a, b = socket.socketpair()  # AF_UNIX: left as it is
    with a, b:
        wire.keep_alive(a)
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0


def test_the_server_probes_its_idle_connections():
    sid = new_store_id()
    server = Server(controller=Controller(sid))
    try:
        client = socket.create_connection(wire.parse_address(server.address), timeout=5)
        with client:
            deadline = time.monotonic() + 3
            got: dict[str, int] = {}
            while got != _want() and time.monotonic() < deadline:
                # the server's threads accept it, then set keepalive before the hello
                served = _served_end(client)
                if served is not None:
                    with served:
                        got = _keepalive(served)
                time.sleep(0.02)
            assert got == _want()
    finally:
        server.close()


def test_a_volume_probes_its_controller_connection():
    client, served = _pair()
    vol = Volume("v0", new_store_id())
    try:
        with client, served:
            done = threading.Event()

            def serve() -> None:
                serve_registration(served, vol)
                done.set()

            threading.Thread(target=serve, daemon=True).start()
            deadline = time.monotonic() + 3
            while _keepalive(served) != _want() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _keepalive(served) == _want()
            client.close()  # the controller goes: the volume's loop ends
            assert done.wait(3)
    finally:
        vol.close()
