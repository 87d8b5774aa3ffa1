"""The tidal.store client: ``connect()`` and the :class:`Store` handle.

Lifecycle: every process that reads or writes calls ``connect()`` once and keeps the handle.
The handle holds one control connection to the controller, a pool of data connections per
remote volume (TCP transport), a cache of mapped shared-memory segments (same-host transport)
and a cache of read plans per (key, stored layout, destination layout).

A put: ``put_begin`` (controller allocates or reuses a slot per shard in a volume on this
host), copy each local shard into its slot, ``put_commit``. A get: ``acquire`` (controller
pins a committed version with a lease and returns its slots; the full layout only when the
client's cached copy is stale), copy the overlap of each stored shard with the destination
window straight into a view of the destination, ``release``.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tidal.store import cuda_ipc, layout, streams, views, wire
from tidal.store.conn import Conn
from tidal.store.controller import Controller
from tidal.store.errors import StoreError, VersionNotFoundError, VolumeLostError
from tidal.store.layout import Dims, Path
from tidal.store.progress import Progress
from tidal.store.segments import Segments
from tidal.store.server import Server
from tidal.store.volume import Volume, new_store_id, reap_stale

Transport = Literal["auto", "shm", "tcp"]
Memory = Literal["host", "cuda"]
_TCP_PIECE = 16 << 20  # split TCP reads/writes into pieces spread over the connections


@dataclass(slots=True)
class _Stored:
    """A stored tensor's layout, as decoded from an ``acquire`` reply."""

    shape: Dims
    dtype: torch.dtype
    boxes: list[tuple[Dims, Dims]]
    first: int  # index of its first shard in the reply's flat slot list


@dataclass(slots=True)
class _Op:
    """Copy a sub-box of stored shard ``shard`` into the destination's local tensor."""

    dest: int  # index into the destination list
    shard: int  # index into the flat slot list
    shard_shape: Dims
    src_off: Dims  # relative to the stored shard
    dst_off: Dims  # relative to the destination's local tensor
    sizes: Dims


