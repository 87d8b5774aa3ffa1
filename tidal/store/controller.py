"""Controller: the store's metadata, and nothing else.

key -> version -> tensors -> shards (volume, slot, box in the global tensor). It also hands
out slots (reusing freed ones as a ring per key), counts reader leases, applies retention and
notices lost volumes. It never touches tensor bytes.

Lifecycle: one controller per store, inside the process that runs ``tidal store serve`` or
the embedded store. The server's connection threads call its methods; one lock guards all
state. Each method takes the id of the calling connection so that leases and half-written
versions die with the connection that held them.

Consistency model:
- A version becomes visible when every expected writer has committed and its shards tile
  each tensor exactly.
- A slot holds one version's bytes. It is reused (for a later version) only after its
  version was dropped and every lease on that version was released, so a reader holding a
  lease on version v reads bytes of v only.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.store import layout, wire
from tidal.store.errors import KeyNotFoundError, StoreError, VersionNotFoundError, VolumeLostError

Name = tuple[Any, ...]


@dataclass(slots=True)
class ShardRec:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    slot: int  # -1: empty shard, no bytes
    volume: str
    nbytes: int


@dataclass(slots=True)
class TensorRec:
    shape: tuple[int, ...]
    dtype: str
    shards: list[ShardRec] = field(default_factory=list)


@dataclass(slots=True)
class VersionRec:
    version: int
    kind: str
    writers: int
    keep: int
    seen: dict[str, int] = field(default_factory=dict)  # writer -> connection id
    done: set[str] = field(default_factory=set)
    tensors: dict[Name, TensorRec] = field(default_factory=dict)
    committed: bool = False
    written: set[int] = field(default_factory=set)  # slots whose bytes are in (streaming reads)
    leases: int = 0
    dropped: str | None = None  # why the version is gone (evicted, deleted, lost)
    destroy: bool = False  # free its slots for good (not into the ring) once unleased
    sig: str = ""

    def slots(self) -> list[ShardRec]:
        return [s for t in self.tensors.values() for s in t.shards if s.slot >= 0]


@dataclass(slots=True)
class KeyRec:
    kind: str
    keep: int | None = None  # retention set by a put for this key (sticky), else the store's
    versions: dict[int, VersionRec] = field(default_factory=dict)
    next_version: int = 0
    # Freed slots waiting for reuse: (volume, name, nbytes) -> slot ids.
    free: dict[tuple[str, Name, int], list[int]] = field(default_factory=dict)
    gone: OrderedDict[int, str] = field(default_factory=OrderedDict)  # dropped versions


@dataclass(slots=True)
class VolumeRec:
    volume_id: str
    address: str
    host: str
    shm_prefix: str
    create: Callable[[int, int], None]
    destroy: Callable[[list[int]], None]
    probe: Callable[[], bool]  # False once the volume is known dead
    cleanup: Callable[[], None] = lambda: None  # after death: unlink what it left behind
    alive: bool = True
    used: int = 0
    kind: str = "shm"  # "shm": host shared memory; "cuda": a writer's GPU memory (CUDA IPC)
    owner: int | None = None  # "cuda": the connection of the writer whose memory it is
    handles: dict[int, tuple[str, bytes]] = field(default_factory=dict)  # "cuda": slot ->
    # (GPU uuid, IPC handle)
    freed: list[int] = field(default_factory=list)  # "cuda": destroyed, owner not yet told


@dataclass(slots=True)
class Lease:
    key: str
    vrec: VersionRec
    conn: int


class Controller:
    """Metadata service. Every public method is called with the caller's connection id."""

    def __init__(self, store_id: str, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.store_id = store_id
        self.keep = keep
        self._lock = threading.RLock()
        # Woken on every change a streaming reader may wait for: a version begun, slots
        # written, a commit, a drop.
        self._changed = threading.Condition(self._lock)
        self._keys: dict[str, KeyRec] = {}
        self._volumes: dict[str, VolumeRec] = {}
        self._slot_owner: dict[int, tuple[str, int]] = {}  # slot -> (volume id, nbytes)
        self._next_slot = 1
        self._leases: dict[int, Lease] = {}
        self._next_lease = 1
        # (key, version) -> until when a streaming reader waits for it (monotonic seconds):
        # writers of such a version report their progress, others need not.
        self._wanted: dict[tuple[str, int], float] = {}

    # ---------------------------------------------------------------- volumes

    def add_volume(self, rec: VolumeRec) -> None:
        with self._lock:
            old = self._volumes.get(rec.volume_id)
            if old is not None and old.alive:
                raise ValueError(f"a volume named {rec.volume_id!r} is already registered")
            self._volumes[rec.volume_id] = rec

    def add_device_volume(self, conn: int, volume_id: str, host: str) -> None:
        """Register a writer's GPU memory as a volume of kind "cuda", owned by (and dying
        with) connection ``conn`` (see tidal/store/cuda_ipc.py)."""
        rec = VolumeRec(
            volume_id=volume_id,
            address="",
            host=host,
            shm_prefix="",
            create=lambda slot, nbytes: None,  # the owner allocates when it writes
            destroy=lambda slots: None,  # replaced below: it needs the record
            probe=lambda: True,  # its death is its connection's close
            kind="cuda",
            owner=conn,
        )
        rec.destroy = functools.partial(_hand_back, rec)
        self.add_volume(rec)

    def _live_device_volume(self, volume_id: str) -> VolumeRec | None:
        vol = self._volumes.get(volume_id)
        return vol if vol is not None and vol.kind == "cuda" and vol.alive else None

    def _device_volume(self, conn: int, volume_id: str) -> VolumeRec:
        """The live device volume ``volume_id``, which must be ``conn``'s own."""
        vol = self._live_device_volume(volume_id)
        if vol is None:
            raise ValueError(f"{volume_id!r} is not a live device volume of this store")
        if vol.owner != conn:
            raise ValueError(f"device volume {volume_id!r} is GPU memory of another writer")
        return vol

    def put_handles(self, conn: int, volume_id: str, handles: list[list[Any]]) -> dict[str, Any]:
        """The owner of a device volume sends the IPC handles of slots it allocated."""
        with self._lock:
            vol = self._device_volume(conn, volume_id)
            for slot, _, _ in handles:  # all or nothing
                if self._slot_owner.get(slot, ("",))[0] != volume_id:
                    raise ValueError(f"slot {slot} is not a slot of volume {volume_id!r}")
            for slot, uuid, handle in handles:
                vol.handles[slot] = (uuid, handle)
            return {}

    def slot_handles(self, volume_id: str, slots: list[int]) -> dict[str, Any]:
        """IPC handles of a device volume's slots, for a reader opening them."""
        with self._lock:
            vol = self._live_device_volume(volume_id)
            if vol is None:
                raise VolumeLostError(f"device volume {volume_id!r} is gone")
            out = []
            for slot in slots:
                if slot not in vol.handles:
                    raise StoreError(f"slot {slot} of volume {volume_id!r} has no IPC handle")
                out.append([slot, *vol.handles[slot]])
            return {"handles": out}

    def volume_gone(self, volume_id: str) -> None:
        """Forget a dead volume: versions with bytes on it become lost."""
        with self._lock:
            vol = self._volumes.get(volume_id)
            if vol is None or not vol.alive:
                return
            vol.alive = False
            vol.cleanup()
            for key, krec in list(self._keys.items()):
                for _v, vrec in list(krec.versions.items()):
                    if any(s.volume == volume_id for s in vrec.slots()):
                        where = vol.address or f"GPU memory of a writer on {vol.host}"
                        reason = f"lost: volume {volume_id!r} at {where} went away"
                        self._drop(key, krec, vrec, reason, destroy=True)
                for fk in [fk for fk in krec.free if fk[0] == volume_id]:
                    for slot in krec.free.pop(fk):
                        self._slot_owner.pop(slot, None)
            self._forget_dead(volume_id)

    def _forget_dead(self, volume_id: str) -> None:
        """Drop the record of a dead device volume once no slot of it is left (each writer
        process has its own: a long-lived store would otherwise collect them)."""
        vol = self._volumes.get(volume_id)
        if vol is None or vol.kind != "cuda" or vol.alive:
            return
        if not any(owner[0] == volume_id for owner in self._slot_owner.values()):
            del self._volumes[volume_id]

    def _check_volumes(self, vrec: VersionRec) -> None:
        for vid in {s.volume for s in vrec.slots()}:
            vol = self._volumes[vid]
            if vol.alive and not vol.probe():
                self.volume_gone(vid)

    # ---------------------------------------------------------------- writes

    def put_begin(self, conn: int, msg: dict[str, Any]) -> dict[str, Any]:
        key, writer, kind = msg["key"], msg["writer"], msg["kind"]
        with self._lock:
            krec = self._keys.get(key)
            if krec is None:
                krec = self._keys[key] = KeyRec(kind=kind)
            elif krec.kind != kind:
                raise TypeError(
                    f"key {key!r} holds a {krec.kind.replace('_', ' ')}; cannot put a "
                    f"{kind.replace('_', ' ')} under it (delete the key first)"
                )
            version = msg["version"]
            if version is None:
                if msg["writers"] > 1:
                    raise ValueError(
                        f"key {key!r}: pass an explicit version= when {msg['writers']} "
                        "processes write one version (they must agree on it)"
                    )
                version = krec.next_version
            vrec = krec.versions.get(version)
            if vrec is None:
                if version in krec.gone:
                    raise ValueError(
                        f"version {version} of key {key!r} was already written and dropped "
                        f"({krec.gone[version]}); versions are immutable, use a new number"
                    )
                if msg["keep"] is not None:
                    krec.keep = msg["keep"]
                keep = krec.keep if krec.keep is not None else self.keep
                vrec = krec.versions[version] = VersionRec(version, kind, msg["writers"], keep)
                krec.next_version = max(krec.next_version, version + 1)
            elif vrec.committed:
                raise ValueError(
                    f"version {version} of key {key!r} already exists; versions are immutable"
                )
            elif vrec.writers != msg["writers"]:
                raise ValueError(
                    f"version {version} of key {key!r}: this writer expects {msg['writers']} "
                    f"writers, an earlier one said {vrec.writers}"
                )
            if writer in vrec.seen:
                raise ValueError(f"writer {writer} already put version {version} of key {key!r}")
            if len(vrec.seen) >= vrec.writers:
                raise ValueError(
                    f"version {version} of key {key!r} already has its {vrec.writers} writers"
                )
            vol = self._pick_volume(conn, msg["host"], msg["volume"])
            slots: list[int] = []
            fresh: list[tuple[int, int]] = []  # (slot, nbytes) the volume must create
            try:
                for name_l, shape_l, dtype, offs_l, sizes_l in msg["tensors"]:
                    slots.append(
                        self._claim(
                            key, krec, vrec, vol, tuple(name_l), tuple(shape_l), dtype,
                            tuple(offs_l), tuple(sizes_l), fresh,
                        )
                    )  # fmt: skip
            except BaseException:
                # Leave the version as it was before this writer (free what it claimed).
                self._unclaim(krec, vrec, set(slots), {s for s, _ in fresh})
                if not vrec.seen:
                    del krec.versions[version]
                raise
            vrec.seen[writer] = conn
            report = self._wanted.get((key, version), 0.0) > time.monotonic()
            self._changed.notify_all()
        # Segments are made outside the lock: a slow or stopped volume must not stall the
        # controller for everyone else. The version stays invisible until its commit.
        try:
            for slot, nbytes in fresh:
                vol.create(slot, nbytes)
        except BaseException as e:
            with self._lock:
                if vrec.dropped is None:
                    reason = f"aborted: volume {vol.volume_id!r} could not allocate: {e}"
                    self._drop(key, krec, vrec, reason, destroy=True)
            raise
        out: dict[str, Any] = {
            "version": version,
            "slots": slots,
            "volume": [vol.volume_id, vol.address, vol.host, vol.shm_prefix, vol.kind],
            "report": report,  # a reader waits for this version: report written slots
        }
        if vol.kind == "cuda":
            with self._lock:
                out["freed"], vol.freed = vol.freed, []
        return out

    def _pick_volume(self, conn: int, host: str, wanted: str | None) -> VolumeRec:
        alive = [v for v in self._volumes.values() if v.alive]
        if wanted is not None:
            for v in alive:
                if v.volume_id == wanted:
                    if v.kind == "cuda":
                        self._device_volume(conn, wanted)  # raises for another's memory
                    return v
            raise ValueError(
                f"volume {wanted!r} is not registered (alive: {[v.volume_id for v in alive]})"
            )
        alive = [v for v in alive if v.kind == "shm"]  # device volumes take their owner's only
        if not alive:
            raise StoreError("the store has no live storage volume")
        local = [v for v in alive if v.host == host] or alive
        return min(local, key=lambda v: v.used)

    def _claim(
        self,
        key: str,
        krec: KeyRec,
        vrec: VersionRec,
        vol: VolumeRec,
        name: Name,
        shape: tuple[int, ...],
        dtype: str,
        offs: tuple[int, ...],
        sizes: tuple[int, ...],
        fresh: list[tuple[int, int]],
    ) -> int:
        """Record one shard of a writer; return its slot, -1 (empty) or -2 (a replica).
        A new slot is appended to ``fresh`` for the caller to create on the volume."""
        shown = layout.path_str(name) or key
        if len(offs) != len(shape) or len(sizes) != len(shape):
            raise ValueError(f"{shown}: box {offs}/{sizes} does not match shape {shape}")
        if any(o + s > d for o, s, d in zip(offs, sizes, shape, strict=True)):
            raise ValueError(f"{shown}: box {offs}/{sizes} lies outside shape {shape}")
        trec = vrec.tensors.get(name)
        if trec is None:
            trec = vrec.tensors[name] = TensorRec(shape, dtype)
        elif trec.shape != shape or trec.dtype != dtype:
            raise ValueError(
                f"{shown} in version {vrec.version} of key {key!r}: this writer has global "
                f"shape {list(shape)} {dtype}, another has {list(trec.shape)} {trec.dtype}"
            )
        if layout.numel(sizes) == 0:
            return -1
        if any(s.offsets == offs and s.sizes == sizes for s in trec.shards):
            return -2  # a replica of a shard another writer stores
        nbytes = layout.numel(sizes) * wire.DTYPES[dtype].itemsize
        pool = krec.free.get((vol.volume_id, name, nbytes))
        if pool:
            slot = pool.pop()
        else:
            slot = self._next_slot
            self._next_slot += 1
            fresh.append((slot, nbytes))
            self._slot_owner[slot] = (vol.volume_id, nbytes)
            vol.used += nbytes
        trec.shards.append(ShardRec(offs, sizes, slot, vol.volume_id, nbytes))
        return slot

    def _unclaim(self, krec: KeyRec, vrec: VersionRec, slots: set[int], fresh: set[int]) -> None:
        for name, trec in list(vrec.tensors.items()):
            keep = []
            for s in trec.shards:
                if s.slot in fresh:  # never created: forget it
                    self._slot_owner.pop(s.slot, None)
                    self._volumes[s.volume].used -= s.nbytes
                elif s.slot in slots and s.slot >= 0:
                    krec.free.setdefault((s.volume, name, s.nbytes), []).append(s.slot)
                else:
                    keep.append(s)
            trec.shards = keep

    def put_commit(self, conn: int, key: str, version: int, writer: str) -> dict[str, Any]:
        with self._lock:
            krec, vrec = self._pending(key, version, writer)
            vrec.done.add(writer)
            if len(vrec.done) < vrec.writers:
                return {"visible": False}
            for name, trec in vrec.tensors.items():
                trec.shards.sort(key=lambda s: s.offsets)
                problem = layout.check_cover(
                    trec.shape, [(s.offsets, s.sizes) for s in trec.shards]
                )
                if problem is not None:
                    shown = layout.path_str(name) or key
                    self._drop(key, krec, vrec, f"aborted: {shown}: {problem}", destroy=False)
                    raise ValueError(
                        f"version {version} of key {key!r} is incomplete after all "
                        f"{vrec.writers} writers committed: {shown}: {problem}"
                    )
            vrec.committed = True
            vrec.sig = _signature(vrec)
            self._retain(key, krec, vrec.keep)
            self._changed.notify_all()
            return {"visible": True}

    def put_abort(self, conn: int, key: str, version: int, writer: str) -> dict[str, Any]:
        with self._lock:
            krec, vrec = self._pending(key, version, writer)
            self._drop(key, krec, vrec, f"aborted by writer {writer}", destroy=False)
            return {}

    def put_progress(
        self, conn: int, key: str, version: int, writer: str, slots: list[int]
    ) -> dict[str, Any]:
        """A writer's bytes for `slots` of a pending version are in place (for readers that
        stream a version while it is written; it stays invisible to others until commit)."""
        with self._lock:
            _, vrec = self._pending(key, version, writer)
            vrec.written.update(slots)
            self._changed.notify_all()
            return {}

    def wait(
        self, conn: int, key: str, version: int, slots: list[int], wait_ms: int
    ) -> dict[str, Any]:
        """Block up to `wait_ms` until `slots` of a pending version are written (or, with no
        slots, until it is committed). Returns {"done": bool, "committed": bool}; raises if
        the version was aborted, evicted or deleted meanwhile."""
        deadline = time.monotonic() + wait_ms / 1000
        with self._changed:
            while True:
                krec = self._keys.get(key)
                vrec = krec.versions.get(version) if krec else None
                if vrec is None:
                    why = krec.gone.get(version) if krec else None
                    raise VersionNotFoundError(
                        f"version {version} of key {key!r} is gone ({why or 'never written'})"
                    )
                if vrec.committed:
                    return {"done": True, "committed": True}
                if slots and set(slots) <= vrec.written:
                    return {"done": True, "committed": False}
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"done": False, "committed": False}
                self._changed.wait(left)

    def _pending(self, key: str, version: int, writer: str) -> tuple[KeyRec, VersionRec]:
        krec = self._keys.get(key)
        vrec = krec.versions.get(version) if krec else None
        if vrec is None or writer not in vrec.seen or vrec.committed:
            reason = krec.gone.get(version) if krec else None
            raise ValueError(
                f"version {version} of key {key!r} has no pending write by {writer}"
                + (f" ({reason})" if reason else "")
            )
        assert krec is not None, f"pending version {version} of {key!r} without its key record"
        return krec, vrec

    def _retain(self, key: str, krec: KeyRec, keep: int) -> None:
        committed = sorted(v for v, r in krec.versions.items() if r.committed)
        for v in committed[:-keep]:
            self._drop(key, krec, krec.versions[v], f"evicted: key keeps the last {keep}")
        # Free slots of a shape the latest version no longer uses are dead weight.
        latest = krec.versions[committed[-1]]
        live = {(s.volume, n, s.nbytes) for n, t in latest.tensors.items() for s in t.shards}
        for fk in [fk for fk in krec.free if fk not in live]:
            self._destroy_slots(krec.free.pop(fk))

    def _drop(
        self, key: str, krec: KeyRec, vrec: VersionRec, reason: str, destroy: bool = False
    ) -> None:
        """Remove a version; its slots return to the key's ring (or are destroyed) once no
        lease holds them."""
        krec.versions.pop(vrec.version, None)
        krec.gone[vrec.version] = reason
        while len(krec.gone) > 1024:
            krec.gone.popitem(last=False)
        vrec.dropped = reason
        vrec.committed = False
        vrec.destroy = vrec.destroy or destroy
        self._changed.notify_all()
        if vrec.leases == 0:
            self._release_slots(krec, vrec, vrec.destroy)

    def _release_slots(self, krec: KeyRec | None, vrec: VersionRec, destroy: bool) -> None:
        shards = [(n, s) for n, t in vrec.tensors.items() for s in t.shards if s.slot >= 0]
        vrec.tensors = {}
        if destroy or krec is None:
            self._destroy_slots([s.slot for _, s in shards])
            return
        for name, s in shards:
            if self._volumes[s.volume].alive:
                krec.free.setdefault((s.volume, name, s.nbytes), []).append(s.slot)

    def _destroy_slots(self, slots: list[int]) -> None:
        by_vol: dict[str, list[int]] = {}
        for slot in slots:
            owner = self._slot_owner.pop(slot, None)
            if owner is not None:
                by_vol.setdefault(owner[0], []).append(slot)
                self._volumes[owner[0]].used -= owner[1]
        for vid, ss in by_vol.items():
            vol = self._volumes[vid]
            if vol.alive:
                try:
                    vol.destroy(ss)
                except (StoreError, OSError):
                    pass  # fallback: an unreachable volume frees its memory when it exits
            else:
                self._forget_dead(vid)

    # ---------------------------------------------------------------- reads

    def acquire(
        self,
        conn: int,
        key: str,
        version: int | str,
        known_sig: str | None,
        wait_ms: int | None = None,
    ) -> dict[str, Any]:
        """Pin a committed version for reading; returns its layout and slots.

        With `wait_ms` (an int version only), wait up to that long for the version to exist
        and have all its writers begun, and pin it even before its commit: the reply then
        says "pending" and the reader gates each slot on `wait` (streaming read)."""
        with self._changed:
            vrec = self._await_begun(key, version, wait_ms) if wait_ms is not None else None
            if vrec is None and wait_ms is not None:
                krec = self._keys.get(key)
                if krec is None or version not in krec.gone:
                    return {"waiting": True}  # not begun yet: the client asks again
            if vrec is None:
                krec = self._keys.get(key)
                if krec is None:
                    raise KeyNotFoundError(f"key {key!r} not found{self._suggest(key)}")
                vrec = self._resolve(key, krec, version)
            self._check_volumes(vrec)
            if vrec.dropped:  # the probe found a dead volume
                raise VolumeLostError(f"version {vrec.version} of key {key!r} is {vrec.dropped}")
            lease = self._next_lease
            self._next_lease += 1
            self._leases[lease] = Lease(key, vrec, conn)
            vrec.leases += 1
            names = sorted(vrec.tensors, key=_name_order)
            vols: list[str] = []
            slots: list[int] = []
            for n in names:
                for s in vrec.tensors[n].shards:
                    slots.append(s.slot)
                    vols.append(s.volume)
            vol_ids = sorted(set(vols))
            sig = vrec.sig or _signature(vrec)  # a pending version has no cached signature
            out: dict[str, Any] = {
                "version": vrec.version,
                "lease": lease,
                "kind": vrec.kind,
                "sig": sig,
                "pending": not vrec.committed,
                "slots": slots,
                "vols": [vol_ids.index(v) for v in vols],
                "volumes": [
                    [
                        v,
                        self._volumes[v].address,
                        self._volumes[v].host,
                        self._volumes[v].shm_prefix,
                        self._volumes[v].kind,
                    ]
                    for v in vol_ids
                ],
            }
            if known_sig != sig:
                out["meta"] = [
                    [
                        list(n),
                        list(vrec.tensors[n].shape),
                        vrec.tensors[n].dtype,
                        [[list(s.offsets), list(s.sizes)] for s in vrec.tensors[n].shards],
                    ]
                    for n in names
                ]
            return out

    def _await_begun(self, key: str, version: int | str, wait_ms: int) -> VersionRec | None:
        """The record of `version` once every writer has begun it (committed or not); None if
        it does not get there within `wait_ms` (the caller then reports why)."""
        if not isinstance(version, int):
            raise ValueError("waiting for a version needs a version number, not 'latest'")
        deadline = time.monotonic() + wait_ms / 1000
        # The reader asks again after `wait_ms`: keep its interest a little longer than that.
        if len(self._wanted) > 4096:
            now = time.monotonic()
            self._wanted = {k: t for k, t in self._wanted.items() if t > now}
        self._wanted[(key, version)] = max(self._wanted.get((key, version), 0.0), deadline + 5)
        while True:
            krec = self._keys.get(key)
            vrec = krec.versions.get(version) if krec else None
            if vrec is not None and (vrec.committed or len(vrec.seen) == vrec.writers):
                return vrec
            if krec is not None and version in krec.gone:
                return None  # _resolve names what happened to it
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._changed.wait(left)

    def _resolve(self, key: str, krec: KeyRec, version: int | str) -> VersionRec:
        committed = sorted(v for v, r in krec.versions.items() if r.committed)
        if version == "latest":
            lost = [v for v, why in krec.gone.items() if why.startswith("lost")]
            if lost and (not committed or max(lost) > committed[-1]):
                v = max(lost)
                raise VolumeLostError(f"latest version {v} of key {key!r} is {krec.gone[v]}")
            if not committed:
                pending = sorted(krec.versions)
                raise VersionNotFoundError(
                    f"key {key!r} has no committed version yet (being written: {pending})"
                )
            return krec.versions[committed[-1]]
        assert isinstance(version, int)
        vrec = krec.versions.get(version)
        if vrec is not None and vrec.committed:
            return vrec
        if vrec is not None:
            raise VersionNotFoundError(
                f"version {version} of key {key!r} is still being written "
                f"({len(vrec.done)} of {vrec.writers} writers committed)"
            )
        if version in krec.gone:
            why = krec.gone[version]
            cls = VolumeLostError if why.startswith("lost") else VersionNotFoundError
            raise cls(f"version {version} of key {key!r} is gone ({why}); available: {committed}")
        raise VersionNotFoundError(
            f"version {version} of key {key!r} was never written; available: {committed}"
        )

    def release(self, conn: int, lease: int) -> dict[str, Any]:
        with self._lock:
            rec = self._leases.pop(lease, None)
            if rec is None:
                raise ValueError(f"lease {lease} is not held")
            self._unlease(rec)
            # Whether the version's volume died while it was leased (readers of GPU memory
            # then know their copy may hold freed bytes).
            return {"lost": (rec.vrec.dropped or "").startswith("lost")}

    def _unlease(self, rec: Lease) -> None:
        vrec = rec.vrec
        vrec.leases -= 1
        if vrec.dropped is not None and vrec.leases == 0:
            self._release_slots(self._keys.get(rec.key), vrec, vrec.destroy)

    def connection_closed(self, conn: int) -> None:
        """Release the leases and abort the pending writes of a closed connection."""
        with self._lock:
            for lease in [k for k, r in self._leases.items() if r.conn == conn]:
                self._unlease(self._leases.pop(lease))
            for vol in list(self._volumes.values()):
                if vol.kind == "cuda" and vol.owner == conn:
                    self.volume_gone(vol.volume_id)  # the writer's GPU memory goes with it
            for key, krec in list(self._keys.items()):
                for vrec in list(krec.versions.values()):
                    if vrec.committed:
                        continue
                    if any(c == conn and w not in vrec.done for w, c in vrec.seen.items()):
                        self._drop(key, krec, vrec, "aborted: a writer disconnected")

    # ---------------------------------------------------------------- queries

    def keys(self, prefix: str) -> list[str]:
        with self._lock:
            return sorted(
                k
                for k, r in self._keys.items()
                if k.startswith(prefix) and any(v.committed for v in r.versions.values())
            )

    def versions(self, key: str) -> list[int]:
        with self._lock:
            krec = self._keys.get(key)
            if krec is None:
                raise KeyNotFoundError(f"key {key!r} not found{self._suggest(key)}")
            return sorted(v for v, r in krec.versions.items() if r.committed)

    def exists(self, key: str, version: int | None) -> bool:
        with self._lock:
            krec = self._keys.get(key)
            if krec is None:
                return False
            if version is None:
                return any(r.committed for r in krec.versions.values())
            vrec = krec.versions.get(version)
            return vrec is not None and vrec.committed

    def delete(self, key: str, version: int | None) -> int:
        """Drop one version or the whole key; returns how many committed versions went."""
        with self._lock:
            krec = self._keys.get(key)
            if krec is None:
                raise KeyNotFoundError(f"key {key!r} not found{self._suggest(key)}")
            if version is not None:
                vrec = krec.versions.get(version)
                if vrec is None or not vrec.committed:
                    self._resolve(key, krec, version)  # raises the precise error
                    raise VersionNotFoundError(f"version {version} of key {key!r} not found")
                self._drop(key, krec, vrec, "deleted", destroy=True)
                return 1
            n = sum(1 for r in krec.versions.values() if r.committed)
            for vrec in list(krec.versions.values()):
                self._drop(key, krec, vrec, "deleted", destroy=True)
            for pool in krec.free.values():
                self._destroy_slots(pool)
            krec.free.clear()
            del self._keys[key]
            return n

    def ls(self, prefix: str) -> list[dict[str, Any]]:
        """Keys with their committed versions, bytes, tensor count and volumes."""
        with self._lock:
            out = []
            for key in sorted(self._keys):
                if not key.startswith(prefix):
                    continue
                krec = self._keys[key]
                for v in sorted(krec.versions):
                    vrec = krec.versions[v]
                    if not vrec.committed:
                        continue
                    shards = vrec.slots()
                    out.append(
                        {
                            "key": key,
                            "version": v,
                            "kind": vrec.kind,
                            "tensors": len(vrec.tensors),
                            "shards": len(shards),
                            "bytes": sum(s.nbytes for s in shards),
                            "volumes": sorted({s.volume for s in shards}),
                        }
                    )
            return out

    def volumes(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {"volume": v.volume_id, "address": v.address, "host": v.host, "alive": v.alive,
                 "kind": v.kind}
                for v in self._volumes.values()
            ]  # fmt: skip

    def _suggest(self, key: str) -> str:
        near = [k for k in self._keys if k.startswith(key.split("/")[0])][:5]
        return f"; similar keys: {near}" if near else ""


def _hand_back(vol: VolumeRec, slots: list[int]) -> None:
    """``destroy`` of a device volume: its owner frees the slots at its next put."""
    for slot in slots:
        vol.handles.pop(slot, None)
    vol.freed.extend(slots)


def _name_order(name: Name) -> tuple[Any, ...]:
    return tuple((0, c) if isinstance(c, int) else (1, c) for c in name)


def _signature(vrec: VersionRec) -> str:
    h = hashlib.sha1(vrec.kind.encode())
    for n in sorted(vrec.tensors, key=_name_order):
        t = vrec.tensors[n]
        h.update(repr((n, t.shape, t.dtype, [(s.offsets, s.sizes) for s in t.shards])).encode())
    return h.hexdigest()[:20]
