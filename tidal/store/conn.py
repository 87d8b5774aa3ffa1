"""A client connection to a store server: one socket, one request in flight at a time.

A :class:`Conn` says hello once connected, then carries requests built from the op table
(tidal/store/ops.py) and checks every reply against it. A socket failure or a timeout
closes the socket and raises StoreError for that call; the next call reconnects (a new hello),
so a handle survives a timeout or a server restart, or says clearly that the server cannot be
reached. What the server tied to the old connection (leases, pending writes, put plans, a
device volume) is gone after a reconnect: ``generation`` counts connections, so owners of
such state can tell. A connection the server closed while it sat idle (a restart, a server
that dropped it) is noticed before a request goes out, which then goes out on a new one,
except a request naming state of the old connection (``Op.bound``: a lease, a put plan, a
pending write), which raises StoreError saying the connection was lost.

``send`` / ``receive`` pipeline a request: a caller that holds ``lock`` may send one and read
its reply later, doing other work (copying bytes) in between.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable
from typing import Any

from tidal.store import ops, wire
from tidal.store.errors import WIRE_ERRORS, ProtocolError, StoreError


class Conn:
    """A connection to a store server (controller and/or volume), after the hello exchange.

    ``request`` sends one message and waits for its reply; it raises the error the server
    named (from the fixed table ``errors.WIRE_ERRORS``) when the reply says ``ok: False``.
    Socket failures and timeouts raise StoreError naming the address.
    """

    def __init__(self, address: str, token: str | None, timeout: float) -> None:
        self.address = address
        self._endpoint = wire.parse_address(address)
        self._token = token
        self.timeout = timeout
        self.lock = threading.RLock()
        # Called with (op, fields) before every request goes out (tidal.store.testing).
        self.hook: Callable[[ops.Op, dict[str, Any]], None] | None = None
        self.sock: socket.socket | None = None
        self.generation = 0
        self.info: dict[str, Any] = {}
        self._closed = False
        self._connect()

    @property
    def connected(self) -> bool:
        return self.sock is not None

    def _connect(self) -> None:
        if self._closed:
            raise StoreError(f"this connection to {self.address} was closed (store.close())")
        try:
            sock = socket.create_connection(self._endpoint, timeout=self.timeout)
        except OSError as e:
            again = " (it answered earlier: stopped or restarted?)" if self.generation else ""
            raise StoreError(f"cannot reach tidal store at {self.address}: {e}{again}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.generation += 1
        try:
            self.info = self.request(ops.HELLO, token=self._token, proto=wire.PROTOCOL_VERSION)
        except BaseException:
            self._drop()
            raise

    def request(
        self,
        op: ops.Op,
        *,
        payload: memoryview | None = None,
        into: memoryview | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """Send ``op`` (+ payload); return the reply. A reply payload is received into
        ``into``, which must be exactly its size."""
        with self.lock:
            self.send(op, payload=payload, **fields)
            return self.receive(op, into=into)

    def ensure(self) -> None:
        """Connect now if the last call dropped the connection (``generation`` is then that
        of the connection the next request goes out on)."""
        with self.lock:
            if self.sock is not None and not _usable(self.sock):
                self._drop()  # the server closed it meanwhile (restarted, or timed it out)
            if self.sock is None:
                self._connect()

    def send(
        self,
        op: ops.Op,
        *,
        payload: memoryview | None = None,
        reconnect: bool = True,
        **fields: Any,
    ) -> None:
        """Send a request without waiting for its reply (hold ``lock`` until ``receive``).
        ``reconnect=False``: raise instead of sending on a new connection (the request
        names state of this one)."""
        header = ops.request(op, **fields)
        if self.hook is not None:
            self.hook(op, fields)
        with self.lock:
            if self.sock is not None and op is not ops.HELLO and not _usable(self.sock):
                self._drop()  # the server closed it meanwhile (restarted, or timed it out)
            if self.sock is None:
                if not reconnect or op.bound:
                    raise StoreError(
                        f"connection to tidal store at {self.address} was lost before "
                        f"{op.name!r}; what it held (leases, put plans, pending writes) went "
                        "with it"
                    )
                self._connect()
            assert self.sock is not None, "connected above"
            try:
                wire.send(self.sock, header, payload)
            except OSError as e:
                self._fail(op, e)

    def receive(self, op: ops.Op, *, into: memoryview | None = None) -> dict[str, Any]:
        """The reply to the oldest request sent and not yet received (which was ``op``)."""
        with self.lock:
            sock = self.sock
            if sock is None:
                raise StoreError(f"connection to tidal store at {self.address} was lost")
            try:
                reply, plen = wire.recv_header(sock)
                if not isinstance(reply, dict):
                    raise ProtocolError(f"reply from {self.address} is not a map")
                if plen:
                    if into is None or into.nbytes != plen:
                        wire.discard(sock, plen)
                        raise ProtocolError(
                            f"unexpected reply payload of {plen} bytes from {self.address}"
                        )
                    wire.recv_into(sock, into)
            except TimeoutError:
                self._drop()
                raise StoreError(
                    f"tidal store at {self.address} did not answer {op.name!r} within "
                    f"{self.timeout:g} s; the next call reconnects"
                ) from None
            except (OSError, StoreError) as e:
                self._fail(op, e)
        if not reply.get("ok", False):
            cls = WIRE_ERRORS.get(str(reply.get("etype", "")), StoreError)
            raise cls(str(reply.get("error", "unknown error")))
        ops.check_reply(op, reply)
        return reply

    def _fail(self, op: ops.Op, e: BaseException) -> None:
        self._drop()
        if isinstance(e, wire.ConnectionClosed):
            raise StoreError(
                f"tidal store at {self.address} closed the connection during {op.name!r} "
                "(stopped, restarted, or it dropped this connection); the next call reconnects"
            ) from None
        if isinstance(e, StoreError):
            raise e
        raise StoreError(
            f"connection to tidal store at {self.address} failed during {op.name!r}: {e}; "
            "the next call reconnects"
        ) from None

    def _drop(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def close(self, graceful: bool = False) -> None:
        """Close for good; ``graceful`` first tells the server (which then drops this
        connection's leases and pending writes before answering)."""
        with self.lock:
            if graceful and self.sock is not None:
                try:
                    self.request(ops.BYE)
                except StoreError:
                    pass  # closing anyway; the server cleans up when it sees the socket close
            self._closed = True
            self._drop()


def _usable(sock: socket.socket) -> bool:
    """Whether an idle connection can carry a request: no reply is due on it, so anything
    readable (end of file, a reset, stray bytes) means the server dropped it."""
    poller = select.poll()  # not select.select: fds above 1023 are common in trainers
    poller.register(sock, select.POLLIN)
    return not poller.poll(0)


class Pool:
    """Connections to one volume's data port, borrowed one per transfer (TCP transport)."""

    def __init__(self, address: str, token: str | None, timeout: float) -> None:
        self.address, self._token, self._timeout = address, token, timeout
        self._idle: list[Conn] = []
        self._lock = threading.Lock()
        self._closed = False

    def borrow(self) -> Conn:
        with self._lock:
            if self._closed:
                raise StoreError("the store handle is closed")
            if self._idle:
                return self._idle.pop()
        return Conn(self.address, self._token, self._timeout)

    def give_back(self, conn: Conn, ok: bool) -> None:
        with self._lock:
            if ok and conn.connected and not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()
