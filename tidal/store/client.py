"""The tidal.store client API: ``connect()`` and the :class:`Store` handle.

Lifecycle: every process that reads or writes calls ``connect()`` once and keeps the handle.
A handle (tidal/store/session.py) holds its connections to the controller, its transports
(shared memory, TCP, CUDA IPC; tidal/store/transports/) and its caches of put plans and read
plans. Puts run through tidal/store/writer.py, gets through tidal/store/reader.py; this
module checks the arguments and documents the API.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch

from tidal.store import boxes, embedded, ops, streams
from tidal.store import volume as volume_mod
from tidal.store.boxes import Path
from tidal.store.reader import Reader
from tidal.store.server import Server
from tidal.store.session import Session, TransportChoice
from tidal.store.writer import Writer

Memory = Literal["host", "cuda"]
Version = int | Literal["latest"]


class Store:
    """A handle to a tidal store. Create it with :func:`connect`.

    Blocking methods: ``put``, ``get``, ``put_state_dict``, ``get_state_dict``, ``keys``,
    ``versions``, ``exists``, ``delete``, ``ls``, ``close``. Non-blocking variants
    ``put_async``, ``get_async``, ``put_state_dict_async``, ``get_state_dict_async`` return a
    ``concurrent.futures.Future`` (wrap with ``asyncio.wrap_future`` to await it); sources
    must not be modified, nor destinations read, until the future is done.
    A handle is thread-safe. After a timeout or a restart of the store's server, the next
    call reconnects (or raises StoreError saying the store cannot be reached).
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        transport: TransportChoice = "auto",
        timeout: float = 60.0,
        volume: str | None = None,
        connections: int = 2,
        _server: Server | None = None,
    ) -> None:
        if transport not in ("auto", "shm", "tcp", "nixl"):
            raise ValueError(f"transport must be 'auto', 'shm', 'tcp' or 'nixl', got {transport!r}")
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.address = address
        self.transport = transport
        self._server = _server
        self._s = Session(
            address,
            token=token,
            timeout=timeout,
            transport=transport,
            volume=volume,
            connections=connections,
        )
        self._writer = Writer(self._s)
        self._reader = Reader(self._s)
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._streams: streams.SideStreams | None = None

    @property
    def session(self) -> Session:
        """This connection's transports (`session.shm`, `session.tcp`, `session.nixl()`) and
        caches, for tools and tests that inspect how a get travelled."""
        return self._s

    @property
    def metadata_fetches(self) -> int:
        """Layouts received from the controller (a repeated get of new versions of the same
        layout receives none)."""
        return self._reader.metadata_fetches

    @property
    def plans_built(self) -> int:
        """Read plans computed (a repeated get into the same destination computes none)."""
        return self._reader.plans.built

    @property
    def plans_declared(self) -> int:
        """Put plans declared (a repeated put of the same layout declares none)."""
        return self._writer.declared

    # ================================================================== writes

    def put(
        self,
        key: str,
        value: torch.Tensor,
        *,
        version: int | None = None,
        writers: int | None = None,
        keep: int | None = None,
        memory: Memory = "host",
        dtype: torch.dtype | None = None,
    ) -> int:
        """Store a tensor, or this process's shard of a DTensor, as ``version`` of ``key``.

        Every process holding a shard of a DTensor calls ``put`` with the same key and
        version; each sends only its local shard and its box in the global tensor (a shard
        already sent by a replica is skipped). The version becomes visible to readers when
        all ``writers`` have put.

        Args:
            key: name of the value, e.g. ``"policy/lm_head"``.
            value: a CPU or CUDA tensor or DTensor (any dtype in ``wire.DTYPES``, any
                strides).
            version: integer version; None picks the next one (single writer only).
            writers: processes that put this version; for a DTensor, defaults to the world
                size of the default process group (every rank puts, SPMD style) or the
                mesh size without one; 1 for a plain tensor.
            keep: how many committed versions of ``key`` to retain (default: the store's).
            memory: where the stored copy lives: ``"host"`` (shared memory of a volume,
                readable from any host) or ``"cuda"`` (this process's GPU memory, read by
                processes on this host through CUDA IPC, device to device; it lives as long
                as this store handle). See ``tidal/store/transports/cuda/ipc.py``.
            dtype: store a floating point value as this dtype (cast while copying, no
                temporary copy), e.g. ``torch.bfloat16`` from an fp32 trainer.

        Returns:
            The version number written.

        Raises:
            ValueError: the version already exists, or writers disagree on shape/dtype;
                ``memory="cuda"`` without a CUDA device; a bad argument.
            TypeError: ``value`` is not a tensor, or ``key`` holds a state dict.
            StoreError: the store or a volume cannot be reached.

        Example::

            store = tidal.store.connect()
            v = store.put("w", torch.randn(4, 4))
        """
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor or DTensor, got {type(value).__name__}")
        return self._put(key, "tensor", [((), value)], version, writers, keep, memory, dtype)

    def put_state_dict(
        self,
        state_dict: Mapping[str, Any],
        key: str,
        *,
        version: int | None = None,
        writers: int | None = None,
        keep: int | None = None,
        memory: Memory = "host",
        dtype: torch.dtype | None = None,
    ) -> int:
        """Store a nested state dict of tensors, DTensors and plain values as one version.

        One call for the whole model: every tensor's local shard goes to a volume on this
        host; the version becomes visible when every writer has put all its tensors. Plain
        values (None, bool, int, float, str, bytes, and lists or dicts of them: a step
        number, a config) travel with it as msgpack, never pickled.

        Args:
            state_dict: nested dicts/lists whose leaves are tensors, DTensors or plain values.
            key: name of the state dict, e.g. ``"policy"``.
            version: integer version; None picks the next one (single writer only).
            writers: processes that put this version; with DTensors in the state dict,
                defaults to the world size of the default process group (every rank puts,
                SPMD style; pipeline stages included) or the largest mesh without one;
                1 for a state dict of plain tensors. Pass it when only some ranks put.
            keep: committed versions of ``key`` to retain (default: the store's).
            memory: ``"host"`` or ``"cuda"`` (this process's GPU memory, shared with readers
                on this host by CUDA IPC; see ``put``).
            dtype: store floating point tensors as this dtype, cast while copying (an fp32
                trainer publishing bf16 weights makes no temporary copy).

        Returns:
            The version number written.

        Raises:
            TypeError: a leaf is neither a tensor nor a plain value, or ``key`` holds a
                single tensor.
            ValueError: the version exists, or writers disagree on a tensor's shape/dtype.

        Example::

            store.put_state_dict(model.state_dict(), "policy", version=step)
            store.put_state_dict({"model": sd, "step": step}, "ckpt", dtype=torch.bfloat16)
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        items = boxes.flatten(state_dict)
        return self._put(key, "state_dict", items, version, writers, keep, memory, dtype)

    def _put(
        self,
        key: str,
        kind: str,
        items: list[tuple[Path, Any]],
        version: int | None,
        writers: int | None,
        keep: int | None,
        memory: Memory,
        dtype: torch.dtype | None,
    ) -> int:
        self._s.check_open()
        _check_key(key)
        if version is not None:
            _check_count("version", version, 0)
        if writers is not None:
            _check_count("writers", writers, 1)
        if keep is not None:
            _check_count("keep", keep, 1)
        if memory not in ("host", "cuda"):
            raise ValueError(f"memory must be 'host' or 'cuda', got {memory!r}")
        if dtype is not None and (
            not isinstance(dtype, torch.dtype) or not dtype.is_floating_point
        ):
            raise ValueError(f"dtype must be a floating point torch.dtype, got {dtype!r}")
        return self._writer.put(
            key,
            kind,
            items,
            version=version,
            writers=writers,
            keep=keep,
            memory=memory,
            dtype=dtype,
        )

    # ================================================================== reads

    def get(
        self,
        key: str,
        into: torch.Tensor | None = None,
        *,
        version: Version = "latest",
        wait: float | None = None,
        copy: bool = True,
        cast: bool = False,
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
                Needs the value stored as one shard in a volume on this host. A value
                put with ``memory="cuda"`` comes back as a view of the writer's GPU
                memory (CUDA IPC), which cannot be made read-only: never write to it, and
                drop it before the writer's store closes (tidal/store/views.py).
            cast: convert to ``into``'s dtype when it differs from the stored one (else a
                dtype mismatch is an error).

        Returns:
            ``into`` (filled) or a new tensor.

        Raises:
            KeyNotFoundError / VersionNotFoundError (both KeyError): unknown key, or a
                version never written, evicted or deleted.
            ValueError: ``into`` has another global shape, or another dtype without
                ``cast``; ``copy=False`` with ``into``, or for a value that is not one shard
                in memory on this host.
            TypeError: ``key`` holds a state dict (use ``get_state_dict``).
            VolumeLostError: the volume holding the bytes went away.

        Example::

            w = store.get("w")                       # full tensor
            store.get("w", into=dtensor_shard)       # resharded in place
            w = store.get("w", copy=False)           # zero-copy, read-only
        """
        if into is not None and not isinstance(into, torch.Tensor):
            raise TypeError(f"into must be a tensor or DTensor, got {type(into).__name__}")
        dests: list[tuple[Path, Any]] | None = None if into is None else [((), into)]
        out, _ = self._get(key, "tensor", dests, version, wait, copy, cast)
        return out[0][1]

    def get_state_dict(
        self,
        key: str,
        into: Mapping[str, Any] | None = None,
        *,
        version: Version = "latest",
        wait: float | None = None,
        copy: bool = True,
        cast: bool = False,
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
                the store's shared memory, or views of the writer's GPU memory for a put
                with ``memory="cuda"``, holding the version until every one of them is
                garbage (see ``get``). Needs every tensor stored as one shard (one writer)
                in a volume on this host.
            cast: convert each tensor to its destination's dtype where they differ.

        Returns:
            A new nested dict: with ``into``, its tensors (now filled) and its plain values,
            the stored plain values replacing them; without, full tensors and the stored
            plain values.

        Raises:
            KeyError: unknown key or version, or a tensor of ``into`` missing in the store.
            ValueError: a tensor of ``into`` has another global shape, or another dtype
                without ``cast``; ``copy=False`` with ``into`` or for tensors it cannot alias.

        Example::

            store.get_state_dict("policy", into=generator_model.state_dict())
            weights = store.get_state_dict("policy", copy=False)   # zero-copy, read-only
            cpu_model.load_state_dict(weights, assign=True)        # runs on the store's pages
        """
        if into is not None and not isinstance(into, Mapping):
            raise TypeError(f"into must be a mapping, got {type(into).__name__}")
        dests = None if into is None else boxes.flatten(into)
        tensors, objects = self._get(key, "state_dict", dests, version, wait, copy, cast)
        leaves = dict(dests) if dests is not None else {}
        leaves.update(tensors)
        leaves.update(objects)
        return boxes.unflatten(list(leaves.items()))

    def _get(
        self,
        key: str,
        kind: str,
        dests: list[tuple[Path, Any]] | None,
        version: Version,
        wait: float | None,
        copy: bool,
        cast: bool,
    ) -> tuple[list[tuple[Path, torch.Tensor]], dict[Path, Any]]:
        self._s.check_open()
        _check_key(key)
        if version != "latest":
            _check_count("version", version, 0, "a non-negative int or 'latest'")
        if wait is not None and (
            version == "latest" or not isinstance(wait, int | float) or wait < 0
        ):
            raise ValueError("wait= needs a version number and a non-negative number of seconds")
        return self._reader.get(key, kind, dests, version, wait, copy, cast)

    # ================================================================== async

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

    def _submit_copies(
        self, tensors: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Future[Any]:
        """Run ``fn`` in a background thread, with its CUDA copies on side streams ordered
        after the caller's queued work on the devices of ``tensors``."""
        self._s.check_open()
        cuda = streams.cuda_tensors(tensors)
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(2, thread_name_prefix="tidal-async")
            if cuda and self._streams is None:
                self._streams = streams.SideStreams()
            executor, side = self._executor, self._streams
        if not cuda or side is None:
            return executor.submit(fn, *args, **kwargs)
        return executor.submit(side.wrap(lambda: fn(*args, **kwargs), cuda))

    # ================================================================== queries

    def keys(self, prefix: str = "") -> list[str]:
        """Keys with at least one committed version that start with ``prefix``, sorted.

        Example: ``store.keys("policy/")`` -> ``["policy/lm_head", "policy/trunk"]``.
        """
        self._s.check_open()
        return self._s.main.request(ops.KEYS, prefix=_check_prefix(prefix))["keys"]

    def versions(self, key: str) -> list[int]:
        """Committed (readable) versions of ``key``, oldest first.

        Raises KeyNotFoundError for an unknown key. Example: ``store.versions("w")`` ->
        ``[6, 7]`` with ``keep=2``.
        """
        self._s.check_open()
        _check_key(key)
        return self._s.main.request(ops.VERSIONS, key=key)["versions"]

    def exists(self, key: str, version: int | None = None) -> bool:
        """Whether ``key`` (or that version of it) is committed and readable; never raises
        for unknown keys. Example: ``store.exists("w", 7)``."""
        self._s.check_open()
        _check_key(key)
        if version is not None:
            _check_count("version", version, 0)
        return self._s.main.request(ops.EXISTS, key=key, version=version)["exists"]

    def delete(self, key: str, version: int | None = None) -> int:
        """Delete one version, or every version of ``key``; returns how many went.

        Readers already copying a deleted version finish with its bytes; later reads get
        VersionNotFoundError. Memory is freed once the last such reader is done.

        Raises:
            KeyNotFoundError / VersionNotFoundError: nothing to delete.

        Example: ``store.delete("w", version=3)``; ``store.delete("w")`` (all versions).
        """
        self._s.check_open()
        _check_key(key)
        if version is not None:
            _check_count("version", version, 0)
        return self._s.main.request(ops.DELETE, key=key, version=version)["deleted"]

    def ls(self, prefix: str = "") -> dict[str, Any]:
        """What the store holds, for tools (``tidal store ls`` prints it).

        Returns:
            ``{"entries": [{key, version, kind, tensors, shards, bytes, volumes}],
            "volumes": [{volume, kind, host, address, alive}]}`` for committed versions of
            keys starting with ``prefix``.

        Example: ``sum(e["bytes"] for e in store.ls("policy")["entries"])``.
        """
        self._s.check_open()
        reply = self._s.main.request(ops.LS, prefix=_check_prefix(prefix))
        return {"entries": reply["entries"], "volumes": reply["volumes"]}

    def close(self) -> None:
        """Close connections and unmap segments; an embedded store also shuts down.
        Zero-copy views stay valid (and keep their version) until they are garbage."""
        if self._s.closed:
            return
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._reader.forget_reads()
        views_alive = self._reader.views_alive()
        self._s.close(keep_views=views_alive)
        if not views_alive:  # else the last view's release closes them
            self._reader.close_views()
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key or len(key) > 1024 or "\x00" in key:
        raise ValueError(f"key must be a non-empty string of at most 1024 characters: {key!r}")


def _check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or len(prefix) > 1024 or "\x00" in prefix:
        raise ValueError(f"prefix must be a string of at most 1024 characters: {prefix!r}")
    return prefix


_HIGHEST = {"version": 1 << 62, "keep": 1 << 20, "writers": 1 << 20}  # the wire's limits


def _check_count(name: str, value: Any, lo: int, what: str | None = None) -> None:
    hi = _HIGHEST[name]
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        what = what or f"an int in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {what}, got {value!r}")


