"""A standalone volume process: ``tidal store volume --controller tcp://...``.

Lifecycle: :func:`run_volume` creates the volume (its shared-memory segments live under
``shm_dir``), serves its data path (``vol_write`` / ``vol_read``) on a port of its own,
connects to the controller and registers. From then on that connection carries the
controller's ``registration`` ops (create, destroy, grant, seal; tidal/store/ops.py), which
this process serves on that connection only, until the controller closes it; then the
process frees its segments and returns. Segments left by a killed volume process are removed
by the next store or volume started on the host (``reap_stale``).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from tidal.store import ops, wire
from tidal.store.conn import Conn
from tidal.store.errors import WIRE_ERRORS, ProtocolError, StoreError
from tidal.store.server import Server
from tidal.store.volume import Volume, new_store_id, reap_stale

_USER_ERRORS = tuple(WIRE_ERRORS.values())


def run_volume(
    controller_address: str,
    volume_id: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    shm_dir: str = "/dev/shm",
    capacity: int | None = None,
    reserve: int = 0,
    pool: int = 0,
    numa_node: int | str | None = "auto",
    ready: Callable[[str], None] | None = None,
    timeout: float = 30.0,
) -> None:
    """Serve a volume and register it with a controller; return when the controller goes.

    ``ready``, if given, is called with the volume server's address once registered.

    Raises:
        ValueError: a bad volume id or a missing / unwritable ``shm_dir``.
        StoreError: the controller cannot be reached or refuses the volume.
    """
    reap_stale(shm_dir)
    vol = Volume(
        volume_id,
        new_store_id(),
        shm_dir=shm_dir,
        capacity=capacity,
        reserve=reserve,
        pool=pool,
        numa_node=numa_node,
    )
    try:
        server = Server(volume=vol, host=host, port=port, token=token)
    except BaseException:
        vol.close()  # its reserve and pool files, and the pool's thread
        raise
    try:
        reg = Conn(controller_address, token, timeout)
        try:
            reg.request(
                ops.REGISTER_VOLUME,
                volume_id=volume_id,
                address=server.address,
                host=server.host_id,
                shm_dir=vol.shm_dir,
                store_id=vol.store_id,
            )
            if ready is not None:
                ready(server.address)
            assert reg.sock is not None, "registered on a live connection"
            serve_registration(reg.sock, vol)
        finally:
            reg.close()
    finally:
        server.close()


def _create(vol: Volume, m: dict[str, Any]) -> None:
    for seg in m["segments"]:
        vol.create(seg["slot"], seg["nbytes"])


# op name -> handler(volume, request) for every op ops.py declares served by "registration"
_REGISTRATION_OPS: dict[str, Callable[[Volume, dict[str, Any]], None]] = {
    "vol_create": _create,
    "vol_destroy": lambda vol, m: vol.destroy(m["slots"]),
    "vol_grant": lambda vol, m: vol.grant(m["slots"], m["grant"]),
    "vol_seal": lambda vol, m: vol.seal(m["slots"]),
}
assert set(_REGISTRATION_OPS) == {n for n, o in ops.OPS.items() if o.served_by == "registration"}


def serve_registration(sock: socket.socket, vol: Volume) -> None:
    """Serve the controller's registration ops on ``sock`` until it closes."""
    sock.settimeout(None)
    wire.keep_alive(sock)  # a controller whose host died sends no FIN: probes find it gone
    while True:
        try:
            header, plen = wire.recv_header(sock, max_payload=0)
            op = ops.check_request(header, plen)
            if op.served_by != "registration":
                raise ProtocolError(f"op {op.name!r} is not a registration op")
        except (wire.ConnectionClosed, OSError, StoreError):
            return  # the controller went away (or broke the protocol): leave
        try:
            _REGISTRATION_OPS[op.name](vol, header)
            reply: dict[str, object] = {"ok": True}
        except _USER_ERRORS as e:
            reply = {"ok": False, "etype": type(e).__name__, "error": str(e)}
        try:
            wire.send(sock, reply)
        except OSError:
            return
