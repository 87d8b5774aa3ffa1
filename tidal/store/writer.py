"""The put path of a store handle: declare a layout once, then copy and commit.

A put runs on the handle's writer connection, holding it from ``put_begin`` to
``put_commit``:

1. Look the layout up among this connection's put plans (:mod:`tidal.store.plans`); a new
   layout is declared with ``put_declare`` (the only time per-tensor metadata is sent).
2. With slots reserved by the previous put's commit, send ``put_begin`` without waiting,
   copy the first chunk into the reserved slots, then read the reply: it says whether a
   reader streams this version (then every later chunk is reported with ``put_progress``)
   and names any extra slot to write. Without a reservation (the first put of a plan),
   wait for ``put_begin``'s slots, then copy.
3. ``put_commit``: the version becomes visible (once every writer of it has committed);
   from the second put of a layout on, the reply also reserves the slots of the next put
   (a layout put once, such as a one-off key, holds no memory for a put that never comes).

A steady writer thus waits for one round trip per put (the commit) and sends no tensor
metadata. A reservation is only used on the connection (generation) that made it, so bytes
are never copied into slots the controller may have handed to someone else.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from tidal.store import boxes, ops, plans, progress
from tidal.store.boxes import Path
from tidal.store.conn import Conn
from tidal.store.errors import StoreError
from tidal.store.plans import PutPlan
from tidal.store.progress import Progress
from tidal.store.session import Session
from tidal.store.transports import WriteJob

MAX_PLANS = 1024  # put plans kept per handle (a layout each)
MAX_LAST = 8  # keys whose last put's tensors a handle remembers (holding those tensors)


class Writer:
    def __init__(self, session: Session) -> None:
        self.s = session
        self._plans: dict[tuple[Any, ...], PutPlan] = {}
        # (key, kind, memory, volume, writers, keep, dtype) -> the last put's tensors (as
        # _tensors_key names them), fingerprint, local shards and plan: a steady writer
        # puts the same tensors every time and skips the per-tensor fingerprint.
        self._last: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self._lock = threading.Lock()
        self.declared = 0  # put plans declared (diagnostics: a steady writer declares none)

    def put(
        self,
        key: str,
        kind: str,
        items: list[tuple[Path, Any]],
        *,
        version: int | None,
        writers: int | None,
        keep: int | None,
        memory: str,
        dtype: torch.dtype | None,
    ) -> int:
        tensors, objects = _split(items, kind)
        conn = self.s.writer_conn()
        with conn.lock:
            conn.ensure()
            volume = self.s.put_volume(memory)
            how = (key, kind, memory, volume, writers, keep, dtype)
            same = _tensors_key(tensors)
            last = self._last.get(how)
            if same is not None and last is not None and last[0] == same:  # as last time
                fp, locals_ = last[1], last[2]
            else:
                fp, locals_ = (*how[:-1], plans.fingerprint(tensors, dtype)), None
            with self._lock:
                plan = self._plans.get(fp)
            if plan is None or plan.generation != conn.generation:
                plan, locals_ = self._declare(
                    conn, fp, key, kind, tensors, dtype, writers, keep, volume
                )
            elif locals_ is None:
                locals_ = plans.local_shards(tensors)
            if last is None or last[0] != same or last[3] is not plan:
                plan.jobs.clear()  # jobs name the tensors they copy from
                self._remember(how, same, fp, locals_, plan)
            return self._write(conn, plan, key, version, locals_, objects)

    def _remember(
        self,
        how: tuple[Any, ...],
        same: tuple[Any, ...] | None,
        fp: tuple[Any, ...],
        locals_: list[torch.Tensor],
        plan: PutPlan,
    ) -> None:
        """Keep this put's plan and local shards for the next put of the same tensors
        (``same`` None: a DTensor among them, nothing kept)."""
        if same is None:
            with self._lock:
                self._last.pop(how, None)
            return
        with self._lock:
            self._last.pop(how, None)
            while len(self._last) >= MAX_LAST:  # forget the oldest, and its plan's jobs
                self._last.pop(next(iter(self._last)))[3].jobs.clear()
            self._last[how] = (same, fp, locals_, plan)

    def _declare(
        self,
        conn: Conn,
        fp: tuple[Any, ...],
        key: str,
        kind: str,
        tensors: list[tuple[Path, torch.Tensor]],
        dtype: torch.dtype | None,
        writers: int | None,
        keep: int | None,
        volume: str | None,
    ) -> tuple[PutPlan, list[torch.Tensor]]:
        decls, locals_, meshes = plans.describe(tensors, dtype)
        reply = conn.request(
            ops.PUT_DECLARE,
            key=key,
            kind=kind,
            writers=writers if writers is not None else _default_writers(meshes),
            keep=keep,
            host=self.s.host,
            volume=volume,
            tensors=decls,
        )
        dtypes = [plans.stored_dtype(t, dtype) for _, t in tensors]
        nbytes = [t.numel() * d.itemsize for t, d in zip(locals_, dtypes, strict=True)]
        where = ops.VolumeInfo.decode(reply["volume"])
        plan = PutPlan(reply["plan"], where, conn.generation, dtypes, nbytes)
        with self._lock:
            self.declared += 1
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()  # old layouts; their plans die with the connection
            self._plans[fp] = plan
        return plan, locals_

    def _write(
        self,
        conn: Conn,
        plan: PutPlan,
        key: str,
        version: int | None,
        locals_: list[torch.Tensor],
        objects: list[dict[str, Any]],
    ) -> int:
        vol = plan.volume
        transport = self.s.transport_for(vol)
        res, plan.reservation = plan.reservation, None
        begin: dict[str, Any] = {
            "key": key,
            "plan": plan.plan_id,
            "version": version,
            "writer": self.s.writer,
            "objects": objects,
        }

        fresh: set[int] = set(res["fresh"]) if res is not None else set()

        def jobs(slots: list[int | None], skip: list[int | None] | None = None) -> list[WriteJob]:
            return [
                WriteJob(s, t, d, s in fresh, n)
                for i, (s, t, d, n) in enumerate(
                    zip(slots, locals_, plan.dtypes, plan.nbytes, strict=True)
                )
                if s is not None and (skip is None or skip[i] is None)
            ]

        started = False
        try:
            if res is not None:
                at = (tuple(res["slots"]), tuple(res["fresh"]))
                todo = plan.jobs.get(at) or jobs(res["slots"])
                if at not in plan.jobs:
                    if len(plan.jobs) >= 8:  # a key's ring holds a few slot sets
                        plan.jobs.clear()
                    plan.jobs[at] = todo
                transport.prepare_write(todo)  # before readers may hear of the slots
                # The reservation names slots of this connection: never resend it on another.
                conn.send(ops.PUT_BEGIN, reconnect=False, reservation=res["id"], **begin)
                started = True
                first, rest = transport.split_early(todo)  # the reply says who streams
                try:
                    transport.write(vol, first, Progress(None), res["grant"])
                finally:
                    reply = conn.receive(ops.PUT_BEGIN)
                version = reply["version"]
                fresh.update(reply["fresh"])
                extra: list[WriteJob] = []
                if reply["slots"] != res["slots"]:  # rare: a replica moved (several writers)
                    # A reserved shard that another writer stored first this time is a
                    # replica: the controller took its slot back (copied into already:
                    # harmless, the slot is quarantined), so it is neither written further
                    # nor reported as ours.
                    mine = {s for s in reply["slots"] if s is not None}
                    todo = [j for j in todo if j.slot in mine]
                    first = [j for j in first if j.slot in mine]
                    rest = [j for j in rest if j.slot in mine]
                    extra = jobs(reply["slots"], skip=res["slots"])
                prog, send = self._progress(conn, key, version, reply["report"], todo)
                if reply["report"] and first:
                    send([j.slot for j in first])
                transport.slots_freed(reply["freed"])
                transport.prepare_write(extra)
                transport.write(vol, rest + extra, prog, res["grant"])
            else:
                reply = conn.request(ops.PUT_BEGIN, reservation=None, **begin)
                started = True
                version = reply["version"]
                fresh.update(reply["fresh"])
                todo = jobs(reply["slots"])
                transport.slots_freed(reply["freed"])
                transport.prepare_write(todo)
                prog, _ = self._progress(conn, key, version, reply["report"], todo)
                transport.write(vol, todo, prog, reply["grant"])
        except BaseException:
            if started and version is not None:
                _abort(conn, key, version, self.s.writer)
            raise
        assert version is not None, "put_begin names the version"
        # A layout put once (a one-off key, a rollout) reserves nothing; from its second put
        # on, a layout is taken to repeat, and its commit reserves the next put's slots.
        plan.puts += 1
        done = conn.request(
            ops.PUT_COMMIT, key=key, version=version, writer=self.s.writer, reserve=plan.puts >= 2
        )
        if done["next"] is not None and conn.generation == plan.generation:
            plan.reservation = done["next"]
        transport.slots_freed(done["freed"])
        return version

    def _progress(
        self, conn: Conn, key: str, version: int, report: bool, jobs: list[WriteJob]
    ) -> tuple[Progress, Callable[[list[int]], None]]:
        """A Progress for the copies of this put, and its reporting function (which tells
        the controller slots are written, for a streaming reader; unused without one). It
        reports every ``PROGRESS_BYTES``, and at most ``progress.MAX_REPORTS`` times a put."""

        def send(slots: list[int]) -> None:
            conn.request(
                ops.PUT_PROGRESS, key=key, version=version, writer=self.s.writer, slots=slots
            )

        total = sum(j.nbytes for j in jobs)
        every = max(progress.PROGRESS_BYTES, total // progress.MAX_REPORTS)
        return Progress(send if report else None, every), send


def _tensors_key(tensors: list[tuple[Path, torch.Tensor]]) -> tuple[Any, ...] | None:
    """Names and identities of a put's tensors (plans.identity): equal for a repeated put
    of the same tensor objects, at the same addresses and shapes, under the same names.
    None with a DTensor among them (its box depends on more than its local tensor)."""
    values = [t for _, t in tensors]
    if not all(type(t) in plans.PLAIN for t in values):
        return None
    ident = plans.identity(values)
    return None if ident is None else (tuple([p for p, _ in tensors]), ident)


def _abort(conn: Conn, key: str, version: int, writer: str) -> None:
    """Best effort: the connection's close aborts the write as well."""
    if not conn.connected:
        return
    try:
        conn.request(ops.PUT_ABORT, key=key, version=version, writer=writer)
    except (StoreError, ValueError):
        pass