def connect(
    address: str | None = None,
    *,
    token: str | None = None,
    transport: TransportChoice | None = None,
    timeout: float = 60.0,
    keep: int = 2,
    volume: str | None = None,
    connections: int = 2,
    reserve: int | Mapping[str, Any] = 0,
) -> Store:
    """Connect to a tidal store, or start an embedded one.

    Resolution: ``address`` if given; else the ``TIDAL_STORE`` environment variable (set by
    launchers for the processes they start; ``TIDAL_STORE_TOKEN`` is read with it, and
    ``TIDAL_STORE_TRANSPORT`` when ``transport`` is not given); else an embedded store
    (controller and one shared-memory volume in background threads of this process,
    listening on a random loopback port) that lives until this handle is closed or the
    process exits. Pass ``store.address`` to spawned processes so they can connect to it.

    Args:
        address: ``tcp://host:port`` of a store started by ``tidal store serve``.
        token: shared secret, required when the store listens on a non-loopback address.
        transport: ``"auto"`` (shared memory for volumes on this host; for others NIXL
            when installed, ``tidal[nixl]``, else TCP), ``"shm"``, ``"tcp"`` or ``"nixl"``
            to force one (``"nixl"`` reads volumes on this host by NIXL too; StoreError
            at once if NIXL is not installed).
        timeout: seconds to wait for any reply before raising StoreError.
        keep: versions retained per key by an embedded store (ignored when connecting).
        volume: put this client's shards into the named volume instead of a local one.
        connections: TCP connections in flight per volume for bulk transfers.
        reserve: shared memory an embedded store allocates at start for new slots (ignored
            when connecting): bytes, or a state dict whose first put it is sized for (one
            file per part it will need: that put then faults in no page). The first put
            of a new key writes into memory that exists instead of faulting it in; slots
            freed later refill it up to this size (tidal/store/reserve.py).

    Returns:
        A :class:`Store` handle.

    Raises:
        StoreError: nothing listens at the address. AuthError: wrong token.
        ValueError: a malformed address or argument.

    Example::

        store = tidal.store.connect()            # embedded
        store.put("x", torch.ones(3))
        child_store = tidal.store.connect(store.address)
    """
    _check_count("keep", keep, 1)
    if address is None:
        address = os.environ.get("TIDAL_STORE") or None
        if token is None:
            token = os.environ.get("TIDAL_STORE_TOKEN") or None
    if transport is None:
        transport = os.environ.get("TIDAL_STORE_TRANSPORT", "auto")  # type: ignore[assignment]
    server = None
    if address is None:
        sizes = reserve if isinstance(reserve, int) else volume_mod.reserve_for(reserve)
        server = embedded.start(keep=keep, token=token, reserve=sizes)
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
