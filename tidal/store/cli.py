"""tidal store serve | volume | ls: run a store service, add a volume, list its contents.

The top-level ``tidal`` command mounts these with :func:`add_store_subcommands`;
``python -m tidal.store ...`` runs them directly.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from tidal.store.client import connect
from tidal.store.controller import Controller
from tidal.store.errors import StoreError
from tidal.store.server import Server, run_volume
from tidal.store.volume import Volume, new_store_id, reap_stale


def add_store_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``store`` with ``serve``, ``volume`` and ``ls`` to a ``tidal`` argument parser."""
    store = subparsers.add_parser("store", help="run or inspect a tidal tensor store")
    build_parser(store)


def build_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="store_cmd", required=True)
    serve = sub.add_parser("serve", help="run a controller and a shared-memory volume")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    serve.add_argument("--port", type=int, default=0, help="TCP port (0: pick a free one)")
    serve.add_argument("--token", default=None, help="shared secret; required off loopback")
    serve.add_argument("--keep", type=int, default=2, help="versions retained per key")
    serve.add_argument("--capacity-gb", type=float, default=None, help="volume memory cap")
    serve.add_argument("--shm-dir", default="/dev/shm", help="where segments live")
    serve.add_argument("--no-volume", action="store_true", help="metadata only (volumes join)")
    serve.set_defaults(func=_serve)

    vol = sub.add_parser("volume", help="run a storage volume that joins a controller")
    vol.add_argument("--controller", required=True, help="tcp://host:port of the store")
    vol.add_argument("--id", required=True, help="volume name, unique in the store")
    vol.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    vol.add_argument("--port", type=int, default=0)
    vol.add_argument("--token", default=None)
    vol.add_argument("--capacity-gb", type=float, default=None)
    vol.add_argument("--shm-dir", default="/dev/shm")
    vol.set_defaults(func=_volume)

    ls = sub.add_parser("ls", help="list keys, versions, sizes and where shards live")
    ls.add_argument("address", nargs="?", default=None, help="tcp://host:port (or $TIDAL_STORE)")
    ls.add_argument("--prefix", default="")
    ls.add_argument("--token", default=None)
    ls.set_defaults(func=_ls)


def _gb(x: float | None) -> int | None:
    return None if x is None else int(x * 1e9)


def _wait_for_signal() -> None:
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()


def _serve(args: argparse.Namespace) -> int:
    reap_stale(args.shm_dir)
    store_id = new_store_id()
    volume = None
    if not args.no_volume:
        volume = Volume("v0", store_id, shm_dir=args.shm_dir, capacity=_gb(args.capacity_gb))
    server = Server(
        controller=Controller(store_id, keep=args.keep),
        volume=volume,
        host=args.host,
        port=args.port,
        token=args.token,
    )
    print(f"tidal store serving at {server.address} (pid {os.getpid()})", flush=True)
    print(f"export TIDAL_STORE={server.address}", flush=True)
    try:
        _wait_for_signal()
    finally:
        server.close()
    return 0


def _volume(args: argparse.Namespace) -> int:
    def ready(address: str) -> None:
        print(f"tidal store volume {args.id} at {address} joined {args.controller}", flush=True)

    run_volume(
        args.controller,
        args.id,
        host=args.host,
        port=args.port,
        token=args.token,
        shm_dir=args.shm_dir,
        capacity=_gb(args.capacity_gb),
        ready=ready,
    )
    return 0


def _ls(args: argparse.Namespace) -> int:
    address = args.address or os.environ.get("TIDAL_STORE")
    if not address:
        print("tidal store ls: give an address or set TIDAL_STORE", file=sys.stderr)
        return 2
    with connect(address, token=args.token or os.environ.get("TIDAL_STORE_TOKEN")) as store:
        listing = store.ls(args.prefix)
    rows = [("KEY", "VERSION", "KIND", "TENSORS", "SHARDS", "BYTES", "VOLUMES")]
    for e in listing["entries"]:
        rows.append(
            (
                e["key"],
                str(e["version"]),
                e["kind"],
                str(e["tensors"]),
                str(e["shards"]),
                _size(e["bytes"]),
                ",".join(e["volumes"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print()
    for v in listing["volumes"]:
        state = "alive" if v["alive"] else "GONE"
        where = v["address"] if v.get("kind", "shm") == "shm" else "GPU memory (CUDA IPC)"
        print(f"volume {v['volume']}  {where}  host {v['host']}  {state}")
    return 0


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def main(argv: list[str] | None = None) -> int:
    """Run ``tidal store ...`` with ``argv`` (default: sys.argv[1:]); returns the exit code."""
    parser = argparse.ArgumentParser(prog="tidal store", description=__doc__.splitlines()[0])
    build_parser(parser)
    args = parser.parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``store`` subcommand (for parsers built by add_store_subcommands)."""
    try:
        return args.func(args)
    except (ValueError, StoreError) as e:
        print(f"tidal store {args.store_cmd}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
