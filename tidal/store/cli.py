"""tidal store serve | volume | ls: run a store service, add a volume, list its contents.

``tidal store ...`` and ``python -m tidal.store ...`` both run :func:`main`. This is an entry
point: it is where the token is read from ``--token-file`` or ``TIDAL_STORE_TOKEN`` (``--token``
works too, but shows the secret to ``ps``) and the address from ``TIDAL_STORE``.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import sys
import threading

from tidal.store.client import connect
from tidal.store.controller import Controller
from tidal.store.errors import StoreError
from tidal.store.server import Server
from tidal.store.standalone import run_volume
from tidal.store.volume import Volume, new_store_id, reap_stale

PROG = "tidal store"
# A served volume keeps this much shared memory written ahead, refilled in the background,
# so that the first put of a new key copies into existing pages (tidal/store/volume.py).
POOL_GB = 2.0
POOL_HELP = (
    "shared memory kept written ahead in the background for new keys' first puts "
    "(at most a quarter of the free space; 0: none)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="{serve,volume,ls}")
    serve = sub.add_parser("serve", help="run a controller and a shared-memory volume")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    serve.add_argument("--port", type=int, default=0, help="TCP port (0: pick a free one)")
    _token_args(serve, "shared secret clients must present; required off loopback")
    serve.add_argument("--keep", type=int, default=2, help="versions retained per key")
    serve.add_argument("--capacity-gb", type=float, default=None, help="volume memory cap")
    serve.add_argument(
        "--reserve-gb",
        type=float,
        default=0.0,
        help="memory allocated at start for new keys' first puts",
    )
    serve.add_argument("--pool-gb", type=float, default=POOL_GB, help=POOL_HELP)
    serve.add_argument("--shm-dir", default="/dev/shm", help="where segments live")
    _numa_arg(serve)
    serve.add_argument("--no-volume", action="store_true", help="metadata only (volumes join)")
    serve.set_defaults(func=_serve)

    vol = sub.add_parser("volume", help="run a storage volume that joins a controller")
    vol.add_argument("--controller", required=True, help="tcp://host:port of the store")
    vol.add_argument("--id", required=True, help="volume name, unique in the store")
    vol.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    vol.add_argument("--port", type=int, default=0)
    _token_args(vol, "the store's shared secret")
    vol.add_argument("--capacity-gb", type=float, default=None)
    vol.add_argument("--reserve-gb", type=float, default=0.0)
    vol.add_argument("--pool-gb", type=float, default=POOL_GB, help=POOL_HELP)
    vol.add_argument("--shm-dir", default="/dev/shm")
    _numa_arg(vol)
    vol.set_defaults(func=_volume)

    ls = sub.add_parser("ls", help="list keys, versions, sizes and where shards live")
    ls.add_argument("address", nargs="?", default=None, help="tcp://host:port (or $TIDAL_STORE)")
    ls.add_argument("--prefix", default="")
    _token_args(ls, "the store's shared secret")
    ls.set_defaults(func=_ls)
    return parser


def _numa_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--numa-node",
        type=_numa,
        default="auto",
        help="NUMA node of the volume's memory: auto (the RDMA NICs' node), off, or a number",
    )


def _numa(text: str) -> int | str:
    if text in ("auto", "off"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use auto, off or a node number") from None


def _token_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--token-file", default=None, help=f"file holding {what} (or set TIDAL_STORE_TOKEN)"
    )
    p.add_argument(
        "--token", default=None, help="the secret itself (visible to ps; prefer --token-file)"
    )


def _token(args: argparse.Namespace) -> str | None:
    """The token from --token-file, --token or $TIDAL_STORE_TOKEN, in that order."""
    if args.token_file:
        try:
            with open(args.token_file) as f:
                token = f.read().strip()
        except OSError as e:
            raise ValueError(f"cannot read --token-file {args.token_file}: {e.strerror}") from None
        if not token:
            raise ValueError(f"--token-file {args.token_file} is empty")
        return token
    return args.token or os.environ.get("TIDAL_STORE_TOKEN") or None


def _raise_fd_limit() -> None:
    """Lift this process's soft limit on open files to its hard limit. A volume holds one
    file descriptor per segment (Python's mmap keeps one) besides one per connection, so
    a store of a few large state dicts passes a default ``ulimit -n`` of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 20 if hard == resource.RLIM_INFINITY else hard  # Linux's default nr_open
    if soft != resource.RLIM_INFINITY and want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass  # fallback: keep the soft limit; the server survives running out


def _gb(x: float | None) -> int | None:
    return None if x is None else int(x * 1e9)


def _wait_for_signal() -> None:
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()


def _serve(args: argparse.Namespace) -> int:
    _raise_fd_limit()
    reap_stale(args.shm_dir)
    store_id = new_store_id()
    volume = None
    if not args.no_volume:
        volume = Volume(
            "v0",
            store_id,
            shm_dir=args.shm_dir,
            capacity=_gb(args.capacity_gb),
            reserve=_gb(args.reserve_gb) or 0,
            pool=_gb(args.pool_gb) or 0,
            numa_node=args.numa_node,
        )
    try:
        server = Server(
            controller=Controller(store_id, keep=args.keep),
            volume=volume,
            host=args.host,
            port=args.port,
            token=_token(args),
        )
    except BaseException:
        if volume is not None:
            volume.close()  # its reserve and pool files, and the pool's thread
        raise
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

    _raise_fd_limit()
    run_volume(
        args.controller,
        args.id,
        host=args.host,
        port=args.port,
        token=_token(args),
        shm_dir=args.shm_dir,
        capacity=_gb(args.capacity_gb),
        reserve=_gb(args.reserve_gb) or 0,
        pool=_gb(args.pool_gb) or 0,
        numa_node=args.numa_node,
        ready=ready,
    )
    return 0


def _ls(args: argparse.Namespace) -> int:
    address = args.address or os.environ.get("TIDAL_STORE")
    if not address:
        raise ValueError("give an address (tcp://host:port) or set TIDAL_STORE")
    with connect(address, token=_token(args)) as store:
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
        where = v["address"] if v["kind"] == "shm" else "GPU memory (CUDA IPC)"
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        print(f"\n{PROG}: error: choose a command: serve, volume or ls", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (ValueError, StoreError) as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    except BrokenPipeError:  # `tidal store ls | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the interpreter's flush is quiet
        return 0
