"""The get path of a store handle: pin a version, copy the needed bytes, unpin it.

A get sends ``acquire`` (the controller pins a committed version with a lease and names its
slots; the full layout only when the client's cached signature is stale), copies the overlap
of each stored shard with each destination window straight into a view of the destination,
through the transport of the shard's volume (tidal/store/transports/), and sends
``release``. With ``wait=`` it streams a version while it is written: ``acquire`` waits on
the waiting connection until every writer has begun, then each slot is copied once its
writer reports it (tidal/store/waiting.py). With ``copy=False`` it returns read-only views
of the stored pages, whose lease lives until they are garbage (tidal/store/views.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Literal

import torch

from tidal.store import boxes, ops, views
from tidal.store.boxes import Path
from tidal.store.conn import Conn
from tidal.store.errors import StoreError, VersionNotFoundError, VolumeLostError
from tidal.store.plans import (
    PLAIN,
    Copy,
    ReadPlans,
    Stored,
    Window,
    check_strided,
    decode_layout,
    identity,
)
from tidal.store.session import Session
from tidal.store.transports import ReadJob
from tidal.store.transports.shm import path_of
from tidal.store.waiting import Gate, until

Version = int | Literal["latest"]


class Reader:
    def __init__(self, session: Session) -> None:
        self.s = session
        self._meta: dict[str, tuple[str, dict[Path, Stored]]] = {}
        self.plans = ReadPlans()
        self._bound: dict[str, BoundRead] = {}  # key -> its last read into caller tensors
        self._bound_lock = threading.Lock()
        self.reads_bound = 0  # BoundReads made (diagnostics: a steady reader makes one)
        self.metadata_fetches = 0  # layouts received (a steady reader receives none)
        self._releaser: views.Releaser | None = None
        self._views_lock = threading.Lock()  # never held around a request
        self.live_views = 0  # zero-copy reads whose views are still alive

    def get(
        self,
        key: str,
        kind: str,
        dests: list[tuple[Path, Any]] | None,
        version: Version,
        wait: float | None,
        copy: bool,
        cast: bool,
    ) -> tuple[list[tuple[Path, torch.Tensor]], dict[Path, Any]]:
        """Read ``key``; returns (path, tensor) pairs and the version's plain values."""
        if not copy:
            if dests is not None:
                raise ValueError("copy=False returns views of the stored bytes; it takes no into=")
            if wait is not None:  # a read of no tensors returns once the version is committed
                self.get(key, kind, [], version, wait, True, False)
            return self._views(key, kind, version)
        cached = self._meta.get(key)
        known = cached[0] if cached else None
        gate = None
        if wait is None:
            conn = self.s.main
            reply = _decoded(
                conn.request(ops.ACQUIRE, key=key, version=version, known_sig=known, wait_ms=None)
            )
        else:
            conn = self.s.waiter()
            deadline = time.monotonic() + wait
            reply = self._acquire_waiting(conn, key, version, known, deadline)
            if reply["pending"]:
                gate = Gate(self.s.waiter, key, int(version), deadline, wait)
        held = True
        try:
            out = self._read(key, kind, dests, reply, cached, gate, cast)
            if gate is not None:
                gate.committed()  # returns once the version is committed (raises if not)
            held = False
            self._release(conn, key, reply)
            return out, _objects(reply)
        finally:
            if held:
                release_quietly(conn, reply["lease"])

    def _acquire_waiting(
        self, conn: Conn, key: str, version: Version, known: str | None, deadline: float
    ) -> dict[str, Any]:
        """acquire, asking the controller to wait (in slices shorter than the socket
        timeout) until the version has begun; raises VersionNotFoundError at the deadline."""

        def attempt(wait_ms: int) -> dict[str, Any] | None:
            r = conn.request(
                ops.ACQUIRE, key=key, version=version, known_sig=known, wait_ms=wait_ms
            )
            return None if r["waiting"] else _decoded(r)

        return until(
            deadline,
            conn.timeout,
            attempt,
            lambda: VersionNotFoundError(
                f"version {version} of key {key!r} was not written within the wait"
            ),
        )

    def _release(self, conn: Conn, key: str, reply: dict[str, Any]) -> None:
        device = any(v.kind == "cuda" for v in reply["volumes"])
        try:
            lost = conn.request(ops.RELEASE, lease=reply["lease"])["lost"]
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

    def _layout(
        self,
        key: str,
        kind: str,
        reply: dict[str, Any],
        cached: tuple[str, dict[Path, Stored]] | None,
    ) -> dict[Path, Stored]:
        """The stored layout of the pinned version: decoded from the reply, or the cached
        one the request's signature named (another thread may have replaced it since)."""
        if reply["kind"] != kind:
            other = "get_state_dict" if reply["kind"] == "state_dict" else "get"
            raise TypeError(f"key {key!r} holds a {reply['kind'].replace('_', ' ')}; use {other}")
        if "meta" in reply:
            self.metadata_fetches += 1
            self.s.segments.sweep()  # a new layout: slots of the old one may be gone
            stored = decode_layout(reply["meta"])
            self._meta[key] = (reply["sig"], stored)
            return stored
        assert cached is not None and cached[0] == reply["sig"], "controller skipped a layout"
        return cached[1]

    def _read(
        self,
        key: str,
        kind: str,
        dests: list[tuple[Path, Any]] | None,
        reply: dict[str, Any],
        cached: tuple[str, dict[Path, Stored]] | None,
        gate: Gate | None,
        cast: bool,
    ) -> list[tuple[Path, torch.Tensor]]:
        stored = self._layout(key, kind, reply, cached)
        into_given = dests is not None
        if dests is None:
            dests = [(n, torch.empty(s.shape, dtype=s.dtype)) for n, s in stored.items()]
        else:
            dests = boxes.tensors_of(dests)
        bound = self._bound_read(key, reply, stored, dests, cast, keep=into_given)
        slots, vols, volumes = reply["slots"], reply["vols"], reply["volumes"]
        groups = bound.jobs(slots, vols)
        if gate is not None:
            gate.expect([j.slot for jobs in groups.values() for j in jobs])
        for v, jobs in groups.items():
            vol = volumes[v]
            self.s.transport_for(vol, jobs[0].slot).read(vol, jobs, gate)
        return dests

    def _bound_read(
        self,
        key: str,
        reply: dict[str, Any],
        stored: dict[Path, Stored],
        dests: list[tuple[Path, torch.Tensor]],
        cast: bool,
        keep: bool,
    ) -> BoundRead:
        """The read of ``key``'s stored layout into ``dests``: the one kept from the last
        read when it was into the same tensors (a steady reader checks identities and
        addresses, not shapes against the layout), else checked and planned anew."""
        kept = self._bound.get(key)
        if kept is not None and kept.fits(reply["sig"], dests, cast):
            return kept
        windows, dtypes = self._windows(key, reply, stored, dests, cast)
        plan = self.plans.get(key, reply["sig"], stored, windows)
        bound = BoundRead(reply["sig"], cast, dests, windows, dtypes, plan)
        self.reads_bound += 1
        if keep and bound.keepable:
            with self._bound_lock:
                self._bound.pop(key, None)
                while len(self._bound) >= MAX_BOUND:
                    del self._bound[next(iter(self._bound))]  # the least recently bound
                self._bound[key] = bound
        return bound

    def _windows(
        self,
        key: str,
        reply: dict[str, Any],
        stored: dict[Path, Stored],
        dests: list[tuple[Path, torch.Tensor]],
        cast: bool,
    ) -> tuple[list[Window], list[torch.dtype]]:
        """Each destination's window and stored dtype, checked against the stored layout."""
        windows: list[Window] = []
        dtypes = []
        for path, dest in dests:
            check_strided(path, dest)
            s = stored.get(path)
            if s is None:
                shown = boxes.path_str(path) or key
                missing = [boxes.path_str(p) for p, _ in dests if p not in stored]
                raise KeyError(
                    f"version {reply['version']} of key {key!r} has no tensor {shown!r} "
                    f"({len(missing)} missing, e.g. {missing[:5]})"
                )
            gshape, offs, sizes, local = boxes.window(dest)
            if gshape != s.shape or (dest.dtype != s.dtype and not cast):
                shown = boxes.path_str(path) or key
                hint = "; pass cast=True to convert" if gshape == s.shape else ""
                raise ValueError(
                    f"{shown}: destination has global shape {list(gshape)} {dest.dtype}, "
                    f"stored version {reply['version']} of key {key!r} has {list(s.shape)} "
                    f"{s.dtype}{hint}"
                )
            windows.append((path, offs, sizes, local))
            dtypes.append(s.dtype)
        return windows, dtypes

    # -------------------------------------------------------- zero-copy reads

    def _views(self, key: str, kind: str, version: Version) -> tuple[list, dict[Path, Any]]:
        """A zero-copy read. Its lease is taken on the views connection, which stays open
        while any view is alive (even past ``close()``), so the version stays pinned."""
        conn = self.s.views_conn()
        cached = self._meta.get(key)
        reply = _decoded(
            conn.request(
                ops.ACQUIRE,
                key=key,
                version=version,
                known_sig=cached[0] if cached else None,
                wait_ms=None,
            )
        )
        try:
            stored = self._layout(key, kind, reply, cached)
            return self._alias(key, stored, reply), _objects(reply)
        except BaseException:
            release_quietly(conn, reply["lease"])
            raise

    def _alias(
        self, key: str, stored: dict[Path, Stored], reply: dict[str, Any]
    ) -> list[tuple[Path, torch.Tensor]]:
        """Tensors over the pinned version's memory, which hold its lease until all of
        them are garbage (see tidal/store/views.py): read-only views of shared-memory
        segments, or views of a writer's GPU memory opened with CUDA IPC."""
        slots, vols, volumes = reply["slots"], reply["vols"], reply["volumes"]
        shm: list[tuple[Path, Stored, str | None]] = []
        gpu: dict[int, list[tuple[Path, Stored]]] = {}  # by volume index
        for path, s in stored.items():
            if len(s.boxes) > 1:
                shown = boxes.path_str(path) or key
                raise ValueError(
                    f"copy=False: {shown!r} of version {reply['version']} of key {key!r} is "
                    f"stored in {len(s.boxes)} shards (several writers); a zero-copy view "
                    "needs one shard per tensor. Use copy=True"
                )
            if not s.boxes:  # no bytes (empty tensor)
                shm.append((path, s, None))
                continue
            vol = volumes[vols[s.first]]
            if vol.kind == "cuda":
                gpu.setdefault(vols[s.first], []).append((path, s))
                continue
            if self.s.transport == "tcp" or not self.s.shm.reaches(vol):
                shown = boxes.path_str(path) or key
                raise ValueError(
                    f"copy=False: {shown!r} of key {key!r} lives in the volume at "
                    f"{vol.address}, whose shared memory this process cannot map (another "
                    "host, or transport='tcp'); use copy=True"
                )
            shm.append((path, s, path_of(vol, slots[s.first])))
        token = views.Lease()
        out: dict[Path, torch.Tensor] = {}
        for path, s, seg in shm:
            if seg is None:
                out[path] = torch.empty(s.shape, dtype=s.dtype)
                continue
            mapping = self.s.segments.readonly(seg, boxes.numel(s.shape) * s.dtype.itemsize)
            out[path] = views.alias(mapping, s.dtype, s.shape, token)
        devices: set[int] = set()
        for v, group in gpu.items():
            items = [(slots[s.first], s.dtype, s.shape) for _, s in group]
            tensors = self.s.cuda().views(volumes[v], items, token)
            out.update(zip([p for p, _ in group], tensors, strict=True))
            devices.update(t.device.index for t in tensors)
        with self._views_lock:
            if self._releaser is None:
                self._releaser = views.Releaser(self._release_view)
            releaser = self._releaser
            self.live_views += 1
        views.arm(token, releaser, reply["lease"], sorted(devices))
        return [(path, out[path]) for path in stored]

    def _release_view(self, lease: int) -> None:
        """Release a view's lease on the views connection (called by the releaser, possibly
        inside garbage collection: it takes no lock a store call may hold). After
        ``close()``, the last release closes the views connection."""
        try:
            conn = self.s.existing("views")
            if conn is not None and conn.connected:  # else the lease died with the connection
                conn.request(ops.RELEASE, lease=lease)
        finally:
            with self._views_lock:
                self.live_views -= 1
                last = self.s.closed and self.live_views == 0
            if last:
                self.close_views()

    def views_alive(self) -> bool:
        with self._views_lock:
            return self.live_views > 0

    def forget_reads(self) -> None:
        """Drop the kept reads (and the caller tensors they hold)."""
        with self._bound_lock:
            self._bound.clear()

    def close_views(self) -> None:
        if self._releaser is not None:
            self._releaser.close()
        self.s.close_views()


