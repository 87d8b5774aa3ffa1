"""Store server: a TCP endpoint serving a controller, a volume, or both.

Lifecycle:
- ``tidal store serve`` and the embedded store (``connect()`` with no address) run one
  :class:`Server` holding a :class:`Controller` and a local :class:`Volume`, in background
  threads of the calling process.
- ``tidal store volume --controller tcp://...`` runs a :class:`Server` with a volume only
  and registers it with the controller (:func:`run_volume`). The controller then sends the
  volume its ``registration`` ops over that same connection (tidal/store/backends.py), and
  the connection closing means the volume is gone: its versions become lost and readers get
  VolumeLostError.

One thread per connection. A connection must say ``hello`` (with the token, if the server
has one) within ``hello_timeout`` seconds, with a small header and no payload; at most
``max_pending`` connections may be waiting to do so and at most ``max_connections`` be open,
so idle or hostile peers cannot exhaust the server's threads or file descriptors. After
hello, a connection may idle between messages for as long as it likes, but a message once
started must keep arriving (``io_timeout`` seconds without progress drops it). The accept
loop survives running out of file descriptors (it backs off and keeps serving).

A framing error (bad magic, oversized or undecodable header, a message cut short) gets an
error reply where possible and the connection is closed; a schema or user error gets an
error reply and the connection stays usable. Whatever ends a connection, its socket is
closed and the controller releases what it held (leases, pending writes, plans). Nothing
disturbs other connections or stored data.

Ops are dispatched from their declaration in tidal/store/ops.py: a ``controller`` op calls
the controller's method for it (``Controller.op_handler``) with the connection id, a
``volume`` op the volume's data path; ``registration`` ops are never served on a port.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import itertools
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from tidal.store import ops, wire
from tidal.store.backends import LocalBackend, RemoteBackend
from tidal.store.controller import Controller
from tidal.store.errors import WIRE_ERRORS, AuthError, ProtocolError, StoreError
from tidal.store.records import VolumeRec
from tidal.store.volume import Volume

_USER_ERRORS = tuple(WIRE_ERRORS.values())
SERVER_THREAD = "tidal-store"  # name prefix of the threads that serve connections
_OUT_OF_FDS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _stderr(msg: str) -> None:
    print(f"tidal store: {msg}", file=sys.stderr, flush=True)


class _RateLimited:
    """Log each kind of message at most once per ``every`` seconds, counting the rest."""

    def __init__(self, log: Callable[[str], None], every: float = 10.0) -> None:
        self._log, self._every = log, every
        self._last: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def __call__(self, kind: str, msg: str) -> None:
        now = time.monotonic()
        with self._lock:
            last, skipped = self._last.get(kind, (-1e9, 0))
            if now - last < self._every:
                self._last[kind] = (last, skipped + 1)
                return
            self._last[kind] = (now, 0)
        more = f" ({skipped} more like it since)" if skipped else ""
        self._log(msg + more)


Reply = tuple[dict[str, Any], memoryview | None]  # reply fields, and bulk bytes to send after
# handler(connection id, request fields, payload length, socket): the payload, if any, is
# still on the socket for the handler to read
Handler = Callable[[int, dict[str, Any], int, socket.socket], Reply]


def _controller_op(method: Callable[..., dict[str, Any]]) -> Handler:
    """A controller method ``method(conn id, **fields)`` as a handler (controller ops carry
    no payload: ops.check_request refused one)."""

    def handle(cid: int, fields: dict[str, Any], plen: int, sock: socket.socket) -> Reply:
        return method(cid, **fields), None

    return handle


class Server:
    """Serves a controller and/or a volume on ``host:port`` (port 0: any free port).

    Args:
        controller: metadata service to expose, or None for a volume-only server.
        volume: local volume to expose (and to register with ``controller`` if both).
        host: interface to listen on; anything but loopback requires ``token``.
        port: TCP port, 0 for a random free one.
        token: shared secret every client must present in its hello.
        max_payload: largest payload accepted in one message, in bytes.
        hello_timeout: seconds a new connection has to say hello.
        io_timeout: seconds a started message may go without progress.
        max_pending: connections allowed to be waiting for their hello at once.
        max_connections: connections allowed open at once.
        log: where warnings go (default: stderr).

    Raises:
        ValueError: a non-loopback host without a token.
        StoreError: the address cannot be listened on (in use, not local).
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
        hello_timeout: float = 10.0,
        io_timeout: float = 60.0,
        max_pending: int = 64,
        max_connections: int = 1024,
        log: Callable[[str], None] = _stderr,
    ) -> None:
        if not is_loopback(host) and not token:
            raise ValueError(
                f"listening on {host!r} (not loopback) requires a token; pass --token-file "
                "(or set TIDAL_STORE_TOKEN) or listen on 127.0.0.1"
            )
        self.controller = controller
        self.volume = volume
        self.token = token
        self.max_payload = max_payload
        self.hello_timeout = hello_timeout
        self.io_timeout = io_timeout
        self.max_pending = max_pending
        self.max_connections = max_connections
        self.host_id = wire.host_id()
        self._warn = _RateLimited(log)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = socket.create_server((host, port), family=family, backlog=128)
        except OSError as e:
            why = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise StoreError(f"cannot listen on {host}:{port}: {why}") from None
        bound = self._listener.getsockname()
        shown = f"[{host}]" if ":" in host else host
        self.address = f"tcp://{shown}:{bound[1]}"
        self._conns: dict[int, socket.socket] = {}
        self._pending = 0
        self._ids = itertools.count(1)
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._handlers = self._build_handlers()
        if volume is not None:
            volume.nixl_loopback = is_loopback(host)
        if controller is not None and volume is not None:
            controller.add_volume(
                VolumeRec(
                    volume.volume_id,
                    "shm",
                    self.host_id,
                    self.address,
                    volume.shm_dir,
                    volume.store_id,
                    LocalBackend(volume),
                )
            )
        self._thread = threading.Thread(target=self._accept_loop, name=SERVER_THREAD, daemon=True)
        self._thread.start()

    def _build_handlers(self) -> dict[str, Handler]:
        """op name -> handler, for every op this server answers on its port (tidal/store/ops.py
        says who serves what): its controller's ops call the controller's method for that op
        (``Controller.op_handler``), a volume's data ops the volume, and ``bye`` / ``hello``
        end or refuse here.
        ``register_volume`` takes the connection over and is served before dispatch."""
        out: dict[str, Handler] = {"bye": self._bye, "hello": self._hello_again}
        if self.volume is not None:
            out["vol_write"], out["vol_read"] = self._vol_write, self._vol_read
            out["vol_nixl"] = self._vol_nixl
        if self.controller is not None:
            for name, op in ops.OPS.items():
                if (
                    op.served_by == "controller"
                    and name not in out
                    and op is not ops.REGISTER_VOLUME
                ):
                    out[name] = _controller_op(self.controller.op_handler(name))
        return out

    def _bye(self, cid: int, fields: dict[str, Any], plen: int, sock: socket.socket) -> Reply:
        """A graceful close: the connection's leases and pending writes go before the reply."""
        if self.controller is not None:
            self.controller.connection_closed(cid)
        return {}, None

    def _hello_again(
        self, cid: int, fields: dict[str, Any], plen: int, sock: socket.socket
    ) -> Reply:
        raise ValueError("this connection said hello already")

    def _vol_write(self, cid: int, fields: dict[str, Any], plen: int, sock: socket.socket) -> Reply:
        assert self.volume is not None, "served only with a volume"
        if fields["nbytes"] != plen:
            wire.discard(sock, plen)
            raise ValueError(f"vol_write declares {fields['nbytes']} bytes, payload has {plen}")
        self.volume.write_from(
            sock, **{k: fields[k] for k in ("slot", "offset", "nbytes", "grant")}
        )
        return {}, None

    def _vol_read(self, cid: int, fields: dict[str, Any], plen: int, sock: socket.socket) -> Reply:
        assert self.volume is not None, "served only with a volume"
        view = self.volume.read_view(**fields)
        return {"nbytes": view.nbytes}, view

    def _vol_nixl(self, cid: int, fields: dict[str, Any], plen: int, sock: socket.socket) -> Reply:
        assert self.volume is not None, "served only with a volume"
        agent, metadata, where = self.volume.nixl_describe(fields["slots"])
        slots = [{"slot": s, "addr": a, "nbytes": n} for s, a, n in where]
        return {"agent": agent, "metadata": metadata, "slots": slots}, None

    # ------------------------------------------------------------------ connections

    def _accept_loop(self) -> None:
        backoff = 0.01
        while not self._closing.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError as e:
                if self._closing.is_set():
                    return
                if e.errno in _OUT_OF_FDS:
                    self._warn(
                        "fds", f"out of file descriptors accepting a connection ({e}); backing off"
                    )
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 1.0)
                elif e.errno not in (errno.ECONNABORTED, errno.EINTR, errno.EPROTO):
                    self._warn("accept", f"accept failed: {e}")
                    time.sleep(0.05)
                continue
            backoff = 0.01
            if self._closing.is_set():  # accepted while closing: nobody serves it
                _close(sock)
                return
            with self._lock:
                full = len(self._conns) >= self.max_connections
                crowded = self._pending >= self.max_pending
                if not (full or crowded):
                    cid = next(self._ids)
                    self._conns[cid] = sock
                    self._pending += 1
            if full or crowded:
                why = (
                    f"{self.max_connections} connections are open"
                    if full
                    else f"{self.max_pending} connections are waiting to say hello"
                )
                self._warn("refused", f"refused a connection: {why}")
                _refuse(sock, f"tidal store refused the connection: {why}; try again later")
                continue
            try:
                threading.Thread(
                    target=self._serve,
                    args=(sock, cid),
                    name=f"{SERVER_THREAD}-{cid}",
                    daemon=True,
                ).start()
            except RuntimeError as e:  # no thread left to start
                self._warn("threads", f"cannot start a connection thread: {e}")
                self._forget(cid, hello_done=False)
                _close(sock)

    def close(self) -> None:
        """Stop listening, drop every connection and free the local volume's memory."""
        self._closing.set()
        try:  # wakes the accept loop: closing alone leaves a blocked accept() listening
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        _close(self._listener)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        with self._lock:
            conns = list(self._conns.values())
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self.volume is not None:
            self.volume.close()

    def _forget(self, cid: int, hello_done: bool) -> None:
        with self._lock:
            self._conns.pop(cid, None)
            if not hello_done:
                self._pending -= 1

    def _reply_error(self, sock: socket.socket, e: BaseException, keep: bool = False) -> None:
        """Send an error reply. ``keep``: the connection goes on, so a reply that could not
        be sent whole (a peer that does not read) raises and ends it, rather than leaving a
        cut message on the stream."""
        etype = type(e).__name__ if type(e).__name__ in WIRE_ERRORS else "StoreError"
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        try:
            wire.send(sock, {"ok": False, "etype": etype, "error": str(msg)})
        except OSError:
            if keep:
                raise

    def _serve(self, sock: socket.socket, cid: int) -> None:
        hello_done = False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wire.keep_alive(sock)  # it idles between messages with no timeout (_messages)
            self._hello(sock)
            with self._lock:
                self._pending -= 1
            hello_done = True
            self._messages(sock, cid)
        except wire.ConnectionClosed:
            pass
        except (ProtocolError, AuthError) as e:
            self._reply_error(sock, e)
        except (OSError, StoreError):
            pass  # the peer went away, timed out, or the server is closing
        except BaseException as e:  # a bug: say so, and still clean up below
            self._warn("bug", f"connection {cid} failed: {e!r}\n{traceback.format_exc()}")
        finally:
            self._forget(cid, hello_done)
            _close(sock)
            if self.controller is not None:
                self.controller.connection_closed(cid)

    def _hello(self, sock: socket.socket) -> None:
        # Before the token is checked: a deadline for the whole message (not per receive,
        # which a peer trickling a byte at a time would stretch), a small header, no payload.
        deadline = time.monotonic() + self.hello_timeout
        try:
            header, plen = wire.recv_header(
                sock, max_header=1 << 16, max_payload=0, deadline=deadline
            )
        except TimeoutError:
            raise ProtocolError(f"no hello within {self.hello_timeout:g} s") from None
        op = ops.check_request(header, plen)
        if op is not ops.HELLO:
            raise AuthError(f"the first message must be 'hello', got {op.name!r}")
        if header["proto"] != wire.PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {header['proto']} unsupported "
                f"(server speaks {wire.PROTOCOL_VERSION}; upgrade tidal on both sides)"
            )
        if self.token is not None and not hmac.compare_digest(
            (header["token"] or "").encode(), self.token.encode()
        ):
            raise AuthError("wrong or missing token for this tidal store")
        wire.send(sock, {"ok": True, "host": self.host_id, "proto": wire.PROTOCOL_VERSION})

    def _messages(self, sock: socket.socket, cid: int) -> None:
        while True:
            sock.settimeout(None)  # idle between messages as long as the peer likes
            if not sock.recv(1, socket.MSG_PEEK):
                return  # closed cleanly
            sock.settimeout(self.io_timeout)  # but a started message must keep coming
            header, plen = wire.recv_header(sock, max_payload=self.max_payload)
            try:
                op = ops.check_request(header, plen)
            except ProtocolError as e:
                if plen:  # framing is unsure: do not read an unvalidated payload
                    raise
                self._reply_error(sock, e, keep=True)  # well framed: answer, keep it
                continue
            if op is ops.REGISTER_VOLUME and self.controller is not None:
                self._register(sock, cid, header)
                return
            try:
                reply, payload = self._dispatch(op, header, plen, sock, cid)
            except _USER_ERRORS as e:
                self._reply_error(sock, e, keep=True)
                continue
            except OSError:
                raise
            except Exception as e:  # a bug: report it to the caller, keep serving others
                self._warn("bug", f"op {op.name!r} failed: {e!r}\n{traceback.format_exc()}")
                self._reply_error(
                    sock, StoreError(f"internal error in {op.name!r}: {e!r}"), keep=True
                )
                continue
            reply["ok"] = True
            wire.send(sock, reply, payload)
            if op is ops.BYE:
                return

    def _dispatch(
        self, op: ops.Op, m: dict[str, Any], plen: int, sock: socket.socket, cid: int
    ) -> Reply:
        handler = self._handlers.get(op.name)
        if handler is None:
            if plen:  # keep the stream framed: the payload is not for this port
                wire.discard(sock, plen)
            where = {
                "controller": "a controller",
                "volume": "a volume",
                "registration": "a volume's registration connection",
            }[op.served_by]
            raise ValueError(f"op {op.name!r} is served by {where}, not on this port")
        return handler(cid, {k: v for k, v in m.items() if k != "op"}, plen, sock)

    def _register(self, sock: socket.socket, cid: int, m: dict[str, Any]) -> None:
        """A volume process joins: from now on this connection carries the controller's
        requests to it; this thread watches it until it closes."""
        assert self.controller is not None, "registration needs a controller"
        backend = RemoteBackend(sock, m["volume_id"])
        rec = VolumeRec(
            m["volume_id"],
            "shm",
            m["host"],
            m["address"],
            m["shm_dir"],
            m["store_id"],
            backend,
            owner=cid,
        )
        with backend.holding():  # no request of the controller's goes out before the reply
            try:
                self.controller.add_volume(rec)
            except _USER_ERRORS as e:
                self._reply_error(sock, e)
                return
            wire.send(sock, {"ok": True})
        backend.monitor(self._closing)


def _refuse(sock: socket.socket, why: str) -> None:
    """Tell a connection the server will not serve it (the reply to its hello), without
    ever waiting on it, then close it."""
    try:
        sock.setblocking(False)
        sock.send(wire.pack({"ok": False, "etype": "StoreError", "error": why}))
    except OSError:
        pass  # best effort: the peer sees the close either way
    _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
