"""The embedded store: a controller and one shared-memory volume inside the calling process.

``tidal.store.connect()`` with no address starts one: a :class:`~tidal.store.server.Server`
on a random loopback port, serving from background threads, that lives until the handle that
started it is closed (or the process exits). Other processes reach it at ``store.address``.

Lifecycle: :func:`start` first removes segments that stores of killed processes left in
``/dev/shm`` (``reap_stale``), then makes the volume, the controller and the server; the
handle's ``close()`` closes the server, which unlinks the volume's segments.
"""

from __future__ import annotations

import weakref

from tidal.store.controller import Controller
from tidal.store.server import Server
from tidal.store.volume import Volume, new_store_id, reap_stale


def start(*, keep: int, token: str | None, reserve: int | list[int] = 0) -> Server:
    """An embedded server (controller + volume "v0", with ``reserve`` bytes allocated ahead)
    on a random loopback port."""
    reap_stale()
    store_id = new_store_id()
    volume = Volume("v0", store_id, reserve=reserve)
    server = Server(controller=Controller(store_id, keep=keep), volume=volume, token=token)
    weakref.finalize(server, server.close)
    return server