def _split(items: list[tuple[Path, Any]], kind: str) -> tuple[list, list[dict[str, Any]]]:
    """Tensors (and DTensors) apart from the plain values of a state dict."""
    tensors, objects = [], []
    for path, v in items:
        if isinstance(v, torch.Tensor):
            plans.check_strided(path, v)
            tensors.append((path, v))
        elif kind == "state_dict":
            objects.append({"name": list(path), "value": _plain(path, v)})
        else:
            raise TypeError(f"expected a torch.Tensor or DTensor, got {type(v).__name__}")
    return tensors, objects


def _plain(path: Path, v: Any) -> Any:
    """A state-dict leaf that travels as msgpack (tuples become lists); TypeError else."""
    if v is None or isinstance(v, bool | int | float | str | bytes):
        return v
    if isinstance(v, list | tuple):
        return [_plain((*path, i), x) for i, x in enumerate(v)]
    if isinstance(v, Mapping):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise TypeError(f"state dict entry {boxes.path_str(path)!r}: key {k!r} is no str")
            out[k] = _plain((*path, k), x)
        return out
    raise TypeError(
        f"state dict entry {boxes.path_str(path)!r} is a {type(v).__name__}; tidal.store "
        "holds tensors, DTensors and plain values (None, bool, int, float, str, bytes, and "
        "lists or dicts of them)"
    )


def _default_writers(largest_mesh: int) -> int:
    """SPMD default: with DTensors, every rank of the job puts (replicas included, they send
    no bytes); without, one process."""
    if largest_mesh == 0:
        return 1
    if dist.is_available() and dist.is_initialized():
        return max(largest_mesh, dist.get_world_size())
    return largest_mesh
