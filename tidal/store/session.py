"""What one store handle holds: its connections, its transports and its caches.

Connections, each with one job so that no request waits behind another kind:
- ``main``: queries, ``acquire`` / ``release`` of copying reads, handle lookups;
- ``writer``: puts, held for a whole put (``put_begin`` is pipelined with the copies into
  reserved slots); it owns the put plans and the handle's device volume;
- ``waiter``: requests that block (streaming reads and waits for a version), one per
  thread: a thread waiting for one version never holds up another thread's wait (an RL
  generator's prefetch thread waits for the next policy while its loop waits for a queue
  slot);
- ``views``: the leases of zero-copy views, kept open past ``close()`` while views live.

Each reconnects on its next call after a failure (tidal/store/conn.py); the writer's put
plans and device volume are made again on a new connection.

Lifecycle: ``Store.__init__`` makes a :class:`Session` (the main connection at once, the
others on first use); ``Store.close()`` closes it.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable
from typing import Any, Literal

from tidal.store import ops, wire
from tidal.store.conn import Conn
from tidal.store.errors import StoreError
from tidal.store.ops import VolumeInfo
from tidal.store.segments import Segments
from tidal.store.transports import Transport
from tidal.store.transports.cuda.ipc import CudaIpcTransport
from tidal.store.transports.shm import ShmTransport
from tidal.store.transports.tcp import TcpTransport

TransportChoice = Literal["auto", "shm", "tcp", "nixl"]


class Session:
    def __init__(
        self,
        address: str,
        *,
        token: str | None,
        timeout: float,
        transport: TransportChoice,
        volume: str | None,
        connections: int,
    ) -> None:
        if transport == "nixl":  # one clear error now, before connecting, if not installed
            from tidal.store.transports import nixl

            nixl.load()
        self.address = address
        self.token = token
        self.timeout = timeout
        self.transport = transport
        self.volume = volume
        self.host = wire.host_id()
        self.writer = f"{self.host}:{os.getpid()}:{secrets.token_hex(4)}"
        self.main = Conn(address, token, timeout)
        self._conns: dict[str, Conn] = {}
        self._waiters: dict[int, Conn] = {}  # thread ident -> its waiter connection
        self._lock = threading.Lock()
        self.segments = Segments()
        self.shm = ShmTransport(self.host, self.segments)
        self.tcp = TcpTransport(token, timeout, connections)
        self._cuda: CudaIpcTransport | None = None
        self._nixl: Transport | None = None
        self._nixl_missing = False  # auto: NIXL is not installed here
        self.closed = False
        self.hook: Callable[[str, ops.Op, dict[str, Any]], None] | None = None  # testing

    def set_hook(self, hook: Callable[[str, ops.Op, dict[str, Any]], None] | None) -> None:
        """Call ``hook(connection name, op, fields)`` before every request of this handle's
        control connections (tidal.store.testing)."""
        with self._lock:
            self.hook = hook
            waiters = [("waiter", c) for c in self._waiters.values()]
            for name, conn in [("main", self.main), *self._conns.items(), *waiters]:
                self._hook(name, conn)

    def _hook(self, name: str, conn: Conn) -> None:
        hook = self.hook
        conn.hook = None if hook is None else (lambda op, f: hook(name, op, f))

    def _conn(self, name: str) -> Conn:
        with self._lock:
            if name != "views":
                self.check_open()
            conn = self._conns.get(name)
            if conn is None:
                conn = self._conns[name] = Conn(self.address, self.token, self.timeout)
                self._hook(name, conn)
            return conn

    def writer_conn(self) -> Conn:
        return self._conn("writer")

    def waiter(self) -> Conn:
        """The calling thread's connection for blocking requests (made at its first wait,
        when those of threads that have ended are closed)."""
        ident = threading.get_ident()
        ended: list[Conn] = []
        with self._lock:
            self.check_open()
            conn = self._waiters.get(ident)
            if conn is None:
                live = {t.ident for t in threading.enumerate()}
                ended = [self._waiters.pop(i) for i in list(self._waiters) if i not in live]
                conn = self._waiters[ident] = Conn(self.address, self.token, self.timeout)
                self._hook("waiter", conn)
        for old in ended:
            old.close(graceful=True)
        return conn

    def views_conn(self) -> Conn:
        return self._conn("views")

    def existing(self, name: str) -> Conn | None:
        """The connection ``name`` if it was made (and not closed for good)."""
        with self._lock:
            return self._conns.get(name)

    def check_open(self) -> None:
        if self.closed:
            raise StoreError("this store handle is closed (store.close() was called)")

    def cuda(self) -> CudaIpcTransport:
        with self._lock:
            if self._cuda is None:
                self._cuda = CudaIpcTransport(self.host, self.writer_conn, self.main, self.timeout)
            return self._cuda

    def nixl(self) -> Transport:
        """This handle's NIXL transport (tidal/store/transports/nixl.py), made at first use;
        StoreError if NIXL is not installed. With ``transport='auto'`` a volume whose NIXL
        cannot be set up is read over TCP instead."""
        from tidal.store.transports.nixl import NixlTransport

        with self._lock:
            if self._nixl is None:
                self._nixl = NixlTransport(
                    self.tcp.call,
                    lambda vol: self.shm if self.shm.reaches(vol) else self.tcp,
                    self.timeout,
                    fallback=self.tcp if self.transport == "auto" else None,
                )
            return self._nixl

    def _nixl_for_auto(self) -> Transport | None:
        """NIXL for a volume on another host with ``transport='auto'``, if installed and
        this machine has an RDMA device (``nixl.has_rdma``: over plain TCP, UCX is slower
        than the TCP transport)."""
        if self._nixl_missing:
            return None
        from tidal.store.transports import nixl

        if not nixl.has_rdma() or not nixl.available():
            self._nixl_missing = True
            return None
        return self.nixl()

    def put_volume(self, memory: str) -> str | None:
        """The volume a put with ``memory=`` names: this handle's device volume for
        "cuda", else the one ``connect(volume=)`` chose (None: the controller picks)."""
        return self.cuda().volume_id() if memory == "cuda" else self.volume

    def transport_for(self, vol: VolumeInfo, slot: int | None = None) -> Transport:
        """The transport to ``vol``: CUDA IPC for device memory, shared memory when the
        volume is on this host (unless ``transport='tcp'`` or ``'nixl'``), else NIXL when
        installed, else TCP; ``'nixl'`` reads every shared-memory volume by NIXL."""
        if vol.kind == "cuda":
            return self.cuda()
        if self.transport == "tcp":
            return self.tcp
        if self.transport == "nixl":
            return self.nixl()
        if self.shm.reaches(vol):
            if self.transport == "shm" and slot is not None:
                self.shm.check(vol, slot)
            return self.shm
        if self.transport == "shm":
            raise StoreError(
                f"transport='shm' but the segments of volume {vol.id!r} are not on this host"
            )
        return self._nixl_for_auto() or self.tcp

    def close(self, keep_views: bool) -> None:
        """Close connections and transports; ``keep_views``: zero-copy views are alive and
        hold leases on the views connection (their last release closes it)."""
        with self._lock:
            self.closed = True
            conns = {n: c for n, c in self._conns.items() if not (keep_views and n == "views")}
            waiters = list(self._waiters.values())
        for name, conn in conns.items():
            conn.close(graceful=name == "writer")
        for conn in waiters:
            conn.close(graceful=True)
        # The controller drops this writer's device volume when the writer connection goes;
        # after that the device memory can be freed.
        self.main.close(graceful=True)
        if self._cuda is not None:
            self._cuda.close()
        if self._nixl is not None:
            self._nixl.close()
        self.tcp.close()
        self.shm.close()

    def close_views(self) -> None:
        with self._lock:
            conn = self._conns.pop("views", None)
        if conn is not None:
            conn.close()
