"""The controller's write ops: declare a layout, begin, report, commit or abort a version.

A writer declares its layout of a key once (``put_declare``: names, shapes, dtypes, boxes,
checked once) and gets a put plan, kept for its connection. Each put then names the plan:
``put_begin`` claims a slot per shard from the key's ring (or takes the reservation the
writer's last commit returned) and grants them for network writes; ``put_commit`` seals the
writer's slots, makes the version visible once every writer has committed, and (asked with
``reserve``) claims the slots of the writer's next put. A steady writer therefore sends no
per-tensor metadata, and can copy into reserved slots while its ``put_begin`` is on the way:
one round trip per put (benchmarks/store_sync.py, the cached-put row).

Replicated shards (identical boxes from several writers) are stored once: the first writer
to begin keeps it, the others get no slot for it and reserve none next time.

Lifecycle: one :class:`Writes` per controller (tidal/store/controller.py), over the
controller's :class:`~tidal.store.catalog.Catalog`. The server's connection threads call
its op methods (``Controller.op_handler``) with the calling connection's id; the controller
calls :meth:`Writes.connection_closed` when a connection ends. What it keeps (plans,
reservations, pending writes, quarantined slots) is the catalog's lock's to guard.
"""

from __future__ import annotations

import secrets
from typing import Any

from tidal.store import boxes, ops, wire
from tidal.store.backends import DeviceBackend
from tidal.store.catalog import Catalog, RingSlot, Work, call, check_kind, run_work, version_sig
from tidal.store.errors import StoreError, VolumeLostError
from tidal.store.records import (
    Entry,
    KeyRec,
    Name,
    PlanRec,
    Reservation,
    ShardRec,
    TensorRec,
    VersionRec,
    VolumeRec,
    layout_signature,
)

MAX_OBJECT_BYTES = 1 << 20  # non-tensor leaves of one version


