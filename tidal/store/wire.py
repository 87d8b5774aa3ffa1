"""Framing and value checks shared by every tidal.store peer (client, controller, volume).

A message is a 16-byte prefix, a msgpack header and an optional raw payload::

    magic b"TDS1" | u32 header length | u64 payload length | msgpack header | payload bytes

The header is a msgpack map with string keys. What each op's header may hold is declared
once, in :mod:`tidal.store.ops`, with the checkers below; nothing received is ever
unpickled. Lengths are checked against limits before any byte of the header or payload is
read, so a peer cannot make the server allocate more than the limit it set. Bulk bytes
(tensor data) travel in the payload and are received with ``socket.recv_into`` straight into
their destination.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import torch

from tidal.store.errors import ProtocolError, StoreError

MAGIC = b"TDS1"
PREFIX = struct.Struct("<4sIQ")
PROTOCOL_VERSION = 3
MAX_HEADER_BYTES = 32 << 20
# Send large payloads in pieces: on the development VM a loop of 4 MiB sendall calls moved
# 3.5-4.1 GB/s over loopback against 2.8-3.0 GB/s for one sendall of the whole buffer
# (shared/CPU_NOTES.md, "Raw data movement"); benchmarks/store_tcp.py re-measures it.
CHUNK_BYTES = 4 << 20
# TCP keepalive on connections that idle with no timeout (a server's wait for the next
# request, a volume's wait for the controller's): a peer whose host died or was cut off
# sends no FIN, and without probes that wait never ends. 30 s idle, then 3 probes 10 s
# apart: such a peer is found gone within about a minute.
KEEPALIVE = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3}

# dtypes allowed on the wire, by name. Names received are looked up here only.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; raises TypeError for dtypes the store does not carry."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} is not supported by tidal.store; supported: {sorted(DTYPES)}"
        ) from None


def host_id() -> str:
    """Identifies this machine: peers with equal ids can share memory segments."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def parse_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); raises ValueError naming the address."""
    if not isinstance(address, str) or not address.startswith("tcp://"):
        raise ValueError(f"store address {address!r} must look like tcp://host:port")
    host, sep, port = address[len("tcp://") :].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"store address {address!r} must look like tcp://host:port")
    return host.strip("[]"), int(port)


class ConnectionClosed(StoreError):
    """The peer closed the connection between two messages."""


# ---------------------------------------------------------------------------------------
# Checkers: a checker takes (value, field name) and raises ProtocolError when it does not fit.

Checker = Callable[[Any, str], None]


def _fail(field: str, what: str, value: Any) -> None:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise ProtocolError(f"field {field!r}: expected {what}, got {shown}")


def s_str(max_len: int = 4096) -> Checker:
    def check(v: Any, f: str) -> None:
        if not isinstance(v, str) or len(v) > max_len or "\x00" in v:
            _fail(f, f"a string of at most {max_len} characters", v)

    return check


def s_int(lo: int = 0, hi: int = 1 << 62) -> Checker:
    def check(v: Any, f: str) -> None:
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            _fail(f, f"an integer in [{lo}, {hi}]", v)

    return check


def s_bytes(size: int) -> Checker:
    def check(v: Any, f: str) -> None:
        if not isinstance(v, bytes) or len(v) != size:
            _fail(f, f"{size} bytes", v)

    return check


def s_blob(max_len: int) -> Checker:
    """Opaque bytes of at most ``max_len`` (a peer library's own encoding, never unpickled)."""

    def check(v: Any, f: str) -> None:
        if not isinstance(v, bytes) or len(v) > max_len:
            _fail(f, f"at most {max_len} bytes", v)

    return check


def s_bool(v: Any, f: str) -> None:
    if not isinstance(v, bool):
        _fail(f, "a boolean", v)


def s_opt(inner: Checker) -> Checker:
    def check(v: Any, f: str) -> None:
        if v is not None:
            inner(v, f)

    return check


def s_enum(*allowed: str) -> Checker:
    def check(v: Any, f: str) -> None:
        if v not in allowed:
            _fail(f, f"one of {allowed}", v)

    return check


def s_list(inner: Checker, max_len: int = 1 << 20) -> Checker:
    def check(v: Any, f: str) -> None:
        if not isinstance(v, list) or len(v) > max_len:
            _fail(f, f"a list of at most {max_len} items", v)
        for i, item in enumerate(v):
            inner(item, f"{f}[{i}]")

    return check


def s_ints(lo: int, hi: int, max_len: int, none: bool = False) -> Checker:
    """A list of integers in [lo, hi] (or None, with ``none``): ``s_list(s_int(lo, hi))``
    in one loop, for the long lists of slot ids and dims every put and get carries."""

    def ok(x: Any) -> bool:
        return (type(x) is int and lo <= x <= hi) or (none and x is None)

    allowed = {int, type(None)} if none else {int}

    def fine(v: list[Any]) -> bool:
        """All items ok, in C loops (a Python call per item costs a put of 114 tensors
        about 0.1 ms per list)."""
        if not set(map(type, v)) <= allowed:
            return False
        ints = [x for x in v if x is not None] if none else v
        return not ints or (min(ints) >= lo and max(ints) <= hi)

    def check(v: Any, f: str) -> None:
        if not isinstance(v, list) or len(v) > max_len:
            _fail(f, f"a list of at most {max_len} items", v)
        if not fine(v):
            bad = next(i for i, x in enumerate(v) if not ok(x))
            _fail(
                f"{f}[{bad}]", f"an integer in [{lo}, {hi}]" + (" or None" if none else ""), v[bad]
            )

    return check


