"""The controller's state and the rules every op shares: slots, rings, drops, volumes.

:class:`Catalog` holds key -> version -> tensors -> shards (volume, slot, box in the global
tensor), the slots each volume holds, the rings of freed slots per key, reader leases, the
writes in flight and the volumes. Its methods are the mechanisms the op handlers build on
(claiming and freeing slots, dropping a version, forgetting a dead volume); the handlers live
in tidal/store/writes.py (writes) and tidal/store/controller.py (reads, queries). Callers hold
``_lock``.

Slot rules:
- A slot holds one version's bytes. It is reused (for a later version) only after its
  version was dropped, every lease on that version was released and every writer of it has
  finished, so a reader holding a lease on version v reads bytes of v only.
- A slot a connection may still be copying into (its reservation, or one of a write that
  ended early) sits in that connection's quarantine: nobody else gets it until the
  connection sends its next write, by which time its copies are done, or closes.
- A key's ring holds slots only while the key has a version (pending or committed): slots
  of an aborted first put, or of a key whose last version was deleted, are destroyed, so
  no memory stays held for a key nobody can see.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from tidal.store.backends import DeviceBackend
from tidal.store.errors import StoreError
from tidal.store.records import (
    KeyRec,
    Lease,
    Name,
    PlanRec,
    ReadLayout,
    Reservation,
    VersionRec,
    VolumeRec,
    layout_signature,
)
from tidal.store.volume import segment_path

# Volume work to do outside the lock, in order: (volume, call).
Work = list[tuple[VolumeRec, Callable[[], None]]]
# A slot with the ring it returns to: (volume, tensor name, bytes, slot).
RingSlot = tuple[str, Name, int, int]


class Catalog:
    """The controller's state; see the module docstring."""

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
        self._next_id = 1  # slots, plans, reservations and leases draw from one counter
        self._plans: dict[int, PlanRec] = {}
        self._reservations: dict[int, Reservation] = {}
        self._leases: dict[int, Lease] = {}
        # Pending writes by (connection, key, version, writer), found even once dropped.
        self._writing: dict[tuple[int, str, int, str], VersionRec] = {}
        # Slots a connection may still be copying into, by connection: (key, slots).
        self._quarantine: dict[int, list[tuple[str, list[RingSlot]]]] = {}
        # Layouts whose shards were found to tile every tensor: writers' (plan, replicas)
        # -> signature (tidal/store/writes.py, _publish).
        self._checked: dict[tuple[Any, ...], str] = {}
        # The same layouts' acquire replies (tidal/store/controller.py, _read_layout).
        self._read_layouts: dict[tuple[Any, ...], ReadLayout] = {}
        # (key, version) -> until when a streaming reader waits for it (monotonic seconds):
        # writers of such a version report their progress, others need not.
        self._wanted: dict[tuple[str, int], float] = {}

    def _new_id(self) -> int:
        n = self._next_id
        self._next_id += 1
        return n

    def add_volume(self, rec: VolumeRec) -> None:
        """Add a volume; a shared-memory volume's directory and ids must be ones its segment
        names can be built from (they may come from the network, and readers and writers
        build paths from them)."""
        if rec.kind == "shm":
            try:
                segment_path(rec.shm_dir, rec.store_id, rec.volume_id, 1)
            except StoreError as e:
                raise ValueError(f"volume {rec.volume_id!r} refused: {e}") from None
        with self._lock:
            old = self._volumes.get(rec.volume_id)
            if old is not None and old.alive:
                raise ValueError(f"a volume named {rec.volume_id!r} is already registered")
            self._volumes[rec.volume_id] = rec

    def _live_device_volume(self, volume_id: str) -> VolumeRec | None:
        vol = self._volumes.get(volume_id)
        return vol if vol is not None and vol.kind == "cuda" and vol.alive else None

    def _own_device_volume(self, conn: int, volume_id: str) -> VolumeRec:
        vol = self._live_device_volume(volume_id)
        if vol is None:
            raise ValueError(f"{volume_id!r} is not a live device volume of this store")
        if vol.owner != conn:
            raise ValueError(f"device volume {volume_id!r} is GPU memory of another writer")
        return vol

    def volume_gone(self, volume_id: str) -> None:
        """Forget a dead volume: versions with bytes on it become lost."""
        with self._lock:
            vol = self._volumes.get(volume_id)
            if vol is None or not vol.alive:
                return
            vol.alive = False
            vol.backend.close()
            where = vol.address or f"GPU memory of a writer on {vol.host.split('/')[0]}"
            reason = f"lost: volume {volume_id!r} at {where} went away"
            for key, krec in list(self._keys.items()):
                for vrec in list(krec.versions.values()):
                    if any(s.volume == volume_id for _, s in vrec.shards()):
                        self._drop(key, krec, vrec, reason, destroy=True)
                for fk in [fk for fk in krec.free if fk[0] == volume_id]:
                    self._destroy_slots(krec.free.pop(fk))
            self._forget_dead(volume_id)

    def _forget_dead(self, volume_id: str) -> None:
        """Drop the record of a dead volume once no slot of it is left (a long-lived store
        would otherwise list every volume that ever left)."""
        vol = self._volumes.get(volume_id)
        if vol is None or vol.alive:
            return
        if not any(owner[0] == volume_id for owner in self._slot_owner.values()):
            del self._volumes[volume_id]

    def _check_volumes(self, vrec: VersionRec) -> None:
        known = self._read_layouts.get(vrec.layout) if vrec.layout is not None else None
        vids = known.volume_ids if known is not None else {s.volume for _, s in vrec.shards()}
        for vid in vids:
            vol = self._volumes[vid]
            if vol.alive and not vol.backend.alive():
                self.volume_gone(vid)

    def _claim(
        self, krec: KeyRec, vol: VolumeRec, ring: tuple[str, Name, int], fresh: list[int]
    ) -> int:
        """A slot for a shard of ``ring`` (a PlanRec.rings entry): a free one, or a new one
        (added to ``fresh``)."""
        pool = krec.free.get(ring)
        if pool:
            return pool.pop()
        slot = self._new_id()
        fresh.append(slot)
        nbytes = ring[2]
        self._slot_owner[slot] = (vol.volume_id, nbytes)
        vol.used += nbytes
        return slot

    def _to_ring(self, krec: KeyRec, items: list[RingSlot]) -> None:
        """Slots nobody may be writing any more: back into the key's ring (destroyed if the
        key has no version left, see ``_drop``)."""
        if not krec.versions:
            self._destroy_slots([slot for *_, slot in items])
            return
        for vid, name, nbytes, slot in items:
            if slot in self._slot_owner:
                krec.free.setdefault((vid, name, nbytes), []).append(slot)

    def _flush_quarantine(self, conn: int, destroy: bool = False) -> None:
        for key, items in self._quarantine.pop(conn, []):
            krec = self._keys.get(key)
            if destroy or krec is None:
                self._destroy_slots([slot for *_, slot in items])
            else:
                self._to_ring(krec, items)

    def _end_write(self, conn: int, key: str, vrec: VersionRec, writer: str) -> None:
        """``writer`` stopped writing ``vrec`` (committed, aborted, or left)."""
        if self._writing.pop((conn, key, vrec.version, writer), None) is None:
            return
        vrec.writing -= 1
        if vrec.dropped is not None and vrec.writing == 0 and vrec.leases == 0:
            self._release_slots(self._keys.get(key), vrec, vrec.destroy)

    def _retain(self, key: str, krec: KeyRec, keep: int) -> None:
        committed = sorted(v for v, r in krec.versions.items() if r.committed)
        for v in committed[:-keep]:
            self._drop(key, krec, krec.versions[v], f"evicted: key keeps the last {keep}")
        # Free slots of a shape the latest version no longer uses are dead weight (checked
        # again only when the layout changes).
        latest = krec.versions[committed[-1]]
        if latest.sig and latest.sig == krec.pruned_for:
            return
        live = {(s.volume, n, s.nbytes) for n, s in latest.shards()}
        for fk in [fk for fk in krec.free if fk not in live]:
            self._destroy_slots(krec.free.pop(fk))
        krec.pruned_for = latest.sig

    def _drop(
        self, key: str, krec: KeyRec, vrec: VersionRec, reason: str, destroy: bool = False
    ) -> None:
        """Remove a version; its slots return to the key's ring (or are destroyed) once no
        lease holds them."""
        krec.versions.pop(vrec.version, None)
        if not krec.versions:
            # No version left to reuse the ring (a first put aborted, its writer gone, the
            # last version deleted): free it rather than hold memory nobody can see.
            for pool in krec.free.values():
                self._destroy_slots(pool)
            krec.free.clear()
        krec.gone[vrec.version] = reason
        while len(krec.gone) > 1024:
            krec.gone.popitem(last=False)
        vrec.dropped = reason
        vrec.committed = False
        vrec.destroy = vrec.destroy or destroy
        self._changed.notify_all()
        if vrec.leases == 0 and vrec.writing == 0:
            self._release_slots(krec, vrec, vrec.destroy)

    def _release_slots(self, krec: KeyRec | None, vrec: VersionRec, destroy: bool) -> None:
        shards = vrec.shards()
        vrec.tensors = {}
        if destroy or krec is None or not krec.versions:
            self._destroy_slots([s.slot for _, s in shards])
            return
        if vrec.sig != krec.pruned_for:  # slots of another layout: prune at the next commit
            krec.pruned_for = ""
        for name, s in shards:
            vol = self._volumes.get(s.volume)
            if vol is not None and vol.alive:
                krec.free.setdefault((s.volume, name, s.nbytes), []).append(s.slot)
            else:
                self._destroy_slots([s.slot])

    def _destroy_slots(self, slots: list[int]) -> None:
        by_vol: dict[str, list[int]] = {}
        for slot in slots:
            owner = self._slot_owner.pop(slot, None)
            if owner is not None:
                by_vol.setdefault(owner[0], []).append(slot)
                vol = self._volumes.get(owner[0])
                if vol is not None:
                    vol.used -= owner[1]
        for vid, ss in by_vol.items():
            vol = self._volumes.get(vid)
            if vol is None:
                continue
            if vol.alive:
                try:
                    vol.backend.destroy(ss)
                except (StoreError, OSError):
                    pass  # fallback: an unreachable volume frees its memory when it exits
            self._forget_dead(vid)

    def _unlease(self, rec: Lease) -> None:
        vrec = rec.vrec
        vrec.leases -= 1
        if vrec.dropped is not None and vrec.leases == 0 and vrec.writing == 0:
            self._release_slots(self._keys.get(rec.key), vrec, vrec.destroy)

    def _freed(self, vol: VolumeRec) -> list[int]:
        """Slots of a device volume destroyed since its owner last heard."""
        if isinstance(vol.backend, DeviceBackend):
            out, vol.backend.freed = vol.backend.freed, []
            return out
        return []

    def _run(self, work: Work, on_error: Callable[[BaseException], None]) -> None:
        try:
            for _vol, fn in work:
                fn()
        except BaseException as e:
            on_error(e)
            raise

    def _suggest(self, key: str) -> str:
        near = [k for k in self._keys if k.startswith(key.split("/")[0])][:5]
        return f"; similar keys: {near}" if near else ""


def _call(fn: Callable[..., None], *args: Any) -> Callable[[], None]:
    return lambda: fn(*args)


def _check_kind(key: str, have: str, want: str) -> None:
    if have != want:
        other = "put_state_dict" if have == "state_dict" else "put"
        raise TypeError(
            f"key {key!r} holds a {have.replace('_', ' ')}; cannot put a "
            f"{want.replace('_', ' ')} under it (use {other}, or delete the key first)"
        )


def _version_sig(vrec: VersionRec) -> str:
    return layout_signature(
        vrec.kind,
        {
            n: (t.shape, t.dtype, [(s.offsets, s.sizes) for s in t.shards])
            for n, t in vrec.tensors.items()
        },
    )
