"""The controller's metadata and the rules every op shares: slots, rings, drops, volumes.

:class:`Catalog` holds key -> version -> tensors -> shards (volume, slot, box in the global
tensor), the slots each volume holds, the rings of freed slots per key, the volumes, and
which pending versions streaming readers wait for. Its methods are the mechanisms the op
handlers build on (claiming and freeing slots, dropping a version, forgetting a dead volume).
The handlers are in two components that share one catalog: the write ops (plans, pending
writes, reservations) in tidal/store/writes.py, the read ops (leases, acquire replies) in
tidal/store/controller.py. One lock, ``Catalog.lock``, guards the catalog and both
components; callers of every method here hold it.

Slot rules:
- A slot holds one version's bytes. It is reused (for a later version) only after its
  version was dropped, every lease on that version was released and every writer of it has
  finished, so a reader holding a lease on version v reads bytes of v only.
- A slot a connection may still be copying into (its reservation, or one of a write that
  ended early) sits in that connection's quarantine (tidal/store/writes.py): nobody else
  gets it until the connection sends its next write, by which time its copies are done, or
  closes.
- A key's ring holds slots only while the key has a version (pending or committed): slots
  of an aborted first put, or of a key whose last version was deleted, are destroyed, so
  no memory stays held for a key nobody can see.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from tidal.store.backends import DeviceBackend
from tidal.store.errors import StoreError
from tidal.store.records import (
    KeyRec,
    Name,
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
    """The controller's metadata; see the module docstring."""

    def __init__(self, store_id: str, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.store_id = store_id
        self.keep = keep
        self.lock = threading.RLock()
        # Woken on every change a streaming reader may wait for: a version begun, slots
        # written, a commit, a drop.
        self.changed = threading.Condition(self.lock)
        self.keys: dict[str, KeyRec] = {}
        self.volumes: dict[str, VolumeRec] = {}
        self._slot_owner: dict[int, tuple[str, int]] = {}  # slot -> (volume id, nbytes)
        self._next_id = 1  # slots, plans, reservations and leases draw from one counter
        # (key, version) -> until when a streaming reader waits for it (monotonic seconds):
        # writers of such a version report their progress, others need not.
        self._wanted: dict[tuple[str, int], float] = {}

    def new_id(self) -> int:
        """A fresh id for a slot, plan, reservation or lease (never reused)."""
        n = self._next_id
        self._next_id += 1
        return n

    # Streaming readers' interest.

    def want(self, key: str, version: int, until: float) -> None:
        """A streaming reader waits for ``version`` of ``key`` until ``until`` (monotonic)."""
        if len(self._wanted) > 4096:
            now = time.monotonic()
            self._wanted = {k: t for k, t in self._wanted.items() if t > now}
        self._wanted[(key, version)] = max(self._wanted.get((key, version), 0.0), until)

    def wanted(self, key: str, version: int) -> bool:
        """Whether a streaming reader waits for ``version`` of ``key`` now."""
        return self._wanted.get((key, version), 0.0) > time.monotonic()

    # Volumes.

    def add_volume(self, rec: VolumeRec) -> None:
        """Add a volume; a shared-memory volume's directory and ids must be ones its segment
        names can be built from (they may come from the network, and readers and writers
        build paths from them)."""
        if rec.kind == "shm":
            try:
                segment_path(rec.shm_dir, rec.store_id, rec.volume_id, 1)
            except StoreError as e:
                raise ValueError(f"volume {rec.volume_id!r} refused: {e}") from None
        with self.lock:
            old = self.volumes.get(rec.volume_id)
            if old is not None and old.alive:
                raise ValueError(f"a volume named {rec.volume_id!r} is already registered")
            self.volumes[rec.volume_id] = rec

    def live_device_volume(self, volume_id: str) -> VolumeRec | None:
        vol = self.volumes.get(volume_id)
        return vol if vol is not None and vol.kind == "cuda" and vol.alive else None

    def own_device_volume(self, conn: int, volume_id: str) -> VolumeRec:
        """``conn``'s live device volume ``volume_id``; raises ValueError for another's."""
        vol = self.live_device_volume(volume_id)
        if vol is None:
            raise ValueError(f"{volume_id!r} is not a live device volume of this store")
        if vol.owner != conn:
            raise ValueError(f"device volume {volume_id!r} is GPU memory of another writer")
        return vol

    def volume_gone(self, volume_id: str) -> None:
        """Forget a dead volume: versions with bytes on it become lost."""
        with self.lock:
            vol = self.volumes.get(volume_id)
            if vol is None or not vol.alive:
                return
            vol.alive = False
            vol.backend.close()
            where = vol.address or f"GPU memory of a writer on {vol.host.split('/')[0]}"
            reason = f"lost: volume {volume_id!r} at {where} went away"
            for key, krec in list(self.keys.items()):
                for vrec in list(krec.versions.values()):
                    if any(s.volume == volume_id for _, s in vrec.shards()):
                        self.drop(key, krec, vrec, reason, destroy=True)
                for fk in [fk for fk in krec.free if fk[0] == volume_id]:
                    self.destroy_slots(krec.free.pop(fk))
            self._forget_dead(volume_id)

    def volumes_of(self, conn: int) -> list[str]:
        """The volumes that die with connection ``conn`` (a writer's GPU memory, a volume
        process)."""
        return [v.volume_id for v in self.volumes.values() if v.owner == conn]

    def _forget_dead(self, volume_id: str) -> None:
        """Drop the record of a dead volume once no slot of it is left (a long-lived store
        would otherwise list every volume that ever left)."""
        vol = self.volumes.get(volume_id)
        if vol is None or vol.alive:
            return
        if not any(owner[0] == volume_id for owner in self._slot_owner.values()):
            del self.volumes[volume_id]

    def check_volumes(self, volume_ids: Iterable[str]) -> None:
        """Probe the volumes a read is about to use; a dead one is forgotten (its versions
        become lost)."""
        for vid in volume_ids:
            vol = self.volumes[vid]
            if vol.alive and not vol.backend.alive():
                self.volume_gone(vid)

    def freed(self, vol: VolumeRec) -> list[int]:
        """Slots of a device volume destroyed since its owner last heard."""
        if isinstance(vol.backend, DeviceBackend):
            out, vol.backend.freed = vol.backend.freed, []
            return out
        return []

    def volume_states(self) -> list[dict[str, Any]]:
        """Every volume as ``ls`` and ``volumes`` report it (ops.s_volume_state)."""
        return [
            {
                "volume": v.volume_id,
                "kind": v.kind,
                "host": v.host,
                "address": v.address,
                "alive": v.alive,
            }
            for v in self.volumes.values()
        ]

    # Slots.

    def slot_volume(self, slot: int) -> str | None:
        """The id of the volume ``slot`` lives on, or None for no live slot."""
        owner = self._slot_owner.get(slot)
        return owner[0] if owner is not None else None

    def slot_sizes(self, slots: list[int]) -> list[tuple[int, int]]:
        """``(slot, bytes)`` of each slot, as a volume's ``create`` takes them."""
        return [(s, self._slot_owner[s][1]) for s in slots]

    def slot_count(self) -> int:
        return len(self._slot_owner)

    def claim(
        self, krec: KeyRec, vol: VolumeRec, ring: tuple[str, Name, int], fresh: list[int]
    ) -> int:
        """A slot for a shard of ``ring`` (a PlanRec.rings entry): a free one, or a new one
        (added to ``fresh``)."""
        pool = krec.free.get(ring)
        if pool:
            return pool.pop()
        slot = self.new_id()
        fresh.append(slot)
        nbytes = ring[2]
        self._slot_owner[slot] = (vol.volume_id, nbytes)
        vol.used += nbytes
        return slot

    def unclaim_fresh(self, vol: VolumeRec, slot: int, nbytes: int) -> None:
        """Forget a new slot ``claim`` made that was never created on its volume."""
        self._slot_owner.pop(slot, None)
        vol.used -= nbytes

    def to_ring(self, krec: KeyRec, items: list[RingSlot]) -> None:
        """Slots nobody may be writing any more: back into the key's ring (destroyed if the
        key has no version left, see ``drop``)."""
        if not krec.versions:
            self.destroy_slots([slot for *_, slot in items])
            return
        for vid, name, nbytes, slot in items:
            if slot in self._slot_owner:
                krec.free.setdefault((vid, name, nbytes), []).append(slot)

    def destroy_slots(self, slots: list[int]) -> None:
        """Free ``slots`` on their volumes for good (unknown ids are skipped)."""
        by_vol: dict[str, list[int]] = {}
        for slot in slots:
            owner = self._slot_owner.pop(slot, None)
            if owner is not None:
                by_vol.setdefault(owner[0], []).append(slot)
                vol = self.volumes.get(owner[0])
                if vol is not None:
                    vol.used -= owner[1]
        for vid, ss in by_vol.items():
            vol = self.volumes.get(vid)
            if vol is None:
                continue
            if vol.alive:
                try:
                    vol.backend.destroy(ss)
                except (StoreError, OSError):
                    pass  # fallback: an unreachable volume frees its memory when it exits
            self._forget_dead(vid)

    # Versions.

    def retain(self, key: str, krec: KeyRec, keep: int) -> None:
        """Drop all but the last ``keep`` committed versions of ``key``."""
        committed = sorted(v for v, r in krec.versions.items() if r.committed)
        for v in committed[:-keep]:
            self.drop(key, krec, krec.versions[v], f"evicted: key keeps the last {keep}")
        # Free slots of a shape the latest version no longer uses are dead weight (checked
        # again only when the layout changes).
        latest = krec.versions[committed[-1]]
        if latest.sig and latest.sig == krec.pruned_for:
            return
        live = {(s.volume, n, s.nbytes) for n, s in latest.shards()}
        for fk in [fk for fk in krec.free if fk not in live]:
            self.destroy_slots(krec.free.pop(fk))
        krec.pruned_for = latest.sig

    def drop(
        self, key: str, krec: KeyRec, vrec: VersionRec, reason: str, destroy: bool = False
    ) -> None:
        """Remove a version; its slots return to the key's ring (or are destroyed) once no
        lease or writer holds them."""
        krec.versions.pop(vrec.version, None)
        if not krec.versions:
            # No version left to reuse the ring (a first put aborted, its writer gone, the
            # last version deleted): free it rather than hold memory nobody can see.
            for pool in krec.free.values():
                self.destroy_slots(pool)
            krec.free.clear()
        krec.gone[vrec.version] = reason
        while len(krec.gone) > 1024:
            krec.gone.popitem(last=False)
        vrec.dropped = reason
        vrec.committed = False
        vrec.destroy = vrec.destroy or destroy
        self.changed.notify_all()
        if vrec.leases == 0 and vrec.writing == 0:
            self._release_slots(krec, vrec, vrec.destroy)

    def writer_done(self, key: str, vrec: VersionRec) -> None:
        """One writer of ``vrec`` stopped writing it (committed, aborted, or left)."""
        vrec.writing -= 1
        if vrec.dropped is not None and vrec.writing == 0 and vrec.leases == 0:
            self._release_slots(self.keys.get(key), vrec, vrec.destroy)

    def unlease(self, key: str, vrec: VersionRec) -> None:
        """A reader released its lease on ``vrec``."""
        vrec.leases -= 1
        if vrec.dropped is not None and vrec.leases == 0 and vrec.writing == 0:
            self._release_slots(self.keys.get(key), vrec, vrec.destroy)

    def _release_slots(self, krec: KeyRec | None, vrec: VersionRec, destroy: bool) -> None:
        shards = vrec.shards()
        vrec.tensors = {}
        if destroy or krec is None or not krec.versions:
            self.destroy_slots([s.slot for _, s in shards])
            return
        if vrec.sig != krec.pruned_for:  # slots of another layout: prune at the next commit
            krec.pruned_for = ""
        for name, s in shards:
            vol = self.volumes.get(s.volume)
            if vol is not None and vol.alive:
                krec.free.setdefault((s.volume, name, s.nbytes), []).append(s.slot)
            else:
                self.destroy_slots([s.slot])

    def suggest(self, key: str) -> str:
        """A hint naming keys like ``key``, for a key-not-found error."""
        near = [k for k in self.keys if k.startswith(key.split("/")[0])][:5]
        return f"; similar keys: {near}" if near else ""


def run_work(work: Work, on_error: Callable[[BaseException], None]) -> None:
    """Make the volume calls ``work`` lists, outside the lock; ``on_error`` undoes the
    metadata of the first that fails (then the error is raised)."""
    try:
        for _vol, fn in work:
            fn()
    except BaseException as e:
        on_error(e)
        raise


def call(fn: Callable[..., None], *args: Any) -> Callable[[], None]:
    return lambda: fn(*args)


def check_kind(key: str, have: str, want: str) -> None:
    """Refuse a put of a tensor under a state-dict key, or the other way round."""
    if have != want:
        other = "put_state_dict" if have == "state_dict" else "put"
        raise TypeError(
            f"key {key!r} holds a {have.replace('_', ' ')}; cannot put a "
            f"{want.replace('_', ' ')} under it (use {other}, or delete the key first)"
        )


def version_sig(vrec: VersionRec) -> str:
    """The layout signature of a version's tensors and boxes."""
    return layout_signature(
        vrec.kind,
        {
            n: (t.shape, t.dtype, [(s.offsets, s.sizes) for s in t.shards])
            for n, t in vrec.tensors.items()
        },
    )