class Writes:
    """Handlers of the write ops (see the module docstring), over the controller's catalog.

    Owns what only writes use: put plans, reservations, the pending writes and the
    quarantine. The catalog's lock guards it all; the controller holds one and serves the
    write ops through it.
    """

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._plans: dict[int, PlanRec] = {}
        self._reservations: dict[int, Reservation] = {}
        # Pending writes by (connection, key, version, writer), found even once dropped.
        self._writing: dict[tuple[int, str, int, str], VersionRec] = {}
        # Slots a connection may still be copying into, by connection: (key, slots).
        self._quarantine: dict[int, list[tuple[str, list[RingSlot]]]] = {}
        # Layouts whose shards were found to tile every tensor: writers' (plan, replicas)
        # -> signature (``_publish``).
        self._checked: dict[tuple[Any, ...], str] = {}

    def connection_closed(self, conn: int) -> None:
        """Release the reservations, pending writes, quarantined slots and plans of a closed
        connection (the caller holds the lock)."""
        catalog = self.catalog
        for rid in [r for r, res in self._reservations.items() if res.conn == conn]:
            catalog.destroy_slots([s for s in self._reservations.pop(rid).slots if s])
        for (c, key, _, writer), vrec in list(self._writing.items()):
            if c != conn:
                continue
            krec = catalog.keys.get(key)
            if vrec.dropped is None and krec is not None:
                catalog.drop(key, krec, vrec, "aborted: a writer disconnected")
            self._end_write(conn, key, vrec, writer)
        self._flush_quarantine(conn)
        for pid in [p for p, rec in self._plans.items() if rec.conn == conn]:
            del self._plans[pid]

    def counts(self) -> dict[str, int]:
        """Live plans and reservations."""
        return {"plans": len(self._plans), "reservations": len(self._reservations)}

    def _end_write(self, conn: int, key: str, vrec: VersionRec, writer: str) -> None:
        """``writer`` stopped writing ``vrec`` (committed, aborted, or left)."""
        if self._writing.pop((conn, key, vrec.version, writer), None) is None:
            return
        self.catalog.writer_done(key, vrec)

    def _flush_quarantine(self, conn: int) -> None:
        """``conn`` sent its next write (or closed): the slots it may have been copying
        into are free for others."""
        for key, items in self._quarantine.pop(conn, []):
            krec = self.catalog.keys.get(key)
            if krec is None:
                self.catalog.destroy_slots([slot for *_, slot in items])
            else:
                self.catalog.to_ring(krec, items)

    def device_volume(self, conn: int, *, volume_id: str, host: str) -> dict[str, Any]:
        """Register ``conn``'s GPU memory as a volume of kind "cuda" that dies with it
        (see tidal/store/transports/cuda/ipc.py)."""
        rec = VolumeRec(volume_id, "cuda", host, "", "", "", DeviceBackend(), owner=conn)
        self.catalog.add_volume(rec)
        return {}

    def put_handles(self, conn: int, *, volume_id: str, handles: list[dict]) -> dict[str, Any]:
        """The owner of a device volume sends the IPC handles of slots it allocated."""
        with self.catalog.lock:
            vol = self.catalog.own_device_volume(conn, volume_id)
            for h in handles:  # all or nothing
                if self.catalog.slot_volume(h["slot"]) != volume_id:
                    raise ValueError(f"slot {h['slot']} is not a slot of volume {volume_id!r}")
            for h in handles:
                vol.handles[h["slot"]] = h
            return {}

    def put_declare(
        self,
        conn: int,
        *,
        key: str,
        kind: str,
        writers: int,
        keep: int | None,
        host: str,
        volume: str | None,
        tensors: list[dict],
    ) -> dict[str, Any]:
        """Check a writer's layout once and keep it as a put plan of ``conn``."""
        entries = []
        for d in tensors:
            name, shape, dtype = tuple(d["name"]), tuple(d["shape"]), d["dtype"]
            offs, sizes = tuple(d["offsets"]), tuple(d["sizes"])
            shown = boxes.path_str(name) or key
            if len(offs) != len(shape) or len(sizes) != len(shape):
                raise ValueError(f"{shown}: box {offs}/{sizes} does not match shape {shape}")
            if any(o + s > n for o, s, n in zip(offs, sizes, shape, strict=True)):
                raise ValueError(f"{shown}: box {offs}/{sizes} lies outside shape {shape}")
            nbytes = boxes.numel(sizes) * wire.DTYPES[dtype].itemsize
            entries.append(Entry(name, shape, dtype, offs, sizes, nbytes))
        if len({e.name for e in entries}) != len(entries):
            raise ValueError(f"key {key!r}: a tensor name appears twice in one put")
        with self.catalog.lock:
            krec = self.catalog.keys.get(key)
            if krec is not None:
                check_kind(key, krec.kind, kind)
            vol = self._pick_volume(conn, host, volume)
            declared = {e.name: (e.shape, e.dtype, [(e.offsets, e.sizes)]) for e in entries}
            plan = PlanRec(
                self.catalog.new_id(),
                key,
                kind,
                conn,
                writers,
                keep,
                vol.volume_id,
                entries,
                layout_signature(kind, declared),
            )
            self._plans[plan.plan] = plan
            return {"plan": plan.plan, "volume": vol.info()}

    def _pick_volume(self, conn: int, host: str, wanted: str | None) -> VolumeRec:
        alive = [v for v in self.catalog.volumes.values() if v.alive]
        if wanted is not None:
            for v in alive:
                if v.volume_id == wanted:
                    if v.kind == "cuda":
                        self.catalog.own_device_volume(conn, wanted)  # raises for another's memory
                    return v
            raise ValueError(
                f"volume {wanted!r} is not registered (alive: {[v.volume_id for v in alive]})"
            )
        alive = [v for v in alive if v.kind == "shm"]  # device volumes take their owner's only
        if not alive:
            raise StoreError("the store has no live storage volume")
        local = [v for v in alive if v.host == host] or alive
        return min(local, key=lambda v: v.used)

    def _plan_of(self, conn: int, key: str, plan_id: int) -> PlanRec:
        plan = self._plans.get(plan_id)
        if plan is None or plan.conn != conn or plan.key != key:
            raise ValueError(f"put plan {plan_id} of key {key!r} is not one of this connection")
        vol = self.catalog.volumes.get(plan.volume)
        if vol is None or not vol.alive:
            raise VolumeLostError(f"volume {plan.volume!r} of this put plan is gone; put again")
        return plan

    def put_begin(
        self,
        conn: int,
        *,
        key: str,
        plan: int,
        version: int | None,
        writer: str,
        reservation: int | None,
        objects: list[dict],
    ) -> dict[str, Any]:
        """Start writing a version with a plan's layout: claim a slot per shard (or take the
        writer's reservation) and grant them for writing."""
        with self.catalog.lock:
            self._flush_quarantine(conn)
            p = self._plan_of(conn, key, plan)
            res = self._take_reservation(conn, p, reservation)
            try:
                krec = self.catalog.keys.get(key)
                if krec is None:
                    krec = self.catalog.keys[key] = KeyRec(kind=p.kind)
                check_kind(key, krec.kind, p.kind)
                vrec, created = self._version_for(key, krec, p, version, writer)
                vol = self.catalog.volumes[p.volume]
                try:
                    slots, fresh, granted = self._claim_all(key, krec, vrec, p, vol, res, conn)
                    self._add_objects(key, vrec, objects)
                except BaseException:
                    if created:
                        del krec.versions[vrec.version]
                    raise
            except BaseException:
                if res is not None:  # the writer may be copying into them already
                    self._quarantine_slots(conn, key, p, res.slots)
                raise
            vrec.seen[writer] = conn
            vrec.plans[writer] = p.plan
            vrec.mine[writer] = [s for s in slots if s is not None]
            vrec.writing += 1
            self._writing[(conn, key, vrec.version, writer)] = vrec
            report = self.catalog.wanted(key, vrec.version)
            grant = res.grant if res is not None else secrets.token_bytes(ops.GRANT_BYTES)
            work: Work = []
            if fresh:
                sizes = self.catalog.slot_sizes(fresh)
                work.append((vol, call(vol.backend.create, sizes)))
            if granted:
                work.append((vol, call(vol.backend.grant, granted, grant)))
            self.catalog.changed.notify_all()
            freed = self.catalog.freed(vol)
        run_work(work, lambda e: self._abort_write(conn, key, vrec, vol, writer, e))
        return {
            "version": vrec.version,
            "slots": slots,
            "fresh": fresh,
            "grant": grant,
            "report": report,
            "freed": freed,
        }

    def _version_for(
        self, key: str, krec: KeyRec, p: PlanRec, version: int | None, writer: str
    ) -> tuple[VersionRec, bool]:
        """The pending record of ``version`` this writer joins (made if new)."""
        if version is None:
            if p.writers > 1:
                raise ValueError(
                    f"key {key!r}: pass an explicit version= when {p.writers} processes "
                    "write one version (they must agree on it)"
                )
            version = krec.next_version
        vrec = krec.versions.get(version)
        created = vrec is None
        if vrec is None:
            if version in krec.gone:
                raise ValueError(
                    f"version {version} of key {key!r} was already written and dropped "
                    f"({krec.gone[version]}); versions are immutable, use a new number"
                )
            if p.keep is not None:
                krec.keep = p.keep
            keep = krec.keep if krec.keep is not None else self.catalog.keep
            vrec = krec.versions[version] = VersionRec(version, p.kind, p.writers, keep)
            krec.next_version = max(krec.next_version, version + 1)
        elif vrec.committed:
            raise ValueError(
                f"version {version} of key {key!r} already exists; versions are immutable"
            )
        elif vrec.writers != p.writers:
            raise ValueError(
                f"version {version} of key {key!r}: this writer expects {p.writers} "
                f"writers, an earlier one said {vrec.writers}"
            )
        if writer in vrec.seen:
            raise ValueError(f"writer {writer} already put version {version} of key {key!r}")
        if len(vrec.seen) >= vrec.writers:
            raise ValueError(
                f"version {version} of key {key!r} already has its {vrec.writers} writers"
            )
        return vrec, created

    def _claim_all(
        self,
        key: str,
        krec: KeyRec,
        vrec: VersionRec,
        p: PlanRec,
        vol: VolumeRec,
        res: Reservation | None,
        conn: int,
    ) -> tuple[list[int | None], list[int], list[int]]:
        """Record the plan's shards in ``vrec``: a slot each (None for an empty shard or a
        replica of one another writer stores), checking the writers agree on every tensor.
        Returns the slots, those new to the volume, and those to grant (not reserved)."""
        if not vrec.tensors:  # the first writer to begin: nothing to agree with
            return self._claim_first(krec, vrec, p, vol, res)
        slots: list[int | None] = []
        fresh: list[int] = []
        claimed: list[RingSlot] = []  # taken from the ring or new in this call
        spare: list[RingSlot] = []  # reserved slots of shards that turned out replicas
        added: list[tuple[TensorRec, ShardRec]] = []
        made: list[Name] = []
        try:
            for i, e in enumerate(p.entries):
                trec = vrec.tensors.get(e.name)
                if trec is None:
                    trec = vrec.tensors[e.name] = TensorRec(e.shape, e.dtype)
                    made.append(e.name)
                elif trec.shape != e.shape or trec.dtype != e.dtype:
                    shown = boxes.path_str(e.name) or key
                    raise ValueError(
                        f"{shown} in version {vrec.version} of key {key!r}: this writer has "
                        f"global shape {list(e.shape)} {e.dtype}, another has "
                        f"{list(trec.shape)} {trec.dtype}"
                    )
                reserved = res.slots[i] if res is not None else None
                replica = any(s.offsets == e.offsets and s.sizes == e.sizes for s in trec.shards)
                if e.nbytes == 0 or replica:
                    if replica:
                        p.replicas.add(i)
                    if reserved is not None:
                        spare.append((vol.volume_id, e.name, e.nbytes, reserved))
                    slots.append(None)
                    continue
                p.replicas.discard(i)
                slot = reserved
                if slot is None:
                    slot = self.catalog.claim(krec, vol, p.rings[i], fresh)
                    claimed.append((vol.volume_id, e.name, e.nbytes, slot))
                shard = ShardRec(e.offsets, e.sizes, slot, vol.volume_id, e.nbytes)
                trec.shards.append(shard)
                added.append((trec, shard))
                slots.append(slot)
        except BaseException:
            for trec, shard in added:
                trec.shards.remove(shard)
            for name in made:
                vrec.tensors.pop(name, None)
            for _, _, nbytes, slot in claimed:
                if slot in fresh:  # never created on the volume: forget it
                    self.catalog.unclaim_fresh(vol, slot, nbytes)
            self.catalog.to_ring(krec, [c for c in claimed if c[3] not in fresh])
            raise
        if spare:  # the writer may be copying into them: free once it is done
            self._quarantine.setdefault(conn, []).append((key, spare))
        return slots, fresh, [c[3] for c in claimed]

    def _claim_first(
        self, krec: KeyRec, vrec: VersionRec, p: PlanRec, vol: VolumeRec, res: Reservation | None
    ) -> tuple[list[int | None], list[int], list[int]]:
        """``_claim_all`` for the first writer of a version: every tensor is new to it, so no
        shard is a replica and no shape needs checking (a steady writer's every put, in one
        pass over the plan)."""
        p.replicas.clear()
        reserved = res.slots if res is not None else [None] * len(p.entries)
        fresh: list[int] = []
        claimed: list[int] = []
        slots: list[int | None] = []
        tensors = vrec.tensors
        vid = vol.volume_id
        for e, ring, slot in zip(p.entries, p.rings, reserved, strict=True):
            if e.nbytes == 0:
                tensors[e.name] = TensorRec(e.shape, e.dtype)
                slots.append(None)
                continue
            if slot is None:  # a shard that was a replica last time
                slot = self.catalog.claim(krec, vol, ring, fresh)
                claimed.append(slot)
            shard = ShardRec(e.offsets, e.sizes, slot, vid, e.nbytes)
            tensors[e.name] = TensorRec(e.shape, e.dtype, [shard])
            slots.append(slot)
        if len(tensors) != len(p.entries):  # put_declare refuses repeated names
            raise AssertionError(f"plan {p.plan} names a tensor twice")
        return slots, fresh, claimed

    def _quarantine_slots(self, conn: int, key: str, p: PlanRec, slots: list[int | None]) -> None:
        """Slots of ``p`` that ``conn`` may still be copying into: kept from everyone else
        until it sends its next write (its copies are done by then) or closes."""
        items = [
            (p.volume, e.name, e.nbytes, s)
            for s, e in zip(slots, p.entries, strict=True)
            if s is not None
        ]
        if items:
            self._quarantine.setdefault(conn, []).append((key, items))

    def _add_objects(self, key: str, vrec: VersionRec, objects: list[dict]) -> None:
        size = len(wire.pack({"objects": objects}))
        if size > MAX_OBJECT_BYTES:
            raise ValueError(
                f"key {key!r}: non-tensor leaves take {size} bytes; the limit is "
                f"{MAX_OBJECT_BYTES} (store large data as tensors)"
            )
        for o in objects:
            name = tuple(o["name"])
            if name in vrec.objects and vrec.objects[name] != o["value"]:
                shown = boxes.path_str(name)
                raise ValueError(
                    f"{shown} in version {vrec.version} of key {key!r}: writers disagree "
                    f"on its value ({vrec.objects[name]!r} and {o['value']!r})"
                )
        for o in objects:
            vrec.objects[tuple(o["name"])] = o["value"]

    def _take_reservation(
        self, conn: int, p: PlanRec, reservation: int | None
    ) -> Reservation | None:
        if reservation is None:
            return None
        res = self._reservations.pop(reservation, None)
        if res is None or res.conn != conn or res.plan != p.plan:
            if res is not None:
                self._reservations[res.rid] = res  # someone else's: leave it alone
            raise ValueError(f"reservation {reservation} is not held by this connection")
        return res

    def _abort_write(
        self, conn: int, key: str, vrec: VersionRec, vol: VolumeRec, writer: str, e: BaseException
    ) -> None:
        """The volume could not take a write ``put_begin`` registered: drop the version and
        end this writer's part in it, so its slots are destroyed now, not when the
        connection closes (a writer may have copied into reserved ones: destroyed slots are
        never handed to anyone else)."""
        with self.catalog.lock:
            krec = self.catalog.keys.get(key)
            if krec is not None and vrec.dropped is None:
                reason = f"aborted: volume {vol.volume_id!r} could not take the write: {e}"
                self.catalog.drop(key, krec, vrec, reason, destroy=True)
            vrec.destroy = True
            self._end_write(conn, key, vrec, writer)

    def put_progress(
        self, conn: int, *, key: str, version: int, writer: str, slots: list[int]
    ) -> dict[str, Any]:
        """A writer's bytes for ``slots`` of a pending version are in place (for readers that
        stream a version while it is written; it stays invisible to others until commit)."""
        with self.catalog.lock:
            vrec = self._pending(conn, key, version, writer)
            if not set(slots) <= set(vrec.mine[writer]):
                raise ValueError(f"slots {slots} are not this writer's in version {version}")
            vrec.written.update(slots)
            self.catalog.changed.notify_all()
            return {}

    def put_commit(
        self, conn: int, *, key: str, version: int, writer: str, reserve: bool
    ) -> dict[str, Any]:
        with self.catalog.lock:
            self._flush_quarantine(conn)
            vrec = self._pending(conn, key, version, writer)
            p = self._plans.get(vrec.plans[writer])
            vol = self.catalog.volumes.get(p.volume) if p is not None else None
            mine = vrec.mine[writer]
        if vol is not None and vol.alive:
            vol.backend.seal(mine)  # no network write lands after this
        with self.catalog.lock:
            vrec = self._pending(conn, key, version, writer)
            self._end_write(conn, key, vrec, writer)
            vrec.done.add(writer)
            krec = self.catalog.keys[key]
            visible = len(vrec.done) == vrec.writers
            if visible:
                self._publish(key, krec, vrec)
            res = None
            if reserve and p is not None and vol is not None and vol.alive:
                res = self._reserve(krec, p, vol)
            freed = self.catalog.freed(vol) if vol is not None else []
        out: dict[str, Any] = {"visible": visible, "next": None, "freed": freed}
        if res is not None and vol is not None:
            work: Work = []
            if res.fresh:
                sizes = self.catalog.slot_sizes(res.fresh)
                work.append((vol, call(vol.backend.create, sizes)))
            held = [s for s in res.slots if s is not None]
            if held:
                work.append((vol, call(vol.backend.grant, held, res.grant)))
            run_work(work, lambda e: self._drop_reservation(res))
            out["next"] = {
                "id": res.rid,
                "slots": res.slots,
                "fresh": res.fresh,
                "grant": res.grant,
            }
        return out

    def _publish(self, key: str, krec: KeyRec, vrec: VersionRec) -> None:
        """Check that the shards tile every tensor and make the version visible. The check
        and the layout signature are made once per set of writers' plans (and shards each
        left to a replica): a steady writer's commit checks nothing again."""
        layout_key = tuple(
            sorted(
                (p, frozenset(self._plans[p].replicas))
                for p in vrec.plans.values()
                if p in self._plans
            )
        )
        for trec in vrec.tensors.values():
            if len(trec.shards) > 1:
                trec.shards.sort(key=lambda s: s.offsets)
        sig = self._checked.get(layout_key)
        if sig is None:
            for name, trec in vrec.tensors.items():
                tiles = [(s.offsets, s.sizes) for s in trec.shards]
                problem = boxes.check_cover(trec.shape, tiles)
                if problem is not None:
                    shown = boxes.path_str(name) or key
                    self.catalog.drop(
                        key, krec, vrec, f"aborted: {shown}: {problem}", destroy=False
                    )
                    raise ValueError(
                        f"version {vrec.version} of key {key!r} is incomplete after all "
                        f"{vrec.writers} writers committed: {shown}: {problem}"
                    )
            sig = version_sig(vrec)
            if len(self._checked) > 4096:
                self._checked.clear()
            self._checked[layout_key] = sig
        vrec.committed = True
        vrec.sig = sig
        vrec.layout = layout_key
        self.catalog.retain(key, krec, vrec.keep)
        self.catalog.changed.notify_all()

    def _reserve(self, krec: KeyRec, p: PlanRec, vol: VolumeRec) -> Reservation | None:
        """Claim slots for the writer's next put of ``p`` (its shards that were no replica)."""
        if not vol.alive:
            return None
        fresh: list[int] = []
        slots: list[int | None] = [
            None if e.nbytes == 0 or i in p.replicas else self.catalog.claim(krec, vol, ring, fresh)
            for i, (e, ring) in enumerate(zip(p.entries, p.rings, strict=True))
        ]
        res = Reservation(
            self.catalog.new_id(),
            p.plan,
            p.conn,
            slots,
            secrets.token_bytes(ops.GRANT_BYTES),
            fresh,
        )
        self._reservations[res.rid] = res
        return res

    def _drop_reservation(self, res: Reservation) -> None:
        with self.catalog.lock:
            if self._reservations.pop(res.rid, None) is None:
                return
            self.catalog.destroy_slots([s for s in res.slots if s is not None])

    def put_abort(self, conn: int, *, key: str, version: int, writer: str) -> dict[str, Any]:
        with self.catalog.lock:
            self._flush_quarantine(conn)
            vrec = self._pending(conn, key, version, writer)
            self._end_write(conn, key, vrec, writer)
            self.catalog.drop(key, self.catalog.keys[key], vrec, f"aborted by writer {writer}")
            return {}

    def _pending(self, conn: int, key: str, version: int, writer: str) -> VersionRec:
        """The version ``conn`` is writing as ``writer``; raises ValueError otherwise (a
        write of another connection, or one that ended: the reason is named)."""
        vrec = self._writing.get((conn, key, version, writer))
        if vrec is None:
            krec = self.catalog.keys.get(key)
            other = krec.versions.get(version) if krec else None
            if other is not None and writer in other.seen and not other.committed:
                raise ValueError(
                    f"version {version} of key {key!r} is written by {writer} on another "
                    "connection; only that connection may report, commit or abort it"
                )
            reason = krec.gone.get(version) if krec else None
            raise ValueError(
                f"version {version} of key {key!r} has no pending write by {writer} on this "
                "connection" + (f" ({reason})" if reason else "")
            )
        if vrec.dropped is not None:
            self._end_write(conn, key, vrec, writer)
            raise ValueError(f"version {version} of key {key!r} is {vrec.dropped}")
        return vrec