MAX_BOUND = 8  # bound reads kept per handle (one per key; the oldest bound goes first)


class BoundRead:
    """One key's read into one set of destination tensors: their windows, the read plan
    and, per slot assignment of the stored version, the jobs for the transports.

    A steady reader (an RL generator reading each new version into its own weights) reads
    the same layout into the same tensors every time; checking that costs a few C-level
    tuple comparisons instead of a window, a shape check and a job per tensor. The kept
    read holds its destination tensors (so their ids cannot be reused while it is kept)
    and is used again only when they are the same objects, at the same addresses, with the
    same shapes, under the same names. Reads into DTensors are not kept (their windows depend
    on the mesh, not only on the local tensor), nor reads that allocate their destinations.
    A handle keeps the reads of its last ``MAX_BOUND`` keys, and with them their tensors.
    """

    def __init__(
        self,
        sig: str,
        cast: bool,
        dests: list[tuple[Path, torch.Tensor]],
        windows: list[Window],
        dtypes: list[torch.dtype],
        plan: list[Copy],
    ) -> None:
        self.sig, self.cast = sig, cast
        self.windows, self.dtypes, self.plan = windows, dtypes, plan
        self.paths = tuple([p for p, _ in dests])
        self.tensors = [t for _, t in dests]
        self.ids = identity(self.tensors)
        self.keepable = self.ids is not None and all(type(t) in PLAIN for t in self.tensors)
        self._jobs: dict[tuple[tuple[Any, ...], tuple[Any, ...]], dict[int, list[ReadJob]]] = {}

    def fits(self, sig: str, dests: list[tuple[Path, torch.Tensor]], cast: bool) -> bool:
        if sig != self.sig or cast != self.cast or len(dests) != len(self.tensors):
            return False
        ids = identity([t for _, t in dests])
        return ids is not None and ids == self.ids and tuple([p for p, _ in dests]) == self.paths

    def jobs(self, slots: list[Any], vols: list[int]) -> dict[int, list[ReadJob]]:
        """The transports' jobs, by volume index, for a version stored in ``slots``."""
        at = (tuple(slots), tuple(vols))
        groups = self._jobs.get(at)
        if groups is not None:
            return groups
        groups = {}
        for c in self.plan:
            local = self.windows[c.dest][3]
            dst = local if c.whole_dst else boxes.narrow(local, c.dst_off, c.sizes)
            job = ReadJob(
                slots[c.shard],
                c.shard_shape,
                self.dtypes[c.dest],
                c.src_off,
                c.sizes,
                dst,
                c.whole_src,
            )
            groups.setdefault(vols[c.shard], []).append(job)
        if len(self._jobs) >= 8:  # a key's retention keeps a few slot sets in turn
            self._jobs.clear()
        self._jobs[at] = groups
        return groups


def release_quietly(conn: Conn, lease: int) -> None:
    """Release a lease on the way out of a failed read."""
    try:
        conn.request(ops.RELEASE, lease=lease)
    except (StoreError, ValueError):
        pass  # the controller drops the lease when this connection closes


def _objects(reply: dict[str, Any]) -> dict[Path, Any]:
    return {tuple(o["name"]): o["value"] for o in reply.get("objects", [])}


def _decoded(reply: dict[str, Any]) -> dict[str, Any]:
    """An ``acquire`` reply with its volume records decoded, once, where it arrives."""
    if "volumes" in reply:
        reply["volumes"] = [ops.VolumeInfo.decode(v) for v in reply["volumes"]]
    return reply
