"""A client connection: one socket, one request in flight at a time."""

from __future__ import annotations

import socket
import threading
from typing import Any

from tidal.store import wire
from tidal.store.errors import WIRE_ERRORS, ProtocolError, StoreError


class Conn:
    """A connection to a store server (controller and/or volume), after the hello exchange.

    ``request`` sends one message and waits for its reply; it raises the error the server
    named (from the fixed table ``errors.WIRE_ERRORS``) when the reply says ``ok: False``.
    Socket failures and timeouts raise StoreError naming the address.
    """

    def __init__(self, address: str, token: str | None, timeout: float) -> None:
        self.address = address
        host, port = wire.parse_address(address)
        self._lock = threading.Lock()
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise StoreError(f"cannot connect to tidal store at {address}: {e}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.info = self.request({"op": "hello", "token": token, "proto": wire.PROTOCOL_VERSION})

    def request(
        self,
        header: dict[str, Any],
        payload: memoryview | None = None,
        into: memoryview | None = None,
    ) -> dict[str, Any]:
        """Send ``header`` (+ payload); return the reply header. A reply payload is received
        into ``into``, which must be exactly its size."""
        with self._lock:
            try:
                wire.send(self.sock, header, payload)
                reply, plen = wire.recv_header(self.sock)
                if not isinstance(reply, dict):
                    raise ProtocolError(f"reply from {self.address} is not a map")
                if plen:
                    if into is None or into.nbytes != plen:
                        wire.discard(self.sock, plen)
                        raise ProtocolError(
                            f"unexpected reply payload of {plen} bytes from {self.address}"
                        )
                    wire.recv_into(self.sock, into)
            except TimeoutError:
                self.close()
                raise StoreError(
                    f"tidal store at {self.address} did not answer {header.get('op')!r} "
                    "within the timeout"
                ) from None
            except (OSError, StoreError) as e:
                self.close()
                if isinstance(e, StoreError):
                    raise
                raise StoreError(
                    f"connection to tidal store at {self.address} failed during "
                    f"{header.get('op')!r}: {e}"
                ) from None
        if not reply.get("ok", False):
            cls = WIRE_ERRORS.get(reply.get("etype", ""), StoreError)
            raise cls(str(reply.get("error", "unknown error")))
        return reply

    def close(self, graceful: bool = False) -> None:
        """Close the socket; ``graceful`` first tells the server (which then drops this
        connection's leases and pending writes before answering)."""
        if graceful and self.sock.fileno() >= 0:
            try:
                self.request({"op": "bye"})
            except StoreError:
                pass  # closing anyway; the server cleans up when it sees the socket close
        try:
            self.sock.close()
        except OSError:
            pass
