"""How the controller reaches the memory of each volume it hands slots in.

- :class:`LocalBackend`: the shared-memory volume of the controller's own process
  (``tidal store serve``, the embedded store): direct calls.
- :class:`RemoteBackend`: a volume process that registered itself
  (``tidal store volume``). The controller sends it ``registration`` ops (tidal/store/ops.py)
  over the very connection the volume opened to register, and nowhere else; the volume
  serves them on that connection only. The connection closing means the volume is gone.
- :class:`DeviceBackend`: a writer's GPU memory (``put(..., memory="cuda")``). The writer
  allocates its slots itself; destroyed slots are handed back to it in its next reply.

Lifecycle of a remote backend: the server thread that received ``register_volume`` builds
it, hands the socket over to it and becomes its monitor (:meth:`RemoteBackend.monitor`),
returning when the volume's connection closes; the controller then forgets the volume.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator
from typing import Any

from tidal.store import ops, wire
from tidal.store.errors import WIRE_ERRORS, ProtocolError, StoreError
from tidal.store.volume import Volume


class LocalBackend:
    def __init__(self, volume: Volume) -> None:
        self.volume = volume

    def create(self, segments: list[tuple[int, int]]) -> None:
        for slot, nbytes in segments:
            self.volume.create(slot, nbytes)

    def destroy(self, slots: list[int]) -> None:
        self.volume.destroy(slots)

    def grant(self, slots: list[int], grant: bytes) -> None:
        self.volume.grant(slots, grant)

    def seal(self, slots: list[int]) -> None:
        self.volume.seal(slots)

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        """The server closes its volume itself."""


class DeviceBackend:
    """A writer's GPU memory: nothing to call; destroyed slots wait in ``freed`` for the
    owner's next put (see tidal/store/transports/cuda/ipc.py)."""

    def __init__(self) -> None:
        self.freed: list[int] = []

    def create(self, segments: list[tuple[int, int]]) -> None:
        """The owner allocates when it writes."""

    def destroy(self, slots: list[int]) -> None:
        self.freed.extend(slots)

    def grant(self, slots: list[int], grant: bytes) -> None:
        """Only the owner writes its memory."""

    def seal(self, slots: list[int]) -> None:
        """Only the owner writes its memory."""

    def alive(self) -> bool:
        return True  # its death is its owner connection's close

    def close(self) -> None:
        """Nothing held here."""


class RemoteBackend:
    """Requests to a registered volume process over its registration connection.

    ``destroy`` is queued, not waited for: the controller calls it holding its lock, which a
    stopped or hostile volume must not hold up for everyone (a ``delete`` stalled every
    client for the whole timeout). A thread of the backend sends the queue, and every other
    request sends it first, so a create never runs ahead of the memory a destroy frees.
    """

    def __init__(self, sock: socket.socket, volume_id: str, timeout: float = 30.0) -> None:
        self.sock = sock
        self.volume_id = volume_id
        self.timeout = timeout
        self._lock = threading.Lock()  # the connection: one request at a time
        self._dead = False
        self._queue = threading.Condition()  # guards _doomed and _sender
        self._doomed: list[int] = []  # slots to destroy, not yet sent
        self._sender: threading.Thread | None = None

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Keep the controller's requests off the connection for the block (its owner is
        still sending the registration's reply)."""
        with self._lock:
            yield

    def _call(self, op: ops.Op, **fields: Any) -> None:
        with self._lock:
            self._send_doomed()
            reply = self._exchange(op, fields)
        _check(self.volume_id, reply)

    def _exchange(self, op: ops.Op, fields: dict[str, Any]) -> dict[str, Any]:
        """One request and its reply (``_lock`` held); StoreError, and the volume counts as
        dead, if it does not answer in time."""
        if self._dead:
            raise StoreError(f"volume {self.volume_id!r} is gone")
        try:
            self.sock.settimeout(self.timeout)
            wire.send(self.sock, ops.request(op, **fields))
            reply, plen = wire.recv_header(self.sock, max_header=1 << 20, max_payload=0)
            if not isinstance(reply, dict):
                raise ProtocolError(f"volume {self.volume_id!r} sent a reply that is no map")
        except (OSError, StoreError) as e:
            self._dead = True
            raise StoreError(f"volume {self.volume_id!r} did not answer {op.name!r}: {e}") from None
        return reply

    def _send_doomed(self) -> None:
        """Send the queued destroys (``_lock`` held). The volume's refusal of one is no
        caller's business: the slots are gone from the controller either way."""
        with self._queue:
            slots, self._doomed = self._doomed, []
        if slots:
            self._exchange(ops.VOL_DESTROY, {"slots": slots})

    def _sender_loop(self) -> None:
        while True:
            with self._queue:
                while not self._doomed and not self._dead:
                    self._queue.wait()
                if self._dead:
                    return
            try:
                with self._lock:
                    self._send_doomed()
            except StoreError:
                return  # the volume is dead; the controller finds out and forgets it

    def create(self, segments: list[tuple[int, int]]) -> None:
        self._call(ops.VOL_CREATE, segments=[{"slot": s, "nbytes": n} for s, n in segments])

    def destroy(self, slots: list[int]) -> None:
        """Queue the slots' destruction (see the class docstring); returns at once."""
        with self._queue:
            if self._dead or not slots:
                return
            self._doomed.extend(slots)
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._sender_loop,
                    name=f"tidal-store-destroy-{self.volume_id}",
                    daemon=True,
                )
                self._sender.start()
            self._queue.notify()

    def grant(self, slots: list[int], grant: bytes) -> None:
        self._call(ops.VOL_GRANT, slots=slots, grant=grant)

    def seal(self, slots: list[int]) -> None:
        self._call(ops.VOL_SEAL, slots=slots)

    def alive(self) -> bool:
        if self._dead:
            return False
        if not self._lock.acquire(blocking=False):
            return True  # a request is in flight: it finds out itself
        try:
            return self._peek_alive()
        finally:
            self._lock.release()

    def _peek_alive(self) -> bool:
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if not readable:
                return True
            # Bytes nobody asked for, or EOF: either way the volume is not following the
            # protocol any more.
            self._dead = True
            return False
        except (OSError, ValueError):
            self._dead = True
            return False

    def monitor(self, closing: threading.Event, every: float = 0.5) -> None:
        """Return once the volume's connection is closed (or the server is closing)."""
        while not closing.is_set() and not self._dead:
            try:
                readable, _, _ = select.select([self.sock], [], [], every)
            except (OSError, ValueError):
                break
            if readable and self._lock.acquire(timeout=every):
                try:
                    self._peek_alive()
                finally:
                    self._lock.release()

    def close(self) -> None:
        self._dead = True
        with self._queue:
            self._queue.notify()  # the sender thread leaves
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


def _check(volume_id: str, reply: dict[str, Any]) -> None:
    """Raise the error a volume's reply names (from the fixed table), if it is one."""
    if not reply.get("ok", False):
        cls = WIRE_ERRORS.get(str(reply.get("etype", "")), StoreError)
        raise cls(f"volume {volume_id!r}: {reply.get('error', 'unknown error')}")
