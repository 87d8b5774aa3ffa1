"""The one seam tests reach through below the public API (not for production code).

Everything a test needs to look at or steer inside a store handle or an embedded store
goes through these functions, so the internals can change without touching the tests:

- :func:`controller`: the embedded store's controller (counts, waiting readers);
- :func:`reserved`: bytes left in the embedded store's reserve;
- :func:`raw`: a fresh authenticated connection, to send ops by hand as another client or a
  hostile one would;
- :func:`on_request`: watch (or hold up) the requests a handle sends;
- :func:`write_slot` / :func:`read_slot` / :func:`slot_path`: a shared-memory slot's bytes
  and file, as a same-host writer or reader sees them;
- :func:`mapped_segments`, :func:`pinned_segments`, :func:`device_allocations`,
  :func:`connection_open`: what a handle holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tidal.store import ops
from tidal.store.client import Store
from tidal.store.conn import Conn
from tidal.store.controller import Controller
from tidal.store.server import Server
from tidal.store.transports.shm import path_of
from tidal.store.volume import as_bytes, map_segment


def _embedded(store: Store) -> Server:
    """The server of the embedded store ``store`` started."""
    if store._server is None:
        raise ValueError("this handle did not start an embedded store")
    return store._server


def controller(store: Store) -> Controller:
    """The controller of the embedded store ``store`` started."""
    server = _embedded(store)
    if server.controller is None:
        raise ValueError("this handle did not start an embedded store")
    return server.controller


def leases(store: Store) -> int:
    """Leases held on the embedded store ``store`` started."""
    return controller(store).counts()["leases"]


def reserved(store: Store) -> int:
    """Bytes in the reserve of the embedded store ``store`` started (tidal/store/reserve.py)."""
    volume = _embedded(store).volume
    if volume is None:
        raise ValueError("this handle's embedded store runs no volume")
    return volume.reserved


def readers_waiting(store: Store, key: str, version: int) -> bool:
    """Whether a streaming reader of the embedded store waits for that version."""
    return controller(store).readers_waiting(key, version)


def raw(address: str, token: str | None = None, timeout: float = 30.0) -> Conn:
    """A new connection to the store at ``address``, after hello."""
    return Conn(address, token, timeout)


def writer_name(store: Store) -> str:
    """The writer name ``store``'s puts use."""
    return store._s.writer


def host(store: Store) -> str:
    return store._s.host


def on_request(store: Store, hook: Callable[[str, ops.Op, dict[str, Any]], None] | None) -> None:
    """Call ``hook(connection, op, fields)`` before each request ``store`` sends on its
    control connections ("main", "writer", "waiter", "views"); None removes it."""
    store._s.set_hook(hook)


def slot_path(volume: dict[str, Any], slot: int) -> str:
    """The segment file of ``slot`` in the shared-memory volume ``volume`` (an
    ``ops.s_volume`` record of a raw reply, as ``put_declare`` or ``acquire`` returns it)."""
    return path_of(ops.VolumeInfo.decode(volume), slot)


def write_slot(volume: dict[str, Any], slot: int, data: torch.Tensor) -> None:
    """Copy ``data``'s bytes into ``slot`` of the shared-memory volume ``volume`` (an
    ``ops.s_volume`` record, as ``put_declare`` returns it)."""
    flat = data.contiguous().reshape(-1).view(torch.uint8)
    seg = as_bytes(map_segment(slot_path(volume, slot), flat.numel()))
    seg.copy_(flat)


def reads_bound(store: Store) -> int:
    """Reads ``store`` checked and planned against their destination tensors; a steady
    reader into the same tensors makes one (tidal/store/reader.py ``BoundRead``)."""
    return store._reader.reads_bound


def mapped_segments(store: Store) -> int:
    """Shared-memory segments ``store`` has mapped."""
    return len(store._s.segments)


def pinned_segments(store: Store) -> int:
    """Shared-memory segments ``store`` has registered with CUDA (device copies as DMA)."""
    return store._s.segments.pinned()


def device_allocations(store: Store) -> int:
    """GPU allocations of ``store``'s device volume (``memory="cuda"`` puts)."""
    cuda = store._s._cuda
    return 0 if cuda is None else cuda.allocations()


def connection_open(store: Store, name: str) -> bool:
    """Whether ``store``'s connection ``name`` is open."""
    conn = store._s.existing(name)
    return conn is not None and conn.connected


def read_slot(volume: dict[str, Any], slot: int, out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` with the bytes ``slot`` of the shared-memory volume holds."""
    flat = out.view(-1).view(torch.uint8)
    flat.copy_(as_bytes(map_segment(slot_path(volume, slot), flat.numel())))
    return out
