"""Store server: a TCP endpoint serving a controller, a volume, or both.

Lifecycle:
- ``tidal store serve`` and the embedded store (``connect()`` with no address) run one
  :class:`Server` holding a :class:`Controller` and a local :class:`Volume`, in background
  threads of the calling process.
- ``python -m tidal.store volume --controller tcp://...`` runs a :class:`Server` with a
  volume only and registers it with the controller (:func:`run_volume`); the controller
  treats the registration connection as the volume's heartbeat: when it closes, the volume's
  versions become lost and readers get VolumeLostError.

One thread per connection. A connection starts with ``hello`` (checking the token), then
carries request/reply pairs. A framing error (bad magic, oversized or undecodable header)
gets an error reply and the connection is closed; a schema or user error gets an error reply
and the connection stays usable. Neither disturbs other connections or stored data.
"""

from __future__ import annotations

import glob
import hmac
import ipaddress
import itertools
import os
import select
import socket
import sys
import threading
import traceback
from typing import Any

from tidal.store import wire
from tidal.store.conn import Conn
from tidal.store.controller import Controller, VolumeRec
from tidal.store.errors import WIRE_ERRORS, AuthError, ProtocolError, StoreError
from tidal.store.volume import Volume, new_store_id, reap_stale

_USER_ERRORS = tuple(WIRE_ERRORS.values())
SERVER_THREAD = "tidal-store"  # name prefix of the threads that serve connections


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Server:
    """Serves a controller and/or a volume on ``host:port`` (port 0: any free port).

    Args:
        controller: metadata service to expose, or None for a volume-only server.
        volume: local volume to expose (and to register with ``controller`` if both).
        host: interface to listen on; anything but loopback requires ``token``.
        port: TCP port, 0 for a random free one.
        token: shared secret every client must present in its hello.
        max_payload: largest payload accepted in one message, in bytes.
    """

    def __init__(
        self,
        *,
        controller: Controller | None = None,
        volume: Volume | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_payload: int = 1 << 40,
    ) -> None:
        if not is_loopback(host) and not token:
            raise ValueError(
                f"listening on {host!r} (not loopback) requires a token; pass --token or "
                "listen on 127.0.0.1"
            )
        self.controller = controller
        self.volume = volume
        self.token = token
        self.max_payload = max_payload
        self.host_id = wire.host_id()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        bound = self._listener.getsockname()
        shown = f"[{host}]" if ":" in host else host
        self.address = f"tcp://{shown}:{bound[1]}"
        self._conns: dict[int, socket.socket] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._lock = threading.Lock()
        if controller is not None and volume is not None:
            controller.add_volume(
                VolumeRec(
                    volume_id=volume.volume_id,
                    address=self.address,
                    host=self.host_id,
                    shm_prefix=volume.shm_prefix,
                    create=volume.create,
                    destroy=volume.destroy,
                    probe=lambda: True,
                )
            )
        self._thread = threading.Thread(target=self._accept_loop, name=SERVER_THREAD, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ plumbing

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            cid = next(self._ids)
            with self._lock:
                self._conns[cid] = sock
            threading.Thread(
                target=self._serve, args=(sock, cid), name=f"{SERVER_THREAD}-{cid}", daemon=True
            ).start()

    def close(self) -> None:
        """Stop listening, drop every connection and free the local volume's memory."""
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns.values())
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self.volume is not None:
            self.volume.close()

    def _reply_error(self, sock: socket.socket, e: BaseException) -> None:
        etype = type(e).__name__ if type(e).__name__ in WIRE_ERRORS else "StoreError"
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        try:
            wire.send(sock, {"ok": False, "etype": etype, "error": str(msg)})
        except OSError:
            pass

    def _serve(self, sock: socket.socket, cid: int) -> None:
        volume_id: str | None = None
        try:
            # Before the token is checked, accept only a small header and no payload.
            header, plen = wire.recv_header(sock, max_header=1 << 16, max_payload=0)
            op = wire.check_request(header, plen)
            if op != "hello":
                raise AuthError(f"the first message must be 'hello', got {op!r}")
            if header["proto"] != wire.PROTOCOL_VERSION:
                raise ProtocolError(
                    f"protocol version {header['proto']} unsupported "
                    f"(server speaks {wire.PROTOCOL_VERSION})"
                )
            if self.token is not None and not hmac.compare_digest(
                (header["token"] or "").encode(), self.token.encode()
            ):
                raise AuthError("wrong or missing token for this tidal store")
            wire.send(sock, {"ok": True, "host": self.host_id, "proto": wire.PROTOCOL_VERSION})
            while True:
                header, plen = wire.recv_header(sock, max_payload=self.max_payload)
                try:
                    op = wire.check_request(header, plen)
                except ProtocolError as e:
                    if plen:  # framing is unsure: do not read an unvalidated payload
                        raise
                    self._reply_error(sock, e)  # well framed: answer, keep the connection
                    continue
                try:
                    reply, payload = self._dispatch(op, header, plen, sock, cid)
                    if op == "register_volume":
                        volume_id = header["volume_id"]
                except _USER_ERRORS as e:
                    self._reply_error(sock, e)
                    continue
                except OSError:
                    raise
                except Exception as e:  # a bug: report it to the caller, keep serving others
                    traceback.print_exc(file=sys.stderr)
                    self._reply_error(sock, StoreError(f"internal error in {op!r}: {e!r}"))
                    continue
                reply["ok"] = True
                wire.send(sock, reply, payload)
                if op == "bye":
                    break
        except wire.ConnectionClosed:
            pass
        except (ProtocolError, AuthError) as e:
            self._reply_error(sock, e)
        except OSError:
            pass
        self._cleanup(sock, cid, volume_id)

    def _cleanup(self, sock: socket.socket, cid: int, volume_id: str | None) -> None:
        with self._lock:
            self._conns.pop(cid, None)
        try:
            sock.close()
        except OSError:
            pass
        if self.controller is not None:
            self.controller.connection_closed(cid)
            if volume_id is not None:
                self.controller.volume_gone(volume_id)

    # ------------------------------------------------------------------ ops

    def _need_controller(self, op: str) -> Controller:
        if self.controller is None:
            raise ValueError(f"op {op!r} needs a controller; this server runs a volume only")
        return self.controller

    def _need_volume(self, op: str) -> Volume:
        if self.volume is None:
            raise ValueError(f"op {op!r} needs a volume; this server runs none")
        return self.volume

    def _dispatch(
        self, op: str, m: dict[str, Any], plen: int, sock: socket.socket, cid: int
    ) -> tuple[dict[str, Any], memoryview | None]:
        if op == "vol_write":
            vol = self.volume
            if vol is None or m["nbytes"] != plen:
                wire.discard(sock, plen)
                if vol is None:
                    self._need_volume(op)
                raise ValueError(f"vol_write declares {m['nbytes']} bytes, payload has {plen}")
            try:
                vol.segment(m["slot"])
            except StoreError:
                wire.discard(sock, plen)
                raise
            vol.write_from(sock, m["slot"], m["offset"], m["nbytes"])
            return {}, None
        if op == "vol_read":
            view = self._need_volume(op).read_view(
                m["slot"], m["shape"], m["itemsize"], m["offsets"], m["sizes"]
            )
            return {"nbytes": view.nbytes}, view
        if op == "vol_create":
            self._need_volume(op).create(m["slot"], m["nbytes"])
            return {}, None
        if op == "vol_destroy":
            self._need_volume(op).destroy(m["slots"])
            return {}, None
        if op == "bye":  # a graceful close: leases and pending writes go before the reply
            if self.controller is not None:
                self.controller.connection_closed(cid)
            return {}, None
        c = self._need_controller(op)
        if op == "put_begin":
            return c.put_begin(cid, m), None
        if op == "put_commit":
            return c.put_commit(cid, m["key"], m["version"], m["writer"]), None
        if op == "put_abort":
            return c.put_abort(cid, m["key"], m["version"], m["writer"]), None
        if op == "acquire":
            wait = m.get("wait_ms")
            return c.acquire(cid, m["key"], m["version"], m["known_sig"], wait), None
        if op == "put_progress":
            return c.put_progress(cid, m["key"], m["version"], m["writer"], m["slots"]), None
        if op == "wait":
            return c.wait(cid, m["key"], m["version"], m["slots"], m["wait_ms"]), None
        if op == "release":
            return c.release(cid, m["lease"]), None
        if op == "keys":
            return {"keys": c.keys(m["prefix"])}, None
        if op == "versions":
            return {"versions": c.versions(m["key"])}, None
        if op == "exists":
            return {"exists": c.exists(m["key"], m["version"])}, None
        if op == "delete":
            return {"deleted": c.delete(m["key"], m["version"])}, None
        if op == "ls":
            return {"entries": c.ls(m["prefix"]), "volumes": c.volumes()}, None
        if op == "register_volume":
            c.add_volume(_remote_volume(m, sock, self.token, self.host_id))
            return {}, None
        if op == "device_volume":
            c.add_device_volume(cid, m["volume_id"], m["host"])
            return {}, None
        if op == "put_handles":
            return c.put_handles(cid, m["volume_id"], m["handles"]), None
        if op == "slot_handles":
            return c.slot_handles(m["volume_id"], m["slots"]), None
        if op == "volumes":
            return {"volumes": c.volumes()}, None
        raise ProtocolError(f"op {op!r} is not served here")


