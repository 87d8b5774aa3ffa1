"""Controller: the store's metadata service, and nothing else.

It never touches tensor bytes. A :class:`Controller` is built from two parts it owns:

- ``catalog`` (:class:`~tidal.store.catalog.Catalog`, tidal/store/catalog.py): the metadata,
  key -> version -> tensors -> shards, the volumes and their slots, and the rules every op
  shares (claiming, dropping, retention);
- ``writes`` (:class:`~tidal.store.writes.Writes`, tidal/store/writes.py): the put lifecycle,
  declare, begin, report, commit or abort, with the plans, reservations and pending writes.

This file has the read ops (leases, acquire replies, streaming waits), the queries, and
what a closed connection leaves behind; the write ops are the ``writes`` part's.

Lifecycle: one controller per store, inside the process that runs ``tidal store serve`` or
the embedded store. The server's connection threads call the methods named after the ops in
tidal/store/ops.py with the id of the calling connection; one lock guards all state. Leases,
half-written versions, plans, reservations and device volumes belong to the connection that
made them and die with it. Calls into volumes (creating, granting and sealing segments,
which for a volume process is a round trip) are made outside the lock, so a slow volume does
not stall everyone else.

Authorization: a version is written, reported on, committed or aborted only by the
connection that began it under that writer name; a device volume is written only by the
connection that registered it; a lease is released only by the connection that holds it; a
volume's slots are granted for network writes only while their version is pending, and
sealed before it becomes visible.

Consistency: a version becomes visible when every expected writer has committed and its
shards tile each tensor exactly; a reader holding a lease on version v reads bytes of v
only (see the slot rules in catalog.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tidal.store.catalog import Catalog, version_sig
from tidal.store.errors import KeyNotFoundError, StoreError, VersionNotFoundError, VolumeLostError
from tidal.store.records import KeyRec, Lease, ReadLayout, VersionRec, VolumeRec, name_order
from tidal.store.writes import Writes

# The ops the writes part serves (the put lifecycle); the other controller ops are served here.
WRITE_OPS = frozenset(
    {
        "device_volume",
        "put_handles",
        "put_declare",
        "put_begin",
        "put_progress",
        "put_commit",
        "put_abort",
    }
)


class Controller:
    """Metadata service, made of a catalog and a writes part (see the module docstring).
    The op methods take the caller's connection id first; the server finds the one for each
    controller op of tidal/store/ops.py with :meth:`op_handler`.

    Args:
        store_id: the store's id (shared-memory segment names start with it).
        keep: committed versions each key keeps unless a put sets its own.
    """

    def __init__(self, store_id: str, keep: int = 2) -> None:
        self.catalog = Catalog(store_id, keep)
        self.writes = Writes(self.catalog)
        self._leases: dict[int, Lease] = {}
        # A committed layout's acquire reply, by the writers' (plan, replicas) set
        # (VersionRec.layout): the same for every version of a steady writer.
        self._read_layouts: dict[tuple[Any, ...], ReadLayout] = {}

    @property
    def store_id(self) -> str:
        return self.catalog.store_id

    def add_volume(self, rec: VolumeRec) -> None:
        """Add a volume (see :meth:`Catalog.add_volume`)."""
        self.catalog.add_volume(rec)

    def op_handler(self, name: str) -> Callable[..., dict[str, Any]]:
        """The method serving controller op ``name`` (tidal/store/ops.py), called with the
        connection id and the request's fields: the writes part's for a write op, else this
        class's."""
        part: object = self.writes if name in WRITE_OPS else self
        method = getattr(part, name, None)
        if method is None:
            raise KeyError(f"the controller serves no op named {name!r}")
        return method

    # The read ops and queries.

    def acquire(
        self,
        conn: int,
        *,
        key: str,
        version: int | str,
        known_sig: str | None,
        wait_ms: int | None,
    ) -> dict[str, Any]:
        """Pin a committed version for reading; returns its layout and slots.

        With ``wait_ms`` (an int version only), wait up to that long for the version to exist
        and have all its writers begun, and pin it even before its commit: the reply then
        says "pending" and the reader gates each slot on ``wait`` (streaming read)."""
        with self.catalog.changed:
            vrec = self._await_begun(key, version, wait_ms) if wait_ms is not None else None
            if vrec is None and wait_ms is not None:
                krec = self.catalog.keys.get(key)
                if krec is None or version not in krec.gone:
                    return {"waiting": True}  # not begun yet: the client asks again
            if vrec is None:
                krec = self.catalog.keys.get(key)
                if krec is None:
                    raise KeyNotFoundError(f"key {key!r} not found{self.catalog.suggest(key)}")
                vrec = self._resolve(key, krec, version)
            known = self._read_layouts.get(vrec.layout) if vrec.layout is not None else None
            self.catalog.check_volumes(
                known.volume_ids if known is not None else {s.volume for _, s in vrec.shards()}
            )
            if vrec.dropped:  # the probe found a dead volume
                raise VolumeLostError(f"version {vrec.version} of key {key!r} is {vrec.dropped}")
            lease = self.catalog.new_id()
            self._leases[lease] = Lease(key, vrec, conn)
            vrec.leases += 1
            rl = self._read_layout(vrec)
            by_plan = vrec.slots_by_plan()
            out: dict[str, Any] = {
                "waiting": False,
                "version": vrec.version,
                "lease": lease,
                "kind": vrec.kind,
                "sig": rl.sig,
                "pending": not vrec.committed,
                "slots": [by_plan[i] for i in rl.order],
                "vols": rl.vols,
                "volumes": [self.catalog.volumes[v].info() for v in rl.volume_ids],
                "objects": [{"name": list(n), "value": v} for n, v in vrec.objects.items()],
            }
            if known_sig != rl.sig:
                out["meta"] = rl.meta
            return out

    def _read_layout(self, vrec: VersionRec) -> ReadLayout:
        """What an acquire of ``vrec`` says of its layout: kept per layout once committed
        (the writers' plans and replicas fix the order of their slots), else built."""
        if vrec.layout is not None:
            known = self._read_layouts.get(vrec.layout)
            if known is not None:
                return known
        names = sorted(vrec.tensors, key=name_order)
        # Shards in the order a commit sorts them to (by offsets), also while the version
        # is pending (in writer arrival order until then): the layout signature ignores
        # the order, so a reader that cached the boxes of a pending read and reuses them
        # for the committed version must get the slots in the same order (else two
        # writers' shards land in each other's place).
        shards = {n: sorted(vrec.tensors[n].shards, key=lambda s: s.offsets) for n in names}
        where = {slot: i for i, slot in enumerate(vrec.slots_by_plan())}
        flat = [s for n in names for s in shards[n]]
        volume_ids = sorted({s.volume for s in flat})
        index = {v: i for i, v in enumerate(volume_ids)}
        rl = ReadLayout(
            sig=vrec.sig or version_sig(vrec),  # a pending version has no cached one
            order=[where[s.slot] for s in flat],
            vols=[index[s.volume] for s in flat],
            volume_ids=volume_ids,
            meta=[
                {
                    "name": list(n),
                    "shape": list(vrec.tensors[n].shape),
                    "dtype": vrec.tensors[n].dtype,
                    "boxes": [
                        {"offsets": list(s.offsets), "sizes": list(s.sizes)} for s in shards[n]
                    ],
                }
                for n in names
            ],
        )
        if vrec.layout is not None:
            if len(self._read_layouts) > 4096:
                self._read_layouts.clear()
            self._read_layouts[vrec.layout] = rl
        return rl

    def _await_begun(self, key: str, version: int | str, wait_ms: int) -> VersionRec | None:
        """The record of ``version`` once every writer has begun it (committed or not); None
        if it does not get there within ``wait_ms`` (the caller then reports why)."""
        if not isinstance(version, int):
            raise ValueError("waiting for a version needs a version number, not 'latest'")
        deadline = time.monotonic() + wait_ms / 1000
        # The reader asks again after `wait_ms`: keep its interest a little longer than that.
        self.catalog.want(key, version, deadline + 5)
        while True:
            krec = self.catalog.keys.get(key)
            vrec = krec.versions.get(version) if krec else None
            if vrec is not None and (vrec.committed or len(vrec.seen) == vrec.writers):
                return vrec
            if krec is not None and version in krec.gone:
                return None  # _resolve names what happened to it
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.catalog.changed.wait(left)

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
        assert isinstance(version, int), f"version {version!r} is neither an int nor 'latest'"
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

    def wait(
        self, conn: int, *, key: str, version: int, slots: list[int], wait_ms: int
    ) -> dict[str, Any]:
        """Block up to ``wait_ms`` until the first of ``slots`` of a pending version is written
        (or, with no slots, until it is committed); the reply names every one of ``slots``
        written by then, so a streaming reader asks once per progress report, not per slot.
        Raises if the version was aborted, evicted or deleted meanwhile."""
        deadline = time.monotonic() + wait_ms / 1000
        with self.catalog.changed:
            while True:
                krec = self.catalog.keys.get(key)
                vrec = krec.versions.get(version) if krec else None
                if vrec is None:
                    why = krec.gone.get(version) if krec else None
                    raise VersionNotFoundError(
                        f"version {version} of key {key!r} is gone ({why or 'never written'})"
                    )
                if vrec.committed:
                    return {"done": True, "committed": True, "written": slots}
                if slots and slots[0] in vrec.written:
                    written = [s for s in slots if s in vrec.written]
                    return {"done": True, "committed": False, "written": written}
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"done": False, "committed": False, "written": []}
                self.catalog.changed.wait(left)

    def release(self, conn: int, *, lease: int) -> dict[str, Any]:
        with self.catalog.lock:
            rec = self._leases.get(lease)
            if rec is None or rec.conn != conn:
                raise ValueError(f"lease {lease} is not held by this connection")
            del self._leases[lease]
            self.catalog.unlease(rec.key, rec.vrec)
            # Whether the version's volume died while it was leased (readers of GPU memory
            # then know their copy may hold freed bytes).
            return {"lost": (rec.vrec.dropped or "").startswith("lost")}

    def slot_handles(self, conn: int, *, volume_id: str, slots: list[int]) -> dict[str, Any]:
        """IPC handles of a device volume's slots, for a reader opening them."""
        with self.catalog.lock:
            vol = self.catalog.live_device_volume(volume_id)
            if vol is None:
                raise VolumeLostError(f"device volume {volume_id!r} is gone")
            out = []
            for slot in slots:
                if slot not in vol.handles:
                    raise StoreError(f"slot {slot} of volume {volume_id!r} has no IPC handle")
                out.append(vol.handles[slot])
            return {"handles": out}

    def connection_closed(self, conn: int) -> None:
        """Release what a closed connection held: leases, pending writes, plans,
        reservations, and the device volume or registered volume it was."""
        with self.catalog.lock:
            for lease in [k for k, r in self._leases.items() if r.conn == conn]:
                rec = self._leases.pop(lease)
                self.catalog.unlease(rec.key, rec.vrec)
            self.writes.connection_closed(conn)
            for volume_id in self.catalog.volumes_of(conn):
                self.catalog.volume_gone(volume_id)  # a writer's GPU memory, a volume process

    def keys(self, conn: int, *, prefix: str) -> dict[str, Any]:
        with self.catalog.lock:
            return {
                "keys": sorted(
                    k
                    for k, r in self.catalog.keys.items()
                    if k.startswith(prefix) and any(v.committed for v in r.versions.values())
                )
            }

    def versions(self, conn: int, *, key: str) -> dict[str, Any]:
        with self.catalog.lock:
            krec = self.catalog.keys.get(key)
            if krec is None:
                raise KeyNotFoundError(f"key {key!r} not found{self.catalog.suggest(key)}")
            return {"versions": sorted(v for v, r in krec.versions.items() if r.committed)}

    def exists(self, conn: int, *, key: str, version: int | None) -> dict[str, Any]:
        with self.catalog.lock:
            krec = self.catalog.keys.get(key)
            if krec is None:
                return {"exists": False}
            if version is None:
                return {"exists": any(r.committed for r in krec.versions.values())}
            vrec = krec.versions.get(version)
            return {"exists": vrec is not None and vrec.committed}

    def delete(self, conn: int, *, key: str, version: int | None) -> dict[str, Any]:
        """Drop one version or the whole key; returns how many committed versions went."""
        with self.catalog.lock:
            krec = self.catalog.keys.get(key)
            if krec is None:
                raise KeyNotFoundError(f"key {key!r} not found{self.catalog.suggest(key)}")
            if version is not None:
                vrec = krec.versions.get(version)
                if vrec is None or not vrec.committed:
                    self._resolve(key, krec, version)  # raises the precise error
                    raise VersionNotFoundError(f"version {version} of key {key!r} not found")
                self.catalog.drop(key, krec, vrec, "deleted", destroy=True)
                return {"deleted": 1}
            n = sum(1 for r in krec.versions.values() if r.committed)
            for vrec in list(krec.versions.values()):
                self.catalog.drop(key, krec, vrec, "deleted", destroy=True)
            for pool in krec.free.values():
                self.catalog.destroy_slots(pool)
            krec.free.clear()
            del self.catalog.keys[key]
            return {"deleted": n}

    def ls(self, conn: int, *, prefix: str) -> dict[str, Any]:
        """Keys with their committed versions, bytes, tensor count and volumes."""
        with self.catalog.lock:
            out = []
            for key in sorted(self.catalog.keys):
                if not key.startswith(prefix):
                    continue
                krec = self.catalog.keys[key]
                for v in sorted(krec.versions):
                    vrec = krec.versions[v]
                    if not vrec.committed:
                        continue
                    shards = [s for _, s in vrec.shards()]
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
            return {"entries": out, "volumes": self.catalog.volume_states()}

    def volumes(self, conn: int) -> dict[str, Any]:
        with self.catalog.lock:
            return {"volumes": self.catalog.volume_states()}

    def readers_waiting(self, key: str, version: int) -> bool:
        """Whether a streaming reader waits for ``version`` of ``key`` (tidal.store.testing)."""
        with self.catalog.lock:
            return self.catalog.wanted(key, version)

    def counts(self) -> dict[str, int]:
        """Live leases, slots, plans and reservations (tidal.store.testing)."""
        with self.catalog.lock:
            return {
                "leases": len(self._leases),
                "slots": self.catalog.slot_count(),
                **self.writes.counts(),
            }
