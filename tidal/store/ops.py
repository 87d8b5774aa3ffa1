"""Every message of the tidal.store protocol, declared once.

An :class:`Op` names its request fields and its reply fields (named maps, never positional
lists), which process serves it and whether it carries bulk bytes. Servers dispatch by op
name from tables built against it (``Server._build_handlers``: the controller's method for
the op, or the volume's data ops; ``standalone._REGISTRATION_OPS`` on a volume's
registration connection), the
client builds every request with :func:`request` and both check what they receive against it
(:func:`check_request`, :func:`check_reply`). Nothing else in the store spells out a message.

Who serves what:
- ``controller``: metadata ops, on the controller's port (``tidal store serve`` or the
  embedded store). Any client that passed ``hello`` may send them; ops on a version or a
  device volume are further checked against the connection that owns it.
- ``volume``: the data path of a shared-memory volume over TCP (``vol_write`` / ``vol_read``,
  and ``vol_nixl``, which describes slots for NIXL reads),
  on the port of the process that holds the memory. A write needs the grant the controller
  issued for that slot, which no committed slot has.
- ``registration``: the controller's requests to a standalone volume process, sent over the
  connection that process opened to register itself and served on that connection only.
  No port serves them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tidal.store import wire
from tidal.store.errors import ProtocolError
from tidal.store.wire import (
    Checker,
    s_any_of,
    s_bool,
    s_bytes,
    s_enum,
    s_int,
    s_list,
    s_map,
    s_opt,
    s_str,
    s_value,
)

Server = Literal["controller", "volume", "registration"]

MAX_DIMS = 64
MAX_ITEMS = 1 << 20
GRANT_BYTES = 16  # a write grant: random bytes the controller issues per pending version
HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


@dataclass(frozen=True, slots=True)
class Op:
    """One message type: its request, its reply, and where it is served."""

    name: str
    served_by: Server
    request: Mapping[str, Checker]
    reply: Mapping[str, Checker] = field(default_factory=dict)
    optional: frozenset[str] = frozenset()  # reply fields that may be left out
    payload: bool = False  # the request carries bulk bytes
    reply_payload: bool = False  # the reply carries bulk bytes
    # The request names state of the connection it travels on (a lease, a put plan, a
    # pending write, a device volume): a client never resends it on a new connection.
    bound: bool = False
    doc: str = ""


def _ident(max_len: int = 64) -> Checker:
    """A name the store builds file names from: [A-Za-z0-9_.-], never '.' or '..'."""
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")

    def check(v: Any, f: str) -> None:
        if (
            not isinstance(v, str)
            or not 1 <= len(v) <= max_len
            or not set(v) <= allowed
            or v in (".", "..")
        ):
            wire._fail(f, f"1-{max_len} characters of [A-Za-z0-9_.-]", v)

    return check


s_key = s_str(1024)
s_writer = s_str(256)
s_volume_id = _ident(96)
s_host = s_str(512)
s_version = s_int(0, 1 << 62)
s_slot = s_int(1, 1 << 62)
s_slots = wire.s_ints(1, 1 << 62, MAX_ITEMS)
s_slots_or_none = wire.s_ints(1, 1 << 62, MAX_ITEMS, none=True)  # None: no bytes to move
s_dims = wire.s_ints(0, 1 << 62, MAX_DIMS)
s_path = s_list(s_any_of(s_str(1024), s_int(0, 1 << 31)), 256)  # a state-dict path
s_grant = s_bytes(GRANT_BYTES)
# A device slot: its GPU, the IPC handle of the allocation it was carved from, its offset
# there and the allocation's size (``span``), and the IPC handle of the event recorded after
# each put's copies on that GPU (tidal/store/transports/cuda/ipc.py).
s_handle = s_map(
    {
        "slot": s_slot,
        "uuid": s_str(128),
        "handle": s_bytes(HANDLE_BYTES),
        "offset": s_int(0, 1 << 62),
        "span": s_int(1, 1 << 62),
        "event": s_bytes(HANDLE_BYTES),
    }
)
# Where a volume's bytes are. shm volumes: segments ``<shm_dir>/tidal-<store_id>-<id>-<slot>``
# (and ``.<part>`` files for slots over volume.PART_BYTES) readable on ``host``, and
# ``address`` for TCP; cuda volumes: a writer's GPU memory.
s_volume = s_map(
    {
        "id": s_volume_id,
        "kind": s_enum("shm", "cuda"),
        "host": s_host,
        "address": s_str(512),
        "shm_dir": s_str(1024),
        "store_id": s_str(96),
    }
)


@dataclass(frozen=True, slots=True)
class VolumeInfo:
    """A volume as a client sees it: an ``s_volume`` record, decoded once from the reply
    that carried it (``put_declare``, ``acquire``) and passed to the transports as is."""

    id: str
    kind: Literal["shm", "cuda"]  # host shared memory, or a writer's GPU memory
    host: str  # hostname + boot id of the machine holding the bytes
    address: str  # tcp://host:port of a shm volume's data path ("" for cuda)
    shm_dir: str  # where a shm volume's segments are, on ``host``
    store_id: str  # the store the segment names belong to

    @classmethod
    def decode(cls, record: dict[str, Any]) -> VolumeInfo:
        """The record of a reply field checked against ``s_volume``."""
        return cls(
            record["id"],
            record["kind"],
            record["host"],
            record["address"],
            record["shm_dir"],
            record["store_id"],
        )


s_decl = s_map(
    {
        "name": s_path,
        "shape": s_dims,
        "dtype": wire.s_enum(*wire.DTYPES),
        "offsets": s_dims,
        "sizes": s_dims,
    }
)
s_meta = s_map(
    {
        "name": s_path,
        "shape": s_dims,
        "dtype": wire.s_enum(*wire.DTYPES),
        "boxes": s_list(s_map({"offsets": s_dims, "sizes": s_dims}), MAX_ITEMS),
    }
)
s_object = s_map({"name": s_path, "value": s_value()})
s_reservation = s_map(
    {"id": s_int(1, 1 << 62), "slots": s_slots_or_none, "fresh": s_slots, "grant": s_grant}
)

OPS: dict[str, Op] = {}


def _op(name: str, served_by: Server, request: dict[str, Checker], reply=None, **kw: Any) -> Op:
    op = Op(name, served_by, request, reply or {}, **kw)
    OPS[name] = op
    return op


# -- session ------------------------------------------------------------------------------
HELLO = _op(
    "hello",
    "controller",
    {"token": s_opt(s_str(1024)), "proto": s_int(0, 1 << 16)},
    {"host": s_host, "proto": s_int(0, 1 << 16)},
    doc="the first message of every connection: the token and the protocol version",
)
BYE = _op("bye", "controller", {}, doc="a graceful close: leases and pending writes go first")

# -- writes -------------------------------------------------------------------------------
PUT_DECLARE = _op(
    "put_declare",
    "controller",
    {
        "key": s_key,
        "kind": s_enum("tensor", "state_dict"),
        "writers": s_int(1, 1 << 20),
        "keep": s_opt(s_int(1, 1 << 20)),
        "host": s_host,
        "volume": s_opt(s_volume_id),
        "tensors": s_list(s_decl, MAX_ITEMS),
    },
    {"plan": s_int(1, 1 << 62), "volume": s_volume},
    doc="a writer's layout of one key (tensors, shapes, boxes), checked once and kept by "
    "the controller as a put plan of this connection",
)
PUT_BEGIN = _op(
    "put_begin",
    "controller",
    {
        "key": s_key,
        "plan": s_int(1, 1 << 62),
        "version": s_opt(s_version),
        "writer": s_writer,
        "reservation": s_opt(s_int(1, 1 << 62)),
        "objects": s_list(s_object, 1 << 16),
    },
    {
        "version": s_version,
        "slots": s_slots_or_none,
        "fresh": s_slots,
        "grant": s_grant,
        "report": s_bool,
        "freed": s_slots,
    },
    bound=True,
    doc="start writing a version of a plan: slots per tensor (None: nothing to write, an "
    "empty shard or a replica another writer stores), the slots new to the volume (never "
    "written: a device volume's owner allocates them, a shared-memory writer fills them "
    "with pwrite), and whether a reader waits for progress reports",
)
PUT_PROGRESS = _op(
    "put_progress",
    "controller",
    {"key": s_key, "version": s_version, "writer": s_writer, "slots": s_slots},
    bound=True,
    doc="these slots of a pending version are written (for streaming readers)",
)
PUT_COMMIT = _op(
    "put_commit",
    "controller",
    {"key": s_key, "version": s_version, "writer": s_writer, "reserve": s_bool},
    {"visible": s_bool, "next": s_opt(s_reservation), "freed": s_slots},
    bound=True,
    doc="a writer's bytes are all in place; with reserve, slots for its next put come back",
)
PUT_ABORT = _op(
    "put_abort",
    "controller",
    {"key": s_key, "version": s_version, "writer": s_writer},
    bound=True,
    doc="drop a pending version this connection began",
)
DEVICE_VOLUME = _op(
    "device_volume",
    "controller",
    {"volume_id": s_volume_id, "host": s_host},
    doc="register this connection's GPU memory as a volume that dies with the connection",
)
PUT_HANDLES = _op(
    "put_handles",
    "controller",
    {"volume_id": s_volume_id, "handles": s_list(s_handle, MAX_ITEMS)},
    bound=True,
    doc="CUDA IPC handles of slots the owner of a device volume allocated",
)

# -- reads --------------------------------------------------------------------------------
ACQUIRE = _op(
    "acquire",
    "controller",
    {
        "key": s_key,
        "version": s_any_of(s_version, s_enum("latest")),
        "known_sig": s_opt(s_str(128)),
        "wait_ms": s_opt(s_int(0, 1 << 31)),
    },
    {
        "waiting": s_bool,
        "version": s_version,
        "lease": s_int(1, 1 << 62),
        "kind": s_enum("tensor", "state_dict"),
        "sig": s_str(128),
        "pending": s_bool,
        "slots": s_slots_or_none,
        "vols": wire.s_ints(0, 1 << 20, MAX_ITEMS),
        "volumes": s_list(s_volume, 1 << 16),
        "meta": s_list(s_meta, MAX_ITEMS),
        "objects": s_list(s_object, 1 << 16),
    },
    optional=frozenset(
        {
            "version",
            "lease",
            "kind",
            "sig",
            "pending",
            "slots",
            "vols",
            "volumes",
            "meta",
            "objects",
        }
    ),
    doc="pin a version for reading (a lease) and say where its shards are; the layout "
    "(meta) only when the client's cached signature is stale; waiting=True (and nothing "
    "else) when wait_ms passed before the version began",
)
WAIT = _op(
    "wait",
    "controller",
    {"key": s_key, "version": s_version, "slots": s_slots, "wait_ms": s_int(0, 1 << 31)},
    {"done": s_bool, "committed": s_bool, "written": s_slots},
    doc="block until the first of these slots of a pending version is written (no slots: "
    "its commit); written: those of them written by then",
)
RELEASE = _op(
    "release",
    "controller",
    {"lease": s_int(1, 1 << 62)},
    {"lost": s_bool},
    bound=True,
    doc="unpin a version; lost says whether its volume died meanwhile",
)
SLOT_HANDLES = _op(
    "slot_handles",
    "controller",
    {"volume_id": s_volume_id, "slots": s_slots},
    {"handles": s_list(s_handle, MAX_ITEMS)},
    doc="the CUDA IPC handles of a device volume's slots, for a reader to open them",
)

# -- queries ------------------------------------------------------------------------------
KEYS = _op("keys", "controller", {"prefix": s_str(1024)}, {"keys": s_list(s_key, MAX_ITEMS)})
VERSIONS = _op("versions", "controller", {"key": s_key}, {"versions": s_list(s_version)})
EXISTS = _op(
    "exists", "controller", {"key": s_key, "version": s_opt(s_version)}, {"exists": s_bool}
)
DELETE = _op(
    "delete",
    "controller",
    {"key": s_key, "version": s_opt(s_version)},
    {"deleted": s_int(0, 1 << 62)},
)
s_entry = s_map(
    {
        "key": s_key,
        "version": s_version,
        "kind": s_enum("tensor", "state_dict"),
        "tensors": s_int(),
        "shards": s_int(),
        "bytes": s_int(),
        "volumes": s_list(s_volume_id),
    }
)
s_volume_state = s_map(
    {
        "volume": s_volume_id,
        "kind": s_enum("shm", "cuda"),
        "host": s_host,
        "address": s_str(512),
        "alive": s_bool,
    }
)
LS = _op(
    "ls",
    "controller",
    {"prefix": s_str(1024)},
    {"entries": s_list(s_entry, MAX_ITEMS), "volumes": s_list(s_volume_state, 1 << 16)},
)
VOLUMES = _op("volumes", "controller", {}, {"volumes": s_list(s_volume_state, 1 << 16)})

# -- volumes ------------------------------------------------------------------------------
REGISTER_VOLUME = _op(
    "register_volume",
    "controller",
    {
        "volume_id": s_volume_id,
        "address": s_str(512),
        "host": s_host,
        "shm_dir": s_str(1024),
        "store_id": s_str(96),
    },
    doc="a volume process joins; the controller then sends it registration ops on this "
    "connection, and its close means the volume is gone",
)
VOL_WRITE = _op(
    "vol_write",
    "volume",
    {"slot": s_slot, "offset": s_int(), "nbytes": s_int(), "grant": s_grant},
    payload=True,
    doc="bytes into a slot the controller granted to this writer",
)
VOL_READ = _op(
    "vol_read",
    "volume",
    {"slot": s_slot, "shape": s_dims, "itemsize": s_int(1, 64), "offsets": s_dims, "sizes": s_dims},
    {"nbytes": s_int()},
    reply_payload=True,
    doc="a sub-box of the shard a slot holds, contiguous",
)
VOL_NIXL = _op(
    "vol_nixl",
    "volume",
    {"slots": s_slots},
    {
        "agent": s_str(256),
        "metadata": wire.s_blob(16 << 20),
        "slots": s_list(s_map({"slot": s_slot, "addr": s_int(), "nbytes": s_int()}), MAX_ITEMS),
    },
    doc="the volume's NIXL agent (name, metadata for these slots) and where each slot is in "
    "its memory, for one-sided reads (tidal/store/transports/nixl.py)",
)
VOL_CREATE = _op(
    "vol_create",
    "registration",
    {"segments": s_list(s_map({"slot": s_slot, "nbytes": s_int()}), MAX_ITEMS)},
    doc="allocate segments for new slots",
)
VOL_DESTROY = _op("vol_destroy", "registration", {"slots": s_slots}, doc="free segments")
VOL_GRANT = _op(
    "vol_grant",
    "registration",
    {"slots": s_slots, "grant": s_grant},
    doc="these slots may be written by whoever shows the grant",
)
VOL_SEAL = _op("vol_seal", "registration", {"slots": s_slots}, doc="no more writes")


def request(op: Op, **fields: Any) -> dict[str, Any]:
    """The header of a request: exactly the op's declared fields (a programming error
    otherwise; values are checked by the receiver)."""
    if fields.keys() != op.request.keys():
        missing = sorted(op.request.keys() - fields.keys())
        extra = sorted(fields.keys() - op.request.keys())
        raise TypeError(f"request {op.name!r}: missing fields {missing}, unknown fields {extra}")
    return {"op": op.name, **fields}


def check_request(header: Any, payload_len: int) -> Op:
    """Validate a decoded request header; returns its op."""
    if not isinstance(header, dict):
        raise ProtocolError(f"message header must be a map, got {type(header).__name__}")
    name = header.get("op")
    op = OPS.get(name) if isinstance(name, str) else None  # any value may come: a list too
    if op is None:
        raise ProtocolError(f"unknown op {header.get('op')!r}; known ops: {sorted(OPS)}")
    _check_fields(op.name, op.request, header, skip={"op"})
    if payload_len and not op.payload:
        raise ProtocolError(f"op {op.name!r} takes no payload, got {payload_len} bytes")
    return op


def check_reply(op: Op, reply: dict[str, Any]) -> None:
    """Validate a successful reply to ``op`` (a server's reply is input too)."""
    _check_fields(op.name, op.reply, reply, skip={"ok"}, optional=op.optional)


def _check_fields(
    name: str,
    schema: Mapping[str, Checker],
    header: dict[str, Any],
    skip: set[str],
    optional: frozenset[str] = frozenset(),
) -> None:
    for f, check in schema.items():
        if f not in header:
            if f in optional:
                continue
            raise ProtocolError(f"op {name!r}: missing field {f!r}")
        check(header[f], f)
    extra = header.keys() - schema.keys() - skip
    if extra:
        raise ProtocolError(f"op {name!r}: unknown fields {sorted(extra)}")