def _remote_volume(
    m: dict[str, Any], sock: socket.socket, token: str | None, host: str
) -> VolumeRec:
    """A VolumeRec whose create/destroy are RPCs to the volume's own server, and whose probe
    peeks at the registration connection (EOF there means the volume process is gone)."""
    lock = threading.Lock()
    rpc: list[Conn] = []

    def call(header: dict[str, Any]) -> None:
        with lock:
            if not rpc:
                rpc.append(Conn(m["address"], token, timeout=30.0))
            try:
                rpc[0].request(header)
            except StoreError:
                if rpc[0].sock.fileno() < 0:
                    rpc.clear()
                raise

    def probe() -> bool:
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return True
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except (OSError, ValueError):
            return False

    def cleanup() -> None:
        # A killed volume process cannot unlink its segments; on its host we can.
        if m["host"] == host and m["shm_prefix"].startswith("/dev/shm/tidal-"):
            for path in glob.glob(glob.escape(m["shm_prefix"]) + "*"):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    return VolumeRec(
        volume_id=m["volume_id"],
        address=m["address"],
        host=m["host"],
        shm_prefix=m["shm_prefix"],
        create=lambda slot, n: call({"op": "vol_create", "slot": slot, "nbytes": n}),
        destroy=lambda slots: call({"op": "vol_destroy", "slots": slots}),
        probe=probe,
        cleanup=cleanup,
    )


def run_volume(
    controller_address: str,
    volume_id: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    shm_dir: str = "/dev/shm",
    capacity: int | None = None,
    ready: Any = None,
) -> None:
    """Serve a volume and register it with a controller; return when the controller goes.

    ``ready``, if given, is called with the volume server's address once registered.
    """
    reg = Conn(controller_address, token, timeout=30.0)
    reap_stale(shm_dir)
    vol = Volume(volume_id, new_store_id(), shm_dir=shm_dir, capacity=capacity)
    server = Server(volume=vol, host=host, port=port, token=token)
    try:
        reg.request(
            {
                "op": "register_volume",
                "volume_id": volume_id,
                "address": server.address,
                "host": server.host_id,
                "shm_prefix": vol.shm_prefix,
            }
        )
        if ready is not None:
            ready(server.address)
        reg.sock.settimeout(None)
        try:  # block until the controller closes the registration connection
            wire.recv_header(reg.sock)
        except (StoreError, OSError):
            pass
    finally:
        reg.close()
        server.close()