def s_tuple(*inners: Checker) -> Checker:
    def check(v: Any, f: str) -> None:
        if not isinstance(v, list) or len(v) != len(inners):
            _fail(f, f"a list of {len(inners)} items", v)
        for i, (inner, item) in enumerate(zip(inners, v, strict=True)):
            inner(item, f"{f}[{i}]")

    return check


def s_map(fields: Mapping[str, Checker]) -> Checker:
    """A map with exactly these named fields."""

    def check(v: Any, f: str) -> None:
        if not isinstance(v, dict) or set(v) != set(fields):
            _fail(f, f"a map with fields {sorted(fields)}", v)
        for name, inner in fields.items():
            inner(v[name], f"{f}.{name}")

    return check


def s_any_of(*inners: Checker) -> Checker:
    def check(v: Any, f: str) -> None:
        errors = []
        for inner in inners:
            try:
                inner(v, f)
                return
            except ProtocolError as e:
                errors.append(str(e))
        raise ProtocolError(" or ".join(errors))

    return check


def s_value(max_depth: int = 16) -> Checker:
    """A plain value: None, bool, int, float, str, bytes, or lists / string-keyed maps of
    them (the non-tensor leaves of a state dict). msgpack already bounds its size."""

    def walk(v: Any, f: str, depth: int) -> None:
        if depth > max_depth:
            _fail(f, f"a value nested at most {max_depth} deep", v)
        if v is None or isinstance(v, bool | int | float | str | bytes):
            return
        if isinstance(v, list):
            for i, item in enumerate(v):
                walk(item, f"{f}[{i}]", depth + 1)
            return
        if isinstance(v, dict):
            for k, item in v.items():
                if not isinstance(k, str):
                    _fail(f, "a map with string keys", v)
                walk(item, f"{f}.{k}", depth + 1)
            return
        _fail(f, "a plain value (None, bool, number, string, list, map)", v)

    return lambda v, f: walk(v, f, 0)


# ---------------------------------------------------------------------------------------
# Framing.


def pack(header: dict[str, Any], payload_len: int = 0) -> bytes:
    body = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(MAGIC, len(body), payload_len) + body


def send(sock: socket.socket, header: dict[str, Any], payload: memoryview | None = None) -> None:
    """Send one message; the payload (if any) goes out in ``CHUNK_BYTES`` pieces."""
    n = 0 if payload is None else payload.nbytes
    sock.sendall(pack(header, n))
    if payload is not None and n:
        payload = payload.cast("B")
        for start in range(0, n, CHUNK_BYTES):
            sock.sendall(payload[start : start + CHUNK_BYTES])


def keep_alive(sock: socket.socket) -> None:
    """Turn on TCP keepalive probes (``KEEPALIVE``) for a connection that waits for its peer
    with no timeout: a receive then fails (OSError) once the peer's host is gone, instead of
    waiting forever. Options this platform lacks are left out; a non-TCP socket is left as
    it is."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in KEEPALIVE.items():
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError:  # fallback: the connection is already closed; its next receive says so
        pass


def _arm(sock: socket.socket, deadline: float | None) -> None:
    """Before a receive: a socket timeout of the time left until ``deadline`` (monotonic
    seconds; None: leave the socket's timeout as it is). TimeoutError once it passed."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(left)


def recv_into(sock: socket.socket, buf: memoryview, deadline: float | None = None) -> None:
    """Fill ``buf`` (a writable byte view) from the socket; raises StoreError if the peer
    closes first, TimeoutError if ``deadline`` (monotonic seconds) passes first."""
    buf = buf.cast("B")
    n = buf.nbytes
    got = 0
    while got < n:
        _arm(sock, deadline)
        k = sock.recv_into(buf[got : got + CHUNK_BYTES * 4])
        if k == 0:
            raise ProtocolError(f"connection closed by peer after {got} of {n} bytes")
        got += k


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def discard(sock: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(n, 1 << 20)))
    while n:
        k = sock.recv_into(scratch[: min(n, scratch.nbytes)])
        if k == 0:
            raise ProtocolError("connection closed while discarding a payload")
        n -= k


def recv_header(
    sock: socket.socket,
    max_header: int = MAX_HEADER_BYTES,
    max_payload: int = 1 << 62,
    deadline: float | None = None,
) -> tuple[Any, int]:
    """Read a prefix and header. Returns (decoded header, payload length still on the wire).

    Raises ConnectionClosed when the peer closed cleanly before a new message, ProtocolError
    for a bad magic, an oversized header or payload, an undecodable header or a message cut
    short, TimeoutError when ``deadline`` (monotonic seconds) passes before the header is
    in (a peer trickling bytes cannot stretch it; the socket's timeout alone bounds each
    receive, not the message).
    """
    prefix = bytearray(PREFIX.size)
    view = memoryview(prefix)
    got = 0
    while got < PREFIX.size:
        _arm(sock, deadline)
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                raise ConnectionClosed("connection closed")
            raise ProtocolError(f"connection closed inside a message prefix ({got} bytes)")
        got += k
    magic, header_len, payload_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}; not a tidal.store peer (want {MAGIC!r})")
    if header_len > max_header:
        raise ProtocolError(f"header of {header_len} bytes exceeds the limit of {max_header}")
    if payload_len > max_payload:
        raise ProtocolError(f"payload of {payload_len} bytes exceeds the limit of {max_payload}")
    body = recv_exact(sock, header_len, deadline)
    try:
        header = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage input
        raise ProtocolError(f"undecodable message header ({type(e).__name__}: {e})") from None
    return header, payload_len
