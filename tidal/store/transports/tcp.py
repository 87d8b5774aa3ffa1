"""TCP to a volume's data port: works between any two hosts.

A write sends ``vol_write`` messages (with the grant the controller issued for the pending
version) and a read ``vol_read`` messages, in pieces of ``PIECE`` bytes spread over up to
``connections`` connections in parallel; a piece received for a contiguous CPU destination
of the stored dtype lands straight in it (``recv_into``), others go through a buffer.
benchmarks/store_tcp.py measures it against a plain socket.

Lifecycle: a store handle's :class:`TcpTransport` keeps a pool of connections per volume
address (tidal/store/conn.py ``Pool``) and a thread pool for the fan-out, both made on first
use and closed at ``close``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from tidal.store import boxes, ops
from tidal.store.conn import Pool
from tidal.store.ops import VolumeInfo
from tidal.store.progress import Progress
from tidal.store.transports import Gate, ReadJob, Transport, WriteJob

PIECE = 16 << 20  # bytes per message: split so that pieces spread over the connections
T = TypeVar("T")


class TcpTransport(Transport):
    def __init__(self, token: str | None, timeout: float, connections: int) -> None:
        self._token, self._timeout, self._connections = token, timeout, connections
        self._pools: dict[str, Pool] = {}
        self._io: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _pool(self, address: str) -> Pool:
        with self._lock:
            pool = self._pools.get(address)
            if pool is None:
                pool = self._pools[address] = Pool(address, self._token, self._timeout)
            return pool

    def call(self, address: str, op: ops.Op, **kw: Any) -> dict[str, Any]:
        """One request to the volume at ``address`` on a pooled connection."""
        return self._call(address, op, **kw)

    def _call(self, address: str, op: ops.Op, **kw: Any) -> dict[str, Any]:
        pool = self._pool(address)
        conn = pool.borrow()
        ok = False
        try:
            reply = conn.request(op, **kw)
            ok = True
            return reply
        finally:
            pool.give_back(conn, ok)

    def write(
        self, vol: VolumeInfo, jobs: list[WriteJob], progress: Progress, grant: bytes
    ) -> None:
        pieces = []
        for job in jobs:
            src = job.src.detach()
            if src.dtype != job.dtype:
                src = src.to(job.dtype)
            flat = src.cpu().contiguous().reshape(-1).view(torch.uint8)
            for start in range(0, flat.numel(), PIECE):
                pieces.append((job.slot, start, flat[start : start + PIECE]))

        def send(piece: tuple[int, int, torch.Tensor]) -> None:
            slot, start, buf = piece
            self._call(
                vol.address,
                ops.VOL_WRITE,
                payload=buf.numpy().data,
                slot=slot,
                offset=start,
                nbytes=buf.numel(),
                grant=grant,
            )

        self._fan_out(send, pieces)
        for job in jobs:
            progress.add(job.slot, job.nbytes)

    def read(self, vol: VolumeInfo, jobs: list[ReadJob], gate: Gate | None) -> None:
        if gate is not None:
            for job in jobs:
                gate(job.slot)
        pieces = []
        for job in jobs:
            row = boxes.numel(job.sizes[1:]) * job.dtype.itemsize
            if job.sizes and row and job.sizes[0] * row > PIECE:
                step = max(1, PIECE // row)
                for r in range(0, job.sizes[0], step):
                    k = min(step, job.sizes[0] - r)
                    pieces.append(
                        ReadJob(
                            job.slot,
                            job.shard_shape,
                            job.dtype,
                            (job.src_off[0] + r, *job.src_off[1:]),
                            (k, *job.sizes[1:]),
                            job.dst.narrow(0, r, k),
                        )
                    )
            else:
                pieces.append(job)

        def fetch(job: ReadJob) -> None:
            dst = job.dst
            direct = dst.is_contiguous() and dst.device.type == "cpu" and dst.dtype == job.dtype
            buf = dst if direct else torch.empty(job.sizes, dtype=job.dtype)
            into = buf.reshape(-1).view(torch.uint8).numpy().data
            self._call(
                vol.address,
                ops.VOL_READ,
                into=into,
                slot=job.slot,
                shape=list(job.shard_shape),
                itemsize=job.dtype.itemsize,
                offsets=list(job.src_off),
                sizes=list(job.sizes),
            )
            if not direct:
                with torch.no_grad():
                    dst.copy_(buf)

        self._fan_out(fetch, pieces)

    def _fan_out(self, fn: Callable[[T], None], pieces: Iterable[T]) -> None:
        pieces = list(pieces)
        if len(pieces) <= 1 or self._connections == 1:
            for p in pieces:
                fn(p)
            return
        with self._lock:
            if self._io is None:
                self._io = ThreadPoolExecutor(self._connections, thread_name_prefix="tidal-io")
        for f in [self._io.submit(fn, p) for p in pieces]:
            f.result()

    def close(self) -> None:
        with self._lock:
            io, self._io = self._io, None
            pools, self._pools = list(self._pools.values()), {}
        if io is not None:
            io.shutdown(wait=True)
        for pool in pools:
            pool.close()