class Store:
    """A handle to a tidal store. Create it with :func:`connect`.

    Blocking methods: ``put``, ``get``, ``put_state_dict``, ``get_state_dict``, ``keys``,
    ``versions``, ``exists``, ``delete``, ``ls``, ``close``. Non-blocking variants
    ``put_async``, ``get_async``, ``put_state_dict_async``, ``get_state_dict_async`` return a
    ``concurrent.futures.Future`` (wrap with ``asyncio.wrap_future`` to await it); sources
    must not be modified, nor destinations read, until the future is done.
    A handle is thread-safe.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        transport: Transport = "auto",
        timeout: float = 60.0,
        volume: str | None = None,
        connections: int = 2,
        _server: Server | None = None,
    ) -> None:
        if transport not in ("auto", "shm", "tcp"):
            raise ValueError(f"transport must be 'auto', 'shm' or 'tcp', got {transport!r}")
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        self.address = address
        self.transport = transport
        self._token = token
        self._timeout = timeout
        self._volume = volume
        self._connections = connections
        self._server = _server
        self._ctrl = Conn(address, token, timeout)
        self._host = wire.host_id()
        self._writer = f"{self._host}:{os.getpid()}:{secrets.token_hex(4)}"
        self._lock = threading.Lock()
        self._pools: dict[str, list[Conn]] = {}
        self._segments = Segments()  # mapped shared-memory segments of same-host volumes
        self._releaser: views.Releaser | None = None
        self._view_conn: Conn | None = None  # leases of zero-copy views live on it
        self._views_lock = threading.Lock()  # never held around a request
        self._live_views = 0  # zero-copy reads whose views are still alive
        self._device: cuda_ipc.DeviceVolume | None = None  # put(..., memory="cuda") slots
        self._imports = cuda_ipc.Imports()  # other writers' device slots opened here
        self._streams: streams.SideStreams | None = None  # for *_async CUDA copies
        self._meta: dict[str, tuple[str, dict[Path, _Stored]]] = {}
        self._plans: OrderedDict[tuple[Any, ...], list[_Op]] = OrderedDict()
        self._shm_ok: dict[str, bool] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._io: ThreadPoolExecutor | None = None
        self._wait_conn: Conn | None = None
        self._closed = False
        # Diagnostics: layouts received from the controller (a repeated get of new versions
        # of the same layout receives none) and read plans computed.
        self.metadata_fetches = 0
        self.plans_built = 0

    # ================================================================== public API

    def put(
        self,
        key: str,
        value: torch.Tensor,
        *,
        version: int | None = None,
        writers: int | None = None,
        keep: int | None = None,
        memory: Memory = "host",
    ) -> int:
        """Store a tensor, or this process's shard of a DTensor, as ``version`` of ``key``.

        Every process holding a shard of a DTensor calls ``put`` with the same key and
        version; each sends only its local shard and its box in the global tensor (a shard
        already sent by a replica is skipped). The version becomes visible to readers when
        all ``writers`` have put.

        Args:
            key: name of the value, e.g. ``"policy/lm_head"``.
            value: a CPU tensor or DTensor (any dtype in ``wire.DTYPES``, any strides).
            version: integer version; None picks the next one (single writer only).
            writers: processes that put this version; for a DTensor, defaults to the world
                size of the default process group (every rank puts, SPMD style) or the
                mesh size without one; 1 for a plain tensor.
            keep: how many committed versions of ``key`` to retain (default: the store's).
            memory: where the stored copy lives: ``"host"`` (shared memory of a volume,
                readable from any host) or ``"cuda"`` (this process's GPU memory, read by
                processes on this host through CUDA IPC, device to device; it lives as long
                as this store handle). See ``tidal/store/cuda_ipc.py``.

        Returns:
            The version number written.

        Raises:
            ValueError: the version already exists, or writers disagree on shape/dtype;
                ``memory="cuda"`` without a CUDA device.
            TypeError: ``value`` is not a tensor, or ``key`` holds a state dict.
            StoreError: the store or a volume cannot be reached.

        Example::

            store = tidal.store.connect()
            v = store.put("w", torch.randn(4, 4))
        """
        return self._put(key, "tensor", [((), value)], version, writers, keep, memory)

    def get(
        self,
        key: str,
        into: torch.Tensor | None = None,
        *,
        version: int | Literal["latest"] = "latest",
        wait: float | None = None,
        copy: bool = True,
    ) -> torch.Tensor:
        """Read a stored tensor: the full value, or exactly the window ``into`` covers.

        Args:
            key: the key given to ``put``.
            into: None to return a new CPU tensor of the full value; a tensor of the global
                shape, or a DTensor whose local shard is filled in place (any layout, any
                strides: only the overlapping parts of stored shards are read).
            version: a version number or ``"latest"`` (latest committed).
            wait: seconds to wait for ``version`` (a number) to be written. The read then
                streams: each shard is copied as soon as its writer reports it in place,
                and the call returns once the version is committed, with only its bytes.
                Others still see the version only at its commit.
            copy: False for a zero-copy read (``into`` must be None): the returned tensor
                is a read-only view of the store's shared memory on this host, holding
                the version (it is not reused) until the tensor and every view of it are
                garbage. An in-place write to it faults; ``clone()`` it to modify it.
                Needs the value stored as one shard in a volume on this host.

        Returns:
            ``into`` (filled) or a new tensor.

        Raises:
            KeyNotFoundError / VersionNotFoundError (both KeyError): unknown key, or a
                version never written, evicted or deleted.
            ValueError: ``into`` has another global shape or dtype than the stored value;
                ``copy=False`` with ``into``, or for a value that is not one shard in
                shared memory on this host.
            TypeError: ``key`` holds a state dict (use ``get_state_dict``).
            VolumeLostError: the volume holding the bytes went away.

        Example::

            w = store.get("w")                       # full tensor
            store.get("w", into=dtensor_shard)       # resharded in place
            w = store.get("w", copy=False)           # zero-copy, read-only
        """
        dests: list[tuple[Path, torch.Tensor]] | None = None if into is None else [((), into)]
        return self._get(key, "tensor", dests, version, wait, copy)[0][1]

    def put_state_dict(
        self,
        state_dict: Mapping[str, Any],
        key: str,
        *,
        version: int | None = None,
        writers: int | None = None,
        keep: int | None = None,
        memory: Memory = "host",
    ) -> int:
        """Store a nested state dict of tensors and DTensors as one version of ``key``.

        One call for the whole model: every tensor's local shard goes to a volume on this
        host; the version becomes visible when every writer has put all its tensors.

        Args:
            state_dict: nested dicts/lists whose leaves are tensors or DTensors.
            key: name of the state dict, e.g. ``"policy"``.
            version: integer version; None picks the next one (single writer only).
            writers: processes that put this version; with DTensors in the state dict,
                defaults to the world size of the default process group (every rank puts,
                SPMD style; pipeline stages included) or the largest mesh without one;
                1 for a state dict of plain tensors. Pass it when only some ranks put.
            keep: committed versions of ``key`` to retain (default: the store's).
            memory: ``"host"`` or ``"cuda"`` (this process's GPU memory, shared with readers
                on this host by CUDA IPC; see ``put``).

        Returns:
            The version number written.

        Raises:
            TypeError: a leaf is not a tensor, or ``key`` holds a single tensor.
            ValueError: the version exists, or writers disagree on a tensor's shape/dtype.

        Example::

            store.put_state_dict(model.state_dict(), "policy", version=step)
        """
        items = layout.flatten(state_dict)
        return self._put(key, "state_dict", items, version, writers, keep, memory)

    def get_state_dict(
        self,
        key: str,
        into: Mapping[str, Any] | None = None,
        *,
        version: int | Literal["latest"] = "latest",
        wait: float | None = None,
        copy: bool = True,
    ) -> dict[str, Any]:
        """Read a stored state dict, resharding every tensor into ``into``'s layout.

        Args:
            key: the key given to ``put_state_dict``.
            into: None for a new nested dict of full CPU tensors; otherwise a (nested)
                state dict of tensors/DTensors filled in place. It may hold a subset of the
                stored tensors (only those are read).
            version: a version number or ``"latest"``.
            wait: seconds to wait for ``version`` to be written, streaming it as its
                tensors land (see ``get``). A generator waiting for the trainer's next
                version overlaps its copy with the trainer's put.
            copy: False for a zero-copy read (``into`` must be None): read-only views of
                the store's shared memory, holding the version until every one of them is
                garbage (see ``get``). Needs every tensor stored as one shard (one writer)
                in a volume on this host.

        Returns:
            ``into`` (filled) or a new nested dict.

        Raises:
            KeyError: unknown key or version, or a tensor of ``into`` missing in the store.
            ValueError: a tensor of ``into`` has another global shape or dtype; ``copy=False``
                with ``into`` or for tensors it cannot alias.

        Example::

            store.get_state_dict("policy", into=generator_model.state_dict())
            weights = store.get_state_dict("policy", copy=False)   # zero-copy, read-only
            cpu_model.load_state_dict(weights, assign=True)        # runs on the store's pages
        """
        dests = None if into is None else layout.flatten(into)
        out = self._get(key, "state_dict", dests, version, wait, copy)
        return dict(into) if into is not None else layout.unflatten(out)

    def put_async(self, key: str, value: torch.Tensor, **kwargs: Any) -> Future[int]:
        """``put`` in a background thread; returns a Future of the version. CUDA copies run
        on a side stream, after the caller's queued work (see ``tidal/store/streams.py``)."""
        return self._submit_copies(value, self.put, key, value, **kwargs)

    def get_async(
        self, key: str, into: torch.Tensor | None = None, **kwargs: Any
    ) -> Future[torch.Tensor]:
        """``get`` in a background thread; returns a Future of the tensor. Copies into CUDA
        destinations run on a side stream, after the caller's queued work."""
        return self._submit_copies(into, self.get, key, into, **kwargs)

    def put_state_dict_async(
        self, state_dict: Mapping[str, Any], key: str, **kwargs: Any
    ) -> Future[int]:
        """``put_state_dict`` in a background thread; returns a Future of the version.
        CUDA copies run on a side stream, overlapping the caller's next kernels."""
        return self._submit_copies(state_dict, self.put_state_dict, state_dict, key, **kwargs)

    def get_state_dict_async(
        self, key: str, into: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> Future[dict[str, Any]]:
        """``get_state_dict`` in a background thread; returns a Future of the dict. Copies
        into CUDA destinations run on a side stream (a generator's prefetch)."""
        return self._submit_copies(into, self.get_state_dict, key, into, **kwargs)

    def keys(self, prefix: str = "") -> list[str]:
        """Keys with at least one committed version that start with ``prefix``, sorted.

        Example: ``store.keys("policy/")`` -> ``["policy/lm_head", "policy/trunk"]``.
        """
        return self._ctrl.request({"op": "keys", "prefix": prefix})["keys"]

    def versions(self, key: str) -> list[int]:
        """Committed (readable) versions of ``key``, oldest first.

        Raises KeyNotFoundError for an unknown key. Example: ``store.versions("w")`` ->
        ``[6, 7]`` with ``keep=2``.
        """
        return self._ctrl.request({"op": "versions", "key": key})["versions"]

    def exists(self, key: str, version: int | None = None) -> bool:
        """Whether ``key`` (or that version of it) is committed and readable; never raises
        for unknown keys. Example: ``store.exists("w", 7)``."""
        return self._ctrl.request({"op": "exists", "key": key, "version": version})["exists"]

    def delete(self, key: str, version: int | None = None) -> int:
        """Delete one version, or every version of ``key``; returns how many went.

        Readers already copying a deleted version finish with its bytes; later reads get
        VersionNotFoundError. Memory is freed once the last such reader is done.

        Raises:
            KeyNotFoundError / VersionNotFoundError: nothing to delete.

        Example: ``store.delete("w", version=3)``; ``store.delete("w")`` (all versions).
        """
        return self._ctrl.request({"op": "delete", "key": key, "version": version})["deleted"]

    def ls(self, prefix: str = "") -> dict[str, Any]:
        """What the store holds, for tools (``tidal store ls`` prints it).

        Returns:
            ``{"entries": [{key, version, kind, tensors, shards, bytes, volumes}],
            "volumes": [{volume, address, host, alive}]}`` for committed versions of keys
            starting with ``prefix``.

        Example: ``sum(e["bytes"] for e in store.ls("policy")["entries"])``.
        """
        reply = self._ctrl.request({"op": "ls", "prefix": prefix})
        return {"entries": reply["entries"], "volumes": reply["volumes"]}

    def close(self) -> None:
        """Close connections and unmap segments; an embedded store also shuts down."""
        if self._closed:
            return
        self._closed = True
        for ex in (self._executor, self._io):
            if ex is not None:
                ex.shutdown(wait=True)
        with self._views_lock:
            views_alive = self._live_views > 0
        if not views_alive:  # else the last view's release closes them
            self._close_views()
        self._ctrl.close(graceful=True)  # the controller drops this writer's device volume
        if self._wait_conn is not None:
            self._wait_conn.close(graceful=True)
        self._imports.close()
        if self._device is not None:
            self._device.close()
        with self._lock:
            for pool in self._pools.values():
                for c in pool:
                    c.close()
            self._pools.clear()
        self._segments.close()
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ================================================================== writes

    def _put(
        self,
        key: str,
        kind: str,
        items: list[tuple[Path, torch.Tensor]],
        version: int | None,
        writers: int | None,
        keep: int | None,
        memory: Memory = "host",
    ) -> int:
        _check_key(key)
        if memory not in ("host", "cuda"):
            raise ValueError(f"memory must be 'host' or 'cuda', got {memory!r}")
        decls, locals_ = [], []
        meshes = 0
        for path, value in items:
            shape, offs, sizes, local = layout.window(value)
            if isinstance(value, DTensor):
                meshes = max(meshes, value.device_mesh.size())
            decls.append(
                [list(path), list(shape), wire.dtype_name(value.dtype), list(offs), list(sizes)]
            )
            locals_.append(local)
        reply = self._ctrl.request(
            {
                "op": "put_begin",
                "key": key,
                "version": version,
                "writers": writers if writers is not None else _default_writers(meshes),
                "writer": self._writer,
                "keep": keep,
                "host": self._host,
                "volume": self._device_volume() if memory == "cuda" else self._volume,
                "kind": kind,
                "tensors": decls,
            }
        )
        version = reply["version"]
        try:
            vid, vaddr, vhost, prefix, vkind = reply["volume"]
            jobs = [(s, t) for s, t in zip(reply["slots"], locals_, strict=True) if s >= 0]
            streamed = reply["report"]  # a reader waits for this version: tell it what is in
            progress = Progress((lambda slots: self._report(key, version, slots)) if streamed
                                else None)  # fmt: skip
            if vkind == "cuda":
                assert self._device is not None and vid == self._device.volume_id, vid
                self._device.release(reply.get("freed", []))
                self._put_device(jobs, progress)
            elif self._use_shm(vhost, prefix, jobs[0][0] if jobs else None):
                with torch.no_grad():
                    for slot, local in jobs:
                        nbytes = local.numel() * local.element_size()
                        dst = self._map(prefix, slot, nbytes)
                        pinned = local.is_cuda and self._pin(prefix, slot, dst)
                        dst = dst.view(local.dtype).view(local.shape)
                        dst.copy_(local, non_blocking=pinned)
                        progress.add(slot, nbytes, local.device if pinned else None)
                progress.synchronize()
            else:
                self._tcp_write(vaddr, jobs)
        except BaseException:
            try:
                self._ctrl.request(
                    {"op": "put_abort", "key": key, "version": version, "writer": self._writer}
                )
            except (StoreError, ValueError):
                pass  # the abort is best effort; the connection drop aborts it as well
            raise
        self._ctrl.request(
            {"op": "put_commit", "key": key, "version": version, "writer": self._writer}
        )
        return version

    def _device_volume(self) -> str:
        """This handle's device volume (registered on the first ``memory="cuda"`` put)."""
        with self._lock:
            if self._device is None:
                if not torch.cuda.is_available():
                    raise ValueError("memory='cuda' needs a CUDA device; none is available")
                vid = f"cuda.{os.getpid()}.{secrets.token_hex(4)}"
                self._ctrl.request({"op": "device_volume", "volume_id": vid, "host": self._host})
                self._device = cuda_ipc.DeviceVolume(vid)
            return self._device.volume_id

    def _put_device(self, jobs: list[tuple[int, torch.Tensor]], progress: Progress) -> None:
        """Copy each local shard into its slot in this process's GPU memory (device to
        device for CUDA sources); new slots' IPC handles reach the controller first."""
        device = self._device
        assert device is not None
        with device.writing([slot for slot, _ in jobs]):
            fresh: list[tuple[int, str, bytes]] = []
            dests = []
            for slot, local in jobs:
                index = local.device.index if local.is_cuda else torch.cuda.current_device()
                nbytes = local.numel() * local.element_size()
                mem, handle = device.slot(slot, nbytes, index)
                if handle is not None:
                    fresh.append((slot, cuda_ipc.device_uuid(index), handle))
                dests.append((slot, mem, local, nbytes, torch.device("cuda", index)))
            if fresh:
                handles = [list(h) for h in fresh]
                try:
                    self._ctrl.request(
                        {"op": "put_handles", "volume_id": device.volume_id, "handles": handles}
                    )
                except BaseException:
                    device.release([slot for slot, _, _ in fresh])  # unknown to readers
                    raise
            with torch.no_grad():
                for slot, mem, local, nbytes, dev in dests:
                    mem.view(local.dtype).view(local.shape).copy_(local, non_blocking=True)
                    progress.add(slot, nbytes, dev)
            progress.synchronize()

    def _report(self, key: str, version: int, slots: list[int]) -> None:
        """Tell the controller these slots of a pending version are written."""
        self._ctrl.request(
            {"op": "put_progress", "key": key, "version": version, "writer": self._writer,
             "slots": slots}
        )  # fmt: skip

    def _tcp_write(self, address: str, jobs: list[tuple[int, torch.Tensor]]) -> None:
        pieces = []
        for slot, local in jobs:
            flat = local.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            for start in range(0, flat.numel(), _TCP_PIECE):
                pieces.append((slot, start, flat[start : start + _TCP_PIECE]))

        def send(piece: tuple[int, int, torch.Tensor]) -> None:
            slot, start, buf = piece
            header = {"op": "vol_write", "slot": slot, "offset": start, "nbytes": buf.numel()}
            with self._borrow(address) as conn:
                conn.request(header, buf.numpy().data)

        self._fan_out(send, pieces)

    # ================================================================== reads

    def _get(
        self,
        key: str,
        kind: str,
        dests: list[tuple[Path, torch.Tensor]] | None,
        version: int | Literal["latest"],
        wait: float | None = None,
        copy: bool = True,
    ) -> list[tuple[Path, torch.Tensor]]:
        _check_key(key)
        if version != "latest" and (not isinstance(version, int) or version < 0):
            raise ValueError(f"version must be a non-negative int or 'latest', got {version!r}")
        if wait is not None and (version == "latest" or wait < 0):
            raise ValueError("wait= needs a version number and a non-negative number of seconds")
        if not copy:
            if dests is not None:
                raise ValueError("copy=False returns views of the stored bytes; it takes no into=")
            return self._get_views(key, kind, version, wait)
        cached = self._meta.get(key)
        header = {
            "op": "acquire",
            "key": key,
            "version": version,
            "known_sig": cached[0] if cached else None,
            "wait_ms": None,
        }
        if wait is None:
            reply = self._ctrl.request(header)
            gate = None
        else:
            reply = self._acquire_waiting(header, time.monotonic() + wait)
            gate = (
                self._gate(key, int(version), time.monotonic() + wait, wait)
                if reply.get("pending")
                else None
            )
        held = True
        try:
            out = self._read(key, kind, dests, reply, cached, gate)
            if gate is not None:
                gate(None)  # returns once the version is committed (raises if it was not)
            held = False
            device = any(v[4] == "cuda" for v in reply["volumes"])
            try:
                lost = self._ctrl.request({"op": "release", "lease": reply["lease"]})["lost"]
            except StoreError:
                if device:  # the controller cannot confirm the GPU memory was still there
                    raise
                lost = False  # the controller drops the lease when this connection closes
            if lost and device:
                # Host segments keep their pages for mapped readers; freed GPU memory does not.
                raise VolumeLostError(
                    f"version {reply['version']} of key {key!r} was lost while it was read "
                    "(its writer's GPU memory went away); the destination holds undefined bytes"
                )
            return out
        finally:
            if held:
                _release_quietly(self._ctrl, reply["lease"])

    # -------------------------------------------------------- streaming reads

    def _waiter(self) -> Conn:
        """A second control connection for requests that block (waits must not hold up the
        puts and gets other threads send on the main one)."""
        with self._lock:
            if self._wait_conn is None or self._wait_conn.sock.fileno() < 0:
                self._wait_conn = Conn(self.address, self._token, self._timeout)
            return self._wait_conn

    def _acquire_waiting(self, header: dict[str, Any], deadline: float) -> dict[str, Any]:
        """acquire, asking the controller to wait (in slices shorter than the socket
        timeout) until the version has begun; raises VersionNotFoundError at the deadline."""
        while True:
            left = deadline - time.monotonic()
            chunk = max(0.0, min(left, self._timeout / 2))
            reply = self._waiter().request({**header, "wait_ms": int(chunk * 1000)})
            if not reply.get("waiting"):
                return reply
            if time.monotonic() >= deadline:
                raise VersionNotFoundError(
                    f"version {header['version']} of key {header['key']!r} was not written "
                    "within the wait"
                )

    def _gate(self, key: str, version: int, deadline: float, wait: float):
        """For a pending version: gate(slot) returns once that slot's bytes are in place;
        gate(None) once the version is committed. Raises if the version is aborted or the
        deadline passes."""
        written: set[int] = set()
        committed = False

        def gate(slot: int | None) -> None:
            nonlocal committed
            if committed or (slot is not None and slot in written):
                return
            while True:
                left = deadline - time.monotonic()
                chunk = max(0.0, min(left, self._timeout / 2))
                r = self._waiter().request(
                    {
                        "op": "wait",
                        "key": key,
                        "version": version,
                        "slots": [] if slot is None else [slot],
                        "wait_ms": int(chunk * 1000),
                    }
                )
                if r["done"]:
                    committed = r["committed"]
                    if slot is not None:
                        written.add(slot)
                    return
                if time.monotonic() >= deadline:
                    raise StoreError(
                        f"version {version} of key {key!r} was not completely written within "
                        f"{wait:g} s"
                    )

        return gate

    def _read(
        self,
        key: str,
        kind: str,
        dests: list[tuple[Path, torch.Tensor]] | None,
        reply: dict[str, Any],
        cached: tuple[str, dict[Path, _Stored]] | None = None,
        gate: Any = None,
    ) -> list[tuple[Path, torch.Tensor]]:
        """Copy from the version ``reply`` pinned; ``cached`` is the layout whose signature
        the request named (another thread may have replaced ``self._meta`` since)."""
        stored = self._layout(key, kind, reply, cached)
        # Destinations: given, or new full tensors.
        if dests is None:
            dests = [(n, torch.empty(s.shape, dtype=s.dtype)) for n, s in stored.items()]
        windows = []
        for path, dest in dests:
            s = stored.get(path)
            shown = layout.path_str(path) or key
            if s is None:
                missing = [layout.path_str(p) for p, _ in dests if p not in stored]
                raise KeyError(
                    f"version {reply['version']} of key {key!r} has no tensor {shown!r} "
                    f"({len(missing)} missing, e.g. {missing[:5]})"
                )
            gshape, offs, sizes, local = layout.window(dest)
            if gshape != s.shape or dest.dtype != s.dtype:
                raise ValueError(
                    f"{shown}: destination has global shape {list(gshape)} {dest.dtype}, "
                    f"stored version {reply['version']} of key {key!r} has {list(s.shape)} "
                    f"{s.dtype}"
                )
            windows.append((path, offs, sizes, local))
        plan_key = (key, reply["sig"], tuple((p, o, z) for p, o, z, _ in windows))
        plan = self._plans.get(plan_key)
        if plan is None:
            plan = _plan(stored, windows)
            with self._lock:
                self.plans_built += 1
                self._plans[plan_key] = plan
                while len(self._plans) > 256:
                    self._plans.popitem(last=False)
        self._execute(plan, windows, stored, reply, gate)
        return [(path, dest) for path, dest in dests]

    def _layout(
        self,
        key: str,
        kind: str,
        reply: dict[str, Any],
        cached: tuple[str, dict[Path, _Stored]] | None,
    ) -> dict[Path, _Stored]:
        """The stored layout of the version ``reply`` pinned: decoded from the reply, or the
        cached one the request's signature named."""
        if reply["kind"] != kind:
            other = "get_state_dict" if reply["kind"] == "state_dict" else "get"
            raise TypeError(f"key {key!r} holds a {reply['kind'].replace('_', ' ')}; use {other}")
        sig = reply["sig"]
        if "meta" in reply:
            self.metadata_fetches += 1
            self._segments.sweep()  # a new layout: slots of the old one may be gone
            stored: dict[Path, _Stored] = {}
            first = 0
            for name, shape, dtype, boxes in reply["meta"]:
                bx = [(tuple(o), tuple(s)) for o, s in boxes]
                stored[tuple(name)] = _Stored(tuple(shape), wire.DTYPES[dtype], bx, first)
                first += len(bx)
            self._meta[key] = (sig, stored)
            return stored
        assert cached is not None and cached[0] == sig, "controller skipped a stale layout"
        return cached[1]

    def _get_views(
        self, key: str, kind: str, version: int | Literal["latest"], wait: float | None
    ) -> list[tuple[Path, torch.Tensor]]:
        """A zero-copy read. Its lease is taken on the views connection, which stays open
        while any view is alive (even past ``close()``), so the version stays pinned."""
        if wait is not None:  # a read of no tensors returns once the version is committed
            self._get(key, kind, [], version, wait)
        conn = self._views_conn()
        cached = self._meta.get(key)
        reply = conn.request(
            {"op": "acquire", "key": key, "version": version,
             "known_sig": cached[0] if cached else None, "wait_ms": None}
        )  # fmt: skip
        try:
            return self._views(key, self._layout(key, kind, reply, cached), reply)
        except BaseException:
            _release_quietly(conn, reply["lease"])
            raise

    def _views_conn(self) -> Conn:
        """The connection zero-copy reads take their leases on (made before any exists)."""
        with self._views_lock:
            conn = self._view_conn
            if conn is None or conn.sock.fileno() < 0:
                conn = self._view_conn = Conn(self.address, self._token, self._timeout)
            return conn

    def _views(
        self, key: str, stored: dict[Path, _Stored], reply: dict[str, Any]
    ) -> list[tuple[Path, torch.Tensor]]:
        """Zero-copy read: read-only tensors over the pinned version's segments, which hold
        its lease until all of them are garbage (see ``tidal/store/views.py``)."""
        slots, vols, volumes = reply["slots"], reply["vols"], reply["volumes"]
        plan = []
        for path, s in stored.items():
            shown = layout.path_str(path) or key
            if len(s.boxes) > 1:
                raise ValueError(
                    f"copy=False: {shown!r} of version {reply['version']} of key {key!r} is "
                    f"stored in {len(s.boxes)} shards (several writers); a zero-copy view "
                    "needs one shard per tensor. Use copy=True"
                )
            if not s.boxes:  # no bytes (empty tensor)
                plan.append((path, s, None, ""))
                continue
            _, vaddr, vhost, prefix, vkind = volumes[vols[s.first]]
            slot = slots[s.first]
            if vkind == "cuda":
                raise ValueError(
                    f"copy=False: {shown!r} of key {key!r} is held in a writer's GPU memory "
                    "(put with memory='cuda'); use copy=True"
                )
            if not self._use_shm(vhost, prefix, slot):
                raise ValueError(
                    f"copy=False: {shown!r} of key {key!r} lives in the volume at {vaddr}, "
                    "whose shared memory this process cannot map (another host, or "
                    "transport='tcp'); use copy=True"
                )
            plan.append((path, s, slot, prefix))
        token = views._Lease()
        out = []
        for path, s, slot, prefix in plan:
            if slot is None:
                out.append((path, torch.empty(s.shape, dtype=s.dtype)))
                continue
            nbytes = layout.numel(s.shape) * s.dtype.itemsize
            mapping = self._segments.readonly(f"{prefix}{slot}", nbytes)
            out.append((path, views.alias(mapping, s.dtype, s.shape, token)))
        releaser = self._release_later()
        with self._views_lock:
            self._live_views += 1
        views.arm(token, releaser, reply["lease"])
        return out

    def _release_later(self) -> views.Releaser:
        with self._views_lock:
            if self._releaser is None:
                self._releaser = views.Releaser(self._release_lease)
            return self._releaser

    def _release_lease(self, lease: int) -> None:
        """Release a view's lease on the views connection (called by the releaser, possibly
        inside garbage collection: it takes no lock a store call may hold). After
        ``close()``, the last release closes the views connection."""
        conn = self._view_conn
        try:
            if conn is not None and conn.sock.fileno() >= 0:  # else the lease died with it
                conn.request({"op": "release", "lease": lease})
        finally:
            with self._views_lock:
                self._live_views -= 1
                last = self._closed and self._live_views == 0
            if last:
                self._close_views()

    def _close_views(self) -> None:
        if self._releaser is not None:
            self._releaser.close()
        if self._view_conn is not None:
            self._view_conn.close()

    def _execute(
        self,
        plan: list[_Op],
        windows: list[tuple[Path, Dims, Dims, torch.Tensor]],
        stored: dict[Path, _Stored],
        reply: dict[str, Any],
        gate: Any = None,
    ) -> None:
        slots, vols, volumes = reply["slots"], reply["vols"], reply["volumes"]
        dtypes = [stored[p].dtype for p, *_ in windows]
        shm_ops, dev_ops, tcp_ops = [], [], []
        for op in plan:
            _, vaddr, vhost, prefix, vkind = volumes[vols[op.shard]]
            if vkind == "cuda":
                dev_ops.append(op)
            elif self._use_shm(vhost, prefix, slots[op.shard]):
                shm_ops.append(op)
            else:
                tcp_ops.append((vaddr, op))
        if dev_ops and gate is None:
            self._open_device_slots(dev_ops, dtypes, reply)
        devices: set[torch.device] = set()  # CUDA devices with copies in flight
        with torch.no_grad():
            for op in shm_ops + dev_ops:
                vid, _, _, prefix, vkind = volumes[vols[op.shard]]
                if gate is not None:
                    gate(slots[op.shard])  # streaming: wait until the writer put it in place
                    if vkind == "cuda":  # a slot's handle is registered before it is written
                        self._open_device_slots([op], dtypes, reply)
                dtype = dtypes[op.dest]
                dst = layout.narrow(windows[op.dest][3], op.dst_off, op.sizes)
                if vkind == "cuda":
                    seg = self._imports.get(vid, slots[op.shard])
                    asynchronous = dst.is_cuda  # into host memory: a synchronous copy
                else:
                    n = layout.numel(op.shard_shape) * dtype.itemsize
                    seg = self._map(prefix, slots[op.shard], n)
                    asynchronous = dst.is_cuda and self._pin(prefix, slots[op.shard], seg)
                src = layout.narrow(seg.view(dtype).view(op.shard_shape), op.src_off, op.sizes)
                dst.copy_(src, non_blocking=asynchronous)
                if asynchronous:
                    devices.add(dst.device)
        for d in devices:  # the lease is released after this: the copies must be done
            torch.cuda.current_stream(d).synchronize()
        if tcp_ops:
            if gate is not None:
                for _, op in tcp_ops:
                    gate(slots[op.shard])
            self._tcp_read(tcp_ops, windows, dtypes, slots)

    def _open_device_slots(
        self, ops: list[_Op], dtypes: list[torch.dtype], reply: dict[str, Any]
    ) -> None:
        """Open (once) the CUDA IPC handles of the device slots ``ops`` read."""
        slots, vols, volumes = reply["slots"], reply["vols"], reply["volumes"]
        wanted: dict[str, dict[int, int]] = {}  # volume -> slot -> bytes
        for op in ops:
            vid, _, vhost, _, _ = volumes[vols[op.shard]]
            if cuda_ipc.is_local(vid):
                continue  # written by this process: read its tensors directly
            if vhost != self._host:
                raise StoreError(
                    f"version {reply['version']} is held in GPU memory of a writer on host "
                    f"{vhost.split('/')[0]} (put with memory='cuda'); CUDA IPC reaches readers "
                    "on that host only"
                )
            if not torch.cuda.is_available():
                raise StoreError(
                    f"version {reply['version']} is held in GPU memory (put with "
                    "memory='cuda'); reading it needs CUDA in this process"
                )
            n = layout.numel(op.shard_shape) * dtypes[op.dest].itemsize
            wanted.setdefault(vid, {})[slots[op.shard]] = n
        known = self._imports.volumes()
        if set(wanted) - known and known:
            # A writer this process has not read from yet: close what it holds open of
            # writers that are gone (their GPU memory stays allocated while it is open).
            alive = {v["volume"] for v in self._ctrl.request({"op": "volumes"})["volumes"]
                     if v["alive"]}  # fmt: skip
            self._imports.drop_volumes(known - alive)
        for vid, sizes in wanted.items():
            missing = self._imports.missing(vid, list(sizes))
            if not missing:
                continue
            got = self._ctrl.request({"op": "slot_handles", "volume_id": vid, "slots": missing})
            for slot, uuid, handle in got["handles"]:
                self._imports.add(vid, slot, uuid, handle, sizes[slot])

    def _tcp_read(
        self,
        ops: list[tuple[str, _Op]],
        windows: list[tuple[Path, Dims, Dims, torch.Tensor]],
        dtypes: list[torch.dtype],
        slots: list[int],
    ) -> None:
        pieces = []
        for address, op in ops:
            itemsize = dtypes[op.dest].itemsize
            row = layout.numel(op.sizes[1:]) * itemsize
            if op.sizes and row and op.sizes[0] * row > _TCP_PIECE:
                step = max(1, _TCP_PIECE // row)
                for r in range(0, op.sizes[0], step):
                    k = min(step, op.sizes[0] - r)
                    pieces.append(
                        (
                            address,
                            _Op(
                                op.dest, op.shard, op.shard_shape,
                                (op.src_off[0] + r, *op.src_off[1:]),
                                (op.dst_off[0] + r, *op.dst_off[1:]),
                                (k, *op.sizes[1:]),
                            ),
                        )
                    )  # fmt: skip
            else:
                pieces.append((address, op))

        def fetch(piece: tuple[str, _Op]) -> None:
            address, op = piece
            dtype = dtypes[op.dest]
            dst = layout.narrow(windows[op.dest][3], op.dst_off, op.sizes)
            direct = dst.is_contiguous() and dst.device.type == "cpu"
            buf = dst if direct else torch.empty(op.sizes, dtype=dtype)
            header = {
                "op": "vol_read",
                "slot": slots[op.shard],
                "shape": list(op.shard_shape),
                "itemsize": dtype.itemsize,
                "offsets": list(op.src_off),
                "sizes": list(op.sizes),
            }
            with self._borrow(address) as conn:
                conn.request(header, into=buf.reshape(-1).view(torch.uint8).numpy().data)
            if not direct:
                with torch.no_grad():
                    dst.copy_(buf)

        self._fan_out(fetch, pieces)

    # ================================================================== plumbing

    def _use_shm(self, vhost: str, prefix: str, slot: int | None) -> bool:
        """Same-host shared memory when allowed, the volume is here and its files are."""
        if self.transport == "tcp" or slot is None:
            return self.transport == "shm" and slot is not None
        ok = self._shm_ok.get(prefix)
        if ok is None:
            ok = vhost == self._host and os.access(f"{prefix}{slot}", os.R_OK | os.W_OK)
            self._shm_ok[prefix] = ok
        if not ok and self.transport == "shm":
            raise StoreError(
                f"transport='shm' but the volume's segments ({prefix}*) are not on this host"
            )
        return ok

    def _map(self, prefix: str, slot: int, nbytes: int) -> torch.Tensor:
        return self._segments.readwrite(f"{prefix}{slot}", nbytes)

    def _pin(self, prefix: str, slot: int, seg: torch.Tensor) -> bool:
        return self._segments.pin(f"{prefix}{slot}", seg)

    class _Borrowed:
        def __init__(self, store: Store, address: str) -> None:
            self.store, self.address = store, address

        def __enter__(self) -> Conn:
            with self.store._lock:
                pool = self.store._pools.setdefault(self.address, [])
                conn = pool.pop() if pool else None
            if conn is None:
                conn = Conn(self.address, self.store._token, self.store._timeout)
            self.conn = conn
            return conn

        def __exit__(self, exc_type: Any, *exc: object) -> None:
            if exc_type is None and self.conn.sock.fileno() >= 0:
                with self.store._lock:
                    self.store._pools.setdefault(self.address, []).append(self.conn)
            else:
                self.conn.close()

    def _borrow(self, address: str) -> Store._Borrowed:
        return Store._Borrowed(self, address)

    def _fan_out(self, fn: Any, pieces: Iterable[Any]) -> None:
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

    def _submit_copies(self, tensors: Any, fn: Any, *args: Any, **kwargs: Any) -> Future[Any]:
        """``_submit`` with the CUDA copies of ``fn`` on side streams, ordered after the
        caller's queued work on the devices of ``tensors`` (a tensor or state dict)."""
        cuda = streams.cuda_tensors(tensors)
        if not cuda:
            return self._submit(fn, *args, **kwargs)
        with self._lock:
            if self._streams is None:
                self._streams = streams.SideStreams()
        return self._submit(self._streams.wrap(lambda: fn(*args, **kwargs), cuda))

    def _submit(self, fn: Any, *args: Any, **kwargs: Any) -> Future[Any]:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(2, thread_name_prefix="tidal-async")
        return self._executor.submit(fn, *args, **kwargs)


def _release_quietly(conn: Conn, lease: int) -> None:
    """Release a lease on the way out of a failed read."""
    try:
        conn.request({"op": "release", "lease": lease})
    except StoreError:
        pass  # the controller drops the lease when this connection closes


def _plan(
    stored: dict[Path, _Stored], windows: list[tuple[Path, Dims, Dims, torch.Tensor]]
) -> list[_Op]:
    """For each destination window, the overlap with every stored shard."""
    ops = []
    for d, (path, offs, sizes, _) in enumerate(windows):
        s = stored[path]
        if layout.numel(sizes) == 0:
            continue
        for k, (b_off, b_size) in enumerate(s.boxes):
            if len(s.shape) == 0:
                ops.append(_Op(d, s.first + k, (), (), (), ()))
                continue
            hit = layout.intersect(offs, sizes, b_off, b_size)
            if hit is None:
                continue
            h_off, h_size = hit
            ops.append(
                _Op(
                    d,
                    s.first + k,
                    b_size,
                    tuple(a - b for a, b in zip(h_off, b_off, strict=True)),
                    tuple(a - b for a, b in zip(h_off, offs, strict=True)),
                    h_size,
                )
            )
    return ops


def _default_writers(largest_mesh: int) -> int:
    """SPMD default: with DTensors, every rank of the job puts (replicas included, they send
    no bytes); without, one process."""
    if largest_mesh == 0:
        return 1
    if dist.is_available() and dist.is_initialized():
        return max(largest_mesh, dist.get_world_size())
    return largest_mesh


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key or len(key) > 1024 or "\x00" in key:
        raise ValueError(f"key must be a non-empty string of at most 1024 characters: {key!r}")


def connect(
    address: str | None = None,
    *,
    token: str | None = None,
    transport: Transport | None = None,
    timeout: float = 60.0,
    keep: int = 2,
    volume: str | None = None,
    connections: int = 2,
) -> Store:
    """Connect to a tidal store, or start an embedded one.

    Resolution: ``address`` if given; else the ``TIDAL_STORE`` environment variable (set by
    launchers for the processes they start; ``TIDAL_STORE_TOKEN`` and
    ``TIDAL_STORE_TRANSPORT`` are read too); else an embedded store (controller and one
    shared-memory volume in background threads of this process, listening on a random
    loopback port) that lives until this handle is closed or the process exits. Pass
    ``store.address`` to spawned processes so they can connect to it.

    Args:
        address: ``tcp://host:port`` of a store started by ``tidal store serve``.
        token: shared secret, required when the store listens on a non-loopback address.
        transport: ``"auto"`` (shared memory for volumes on this host, TCP otherwise),
            ``"shm"`` or ``"tcp"`` to force one.
        timeout: seconds to wait for any reply before raising StoreError.
        keep: versions retained per key by an embedded store (ignored when connecting).
        volume: put this client's shards into the named volume instead of a local one.
        connections: TCP connections in flight per volume for bulk transfers.

    Returns:
        A :class:`Store` handle.

    Raises:
        StoreError: nothing listens at the address. AuthError: wrong token.

    Example::

        store = tidal.store.connect()            # embedded
        store.put("x", torch.ones(3))
        child_store = tidal.store.connect(store.address)
    """
    if address is None:
        address = os.environ.get("TIDAL_STORE") or None
        if token is None:
            token = os.environ.get("TIDAL_STORE_TOKEN") or None
    if transport is None:
        transport = os.environ.get("TIDAL_STORE_TRANSPORT", "auto")  # type: ignore[assignment]
    server = None
    if address is None:
        reap_stale()  # segments of embedded stores whose process was killed
        store_id = new_store_id()
        server = Server(
            controller=Controller(store_id, keep=keep),
            volume=Volume("v0", store_id),
            token=token,
        )
        weakref.finalize(server, server.close)
        address = server.address
    try:
        return Store(
            address,
            token=token,
            transport=transport,  # type: ignore[arg-type]
            timeout=timeout,
            volume=volume,
            connections=connections,
            _server=server,
        )
    except BaseException:
        if server is not None:
            server.close()
        raise
