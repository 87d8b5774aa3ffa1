"""NIXL (NVIDIA's transfer library, on UCX): one-sided reads of a volume's slots.

The extra ``tidal[nixl]`` (``nixl-cu12`` or ``nixl-cu13`` from PyPI) adds it; without it this
module imports nothing and :func:`load` names the missing package.

- Volume side (:class:`VolumeAgent`, made by a volume at the first ``vol_nixl`` request): a
  NIXL agent with the UCX backend; every slot's memory (the mapped shared-memory range) is
  registered once, when the agent is made or the slot is created, and deregistered when the
  slot is destroyed. ``vol_nixl`` (on the volume's data port, tidal/store/ops.py) answers
  the agent's name, its metadata for the slots asked (with its connection info) and where
  each slot is in its memory.
- Reader side (:class:`NixlTransport`): a store handle's own agent. The first read of a slot
  asks its volume for it once; later reads of it send no message. A read pulls each job's
  sub-box with one-sided READs straight into the destination, a descriptor per contiguous
  run of bytes common to the slot's box and the destination (strided views included); a
  destination of another dtype, or one of runs under ``MIN_RUN`` bytes, goes through a
  scratch buffer. The transfer request of a read is kept per (volume, slots, boxes,
  destinations), the last ``MAX_LAYOUTS`` of them, with the registrations of their
  destinations' storages (referenced, so an address is never registered twice with other
  memory behind it): a steady get posts the request it made last time.
- Lanes: a handle keeps ``lanes()`` agents (``TIDAL_NIXL_LANES``, default 2) and splits a
  read of at least ``SPLIT_MIN`` bytes into that many equal byte ranges, one transfer request
  per agent, posted together and completed on as many threads. UCX moves a READ on one host by
  ``process_vm_readv`` (CMA) in the thread that drives the request, so one agent reads at
  single-thread copy speed, under the multi-threaded memcpy the targets compare with; NIXL's
  own ``num_threads``/``num_workers`` did not split it (benchmarks/README.md).
- Writes go through shared memory when the volume is on this host, else TCP: readers pull,
  writers do not push.

Errors: NIXL missing, an agent that cannot be made, a registration that fails or a peer
that cannot be reached are one ``StoreError`` line naming the volume and the transport
(``NixlSetupError``: with ``transport="auto"`` that volume is then read over TCP). A volume
that dies during a transfer raises ``VolumeLostError``: UCX reports the peer's disconnect
(0.6 ms after a kill on the 2-core VM, tests/store/test_nixl.py), and the request is polled
against the handle's ``timeout``, never waited on without a deadline.

UCX listens where its network devices are: a volume serving on loopback restricts its agent
to ``lo`` (``UCX_NET_DEVICES``, unless the environment sets it); one configured to listen
on another interface uses what UCX finds.
"""

from __future__ import annotations

import collections
import concurrent.futures
import importlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch

from tidal.store import ops
from tidal.store.errors import StoreError, VolumeLostError
from tidal.store.ops import VolumeInfo
from tidal.store.progress import Progress
from tidal.store.transports import Gate, ReadJob, Transport, WriteJob

MODULES = ("nixl", "nixl_cu12", "nixl_cu13")  # the meta package, then the wheels it wraps
MIN_RUN = 256  # bytes: shorter runs of a strided read go through a scratch buffer
MAX_DESCS = 1 << 20  # descriptors per read; more go through a scratch buffer
# Transfer requests kept per handle, each with its destinations' registrations (and a
# reference to their storages: an address is never registered twice with other memory behind
# it). A reader into its own tensors reuses one; one into fresh tensors each time keeps the
# destinations of its last reads this many alive.
MAX_LAYOUTS = 4
# Reads of at least this many bytes are split across the lanes; smaller ones use lane 0 (a
# thread hand-off costs more than it saves).
SPLIT_MIN = 4 << 20
LANES_ENV = "TIDAL_NIXL_LANES"
DEFAULT_LANES = 2  # 2-core VM, quiet: store_transports.py 0.070-0.075 s; 1 lane 0.105, 4 0.074

log = logging.getLogger("tidal.store")
_module: ModuleType | None = None
_error: str | None = None
_load_lock = threading.Lock()


class NixlSetupError(StoreError):
    """NIXL could not be set up for a volume (missing on either side, an agent that cannot
    be reached, a registration that failed): no byte moved, TCP may take over."""


def load() -> ModuleType:
    """The NIXL Python package, or StoreError saying how to install it."""
    global _module, _error
    with _load_lock:
        if _module is not None:
            return _module
        if _error is None:
            errors = []
            for name in MODULES:
                try:
                    mod = importlib.import_module(name)
                    mod.nixl_agent  # noqa: B018 - the meta package without a wheel lacks it
                except (ImportError, AttributeError) as e:
                    errors.append(f"{name}: {e}")
                    continue
                _module = mod
                return mod
            _error = "; ".join(errors)
        raise NixlSetupError(
            "transport 'nixl' needs NIXL: pip install 'tidal[nixl]' (nixl-cu12 or nixl-cu13) "
            f"({_error})"
        )


def forget() -> None:
    """Drop what `load` remembered (the module, or why it failed): the next call imports again."""
    global _module, _error
    with _load_lock:
        _module, _error = None, None


def available() -> bool:
    try:
        load()
    except StoreError:
        return False
    return True


def lanes() -> int:
    """Agents (and threads) a reader splits a large read across: ``TIDAL_NIXL_LANES``
    (1-64), default ``DEFAULT_LANES``."""
    raw = os.environ.get(LANES_ENV, "")
    if not raw:
        return DEFAULT_LANES
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= 64:
        raise StoreError(f"{LANES_ENV}={raw!r}: expected an integer from 1 to 64")
    return n


def has_rdma(root: str = "/sys/class/infiniband") -> bool:
    """Whether this machine has an RDMA device (InfiniBand or RoCE) for UCX to use. Without
    one UCX reads across hosts over TCP, which on the 2-core VM ran at 0.4-0.8 GB/s against
    3.7 GB/s for the store's own TCP transport: ``auto`` then keeps TCP."""
    try:
        return bool(os.listdir(root))
    except OSError:
        return False


def _agent(name: str, loopback: bool, what: str) -> Any:
    """A NIXL agent on UCX, without NIXL's progress thread: that thread polls with no delay
    (the Python API fixes ``pthrDelay`` at 0) and so burns a whole core for as long as the
    agent lives (2-core VM, 2026-12-07: 101 of 100 ticks a second, idle). Readers progress
    their requests by polling them (``NixlTransport._wait``); a volume's agent is progressed
    by :class:`VolumeAgent`'s own thread, which sleeps between calls."""
    mod = load()
    if loopback:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    try:
        config = mod.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        agent = mod.nixl_agent(name, config)
    except Exception as e:  # NIXL raises its own exception types
        raise NixlSetupError(f"{what}: cannot make a NIXL agent with UCX: {e}") from None
    if "UCX" not in agent.backends:
        raise NixlSetupError(f"{what}: NIXL has no UCX backend on this machine")
    return agent


class VolumeAgent:
    """A volume's NIXL agent and the registrations of its slots, and the thread that
    progresses the agent (what a peer's connection set-up and disconnect need from it:
    one-sided READs themselves need nothing of the volume) every ``PROGRESS_S``, through
    ``get_new_notifs`` (which progresses the UCX workers of an agent without a progress
    thread). The agent is not thread-safe: the volume calls every method but ``close`` under
    its ``lock``, and the thread takes the same lock; ``close`` joins the thread, so it is
    called without the lock."""

    PROGRESS_S = 0.002

    def __init__(self, volume_id: str, loopback: bool, lock: threading.Lock) -> None:
        self.what = f"volume {volume_id!r}, transport nixl"
        self._lock = lock
        self.name = f"tidal-vol-{volume_id}-{os.getpid()}-{secrets.token_hex(4)}"
        self.agent = _agent(self.name, loopback, self.what)
        self._regs: dict[int, tuple[Any, int, int]] = {}  # slot -> (registration, addr, n)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._progress, name=f"tidal-nixl-{volume_id}", daemon=True
        )
        self._thread.start()

    def _progress(self) -> None:
        while not self._stop.wait(self.PROGRESS_S):
            try:
                with self._lock:
                    self.agent.get_new_notifs()
            except Exception as e:  # the agent is unusable: readers see their reads fail
                log.warning("%s: progress stopped: %s", self.what, e)
                return

    def register(self, slot: int, seg: torch.Tensor) -> None:
        if slot in self._regs or not seg.numel():
            return
        addr, n = seg.data_ptr(), seg.numel()
        try:
            reg = self.agent.register_memory([(addr, n, 0, "")], "DRAM")
        except Exception as e:
            raise NixlSetupError(
                f"{self.what}: cannot register slot {slot} ({n} bytes): {e}"
            ) from None
        self._regs[slot] = (reg, addr, n)

    def deregister(self, slot: int) -> None:
        rec = self._regs.pop(slot, None)
        if rec is not None:
            try:
                self.agent.deregister_memory(rec[0])
            except Exception:  # the memory goes anyway; nothing a reader can use is left
                pass

    def describe(self, slots: list[int]) -> tuple[str, bytes, list[tuple[int, int, int]]]:
        """Name, metadata for ``slots`` (with connection info), and (slot, addr, nbytes)."""
        have = [s for s in slots if s in self._regs]
        where = [(s, self._regs[s][1], self._regs[s][2]) for s in have]
        try:
            if not where:
                return self.name, self.agent.get_agent_metadata(), where
            descs = self.agent.get_reg_descs([(a, n, 0, "") for _, a, n in where], "DRAM")
            metadata = self.agent.get_partial_agent_metadata(descs, True, ["UCX"])
        except Exception as e:
            raise StoreError(f"{self.what}: cannot describe slots {have}: {e}") from None
        return self.name, metadata, where

    def close(self) -> None:
        """Stop the progress thread (call without the volume's lock: the thread takes it)
        and drop every registration."""
        self._stop.set()
        self._thread.join(5)
        for slot in list(self._regs):
            self.deregister(slot)


class _Remote:
    """What a reader knows of one volume's agent."""

    def __init__(self, agent: str) -> None:
        self.agent = agent
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (addr, nbytes)


class NixlTransport(Transport):
    """Reads by NIXL; writes through ``writes`` (shared memory or TCP)."""

    def __init__(
        self,
        call: Callable[..., dict[str, Any]],
        writes: Callable[[VolumeInfo], Transport],
        timeout: float,
        fallback: Transport | None = None,
    ) -> None:
        """``call(address, op, **fields)``: a request to a volume's data port (the TCP
        transport's connection pool); ``writes(vol)``: the transport a put uses;
        ``fallback``: where reads of a volume go once NIXL could not be set up for it
        (None: raise)."""
        load()
        self._call, self._writes, self._timeout = call, writes, timeout
        self._fallback = fallback
        self._fell_back: set[tuple[str, str, str]] = set()
        self.name = f"tidal-rd-{os.getpid()}-{secrets.token_hex(4)}"
        self._lanes = lanes()
        self._agents: list[Any] = []  # lane 0 first, made at first use
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._remotes: dict[tuple[str, str, str], _Remote] = {}
        # (address, bytes, kind) -> [registrations (one per lane), storage, requests using it]
        self._regs: dict[tuple[int, int, str], list[Any]] = {}
        # request key -> (transfer handle per lane used, the registrations it uses)
        self._requests: collections.OrderedDict[
            tuple[Any, ...], tuple[list[tuple[Any, Any]], tuple[tuple[int, int, str], ...]]
        ] = collections.OrderedDict()
        self._scratch: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.messages = 0  # vol_nixl requests sent (tests: a steady read sends none)

    @property
    def cached_layouts(self) -> int:
        """Read layouts whose transfer requests are kept (at most MAX_LAYOUTS)."""
        return len(self._requests)

    @property
    def registrations(self) -> int:
        """Destination buffers registered with the agent."""
        return len(self._regs)

    def agent(self) -> Any:
        """Lane 0's agent."""
        return self.agents()[0]

    def agents(self) -> list[Any]:
        """One agent per lane, made at first use."""
        if not self._agents:
            self._agents = [
                _agent(f"{self.name}-{i}", False, "store handle, transport nixl")
                for i in range(self._lanes)
            ]
        return self._agents

    # ---------------------------------------------------------------- writes

    def prepare_write(self, jobs: list[WriteJob]) -> None:
        pass  # the write transport is picked per volume in write()

    def write(
        self, vol: VolumeInfo, jobs: list[WriteJob], progress: Progress, grant: bytes
    ) -> None:
        self._writes(vol).write(vol, jobs, progress, grant)

    # ---------------------------------------------------------------- reads

    def _remote(self, vol: VolumeInfo, slots: list[int]) -> _Remote:
        """The volume's agent, knowing every slot of ``slots`` (one ``vol_nixl`` for those it
        did not know)."""
        key = (vol.store_id, vol.id, vol.address)
        remote = self._remotes.get(key)
        missing = sorted({s for s in slots if remote is None or s not in remote.slots})
        if not missing:
            assert remote is not None, "every slot is known"
            return remote
        what = f"volume {vol.id!r} at {vol.address}, transport nixl"
        try:
            reply = self._call(vol.address, ops.VOL_NIXL, slots=missing)
        except VolumeLostError:
            raise
        except StoreError as e:
            raise NixlSetupError(f"{what}: {e}") from None
        self.messages += 1
        try:
            names = [a.add_remote_agent(reply["metadata"]) for a in self.agents()]
            name = names[0]
        except StoreError:
            raise
        except Exception as e:
            raise NixlSetupError(f"{what}: cannot load the volume's NIXL agent: {e}") from None
        name = name.decode() if isinstance(name, bytes) else str(name)
        if remote is None or remote.agent != name:
            remote = self._remotes[key] = _Remote(name)
        for rec in reply["slots"]:
            remote.slots[rec["slot"]] = (rec["addr"], rec["nbytes"])
        lost = [s for s in missing if s not in remote.slots]
        if lost:
            raise VolumeLostError(f"{what}: no slots {lost} there (destroyed?)")
        return remote

    def _register(self, t: torch.Tensor, what: str) -> tuple[int, int, str]:
        """Register the storage of ``t`` with this handle's agent unless it is; its key."""
        storage = t.untyped_storage()
        kind = "VRAM" if t.is_cuda else "DRAM"
        key = (storage.data_ptr(), storage.nbytes(), kind)
        if key in self._regs:
            return key
        dev = t.device.index or 0 if t.is_cuda else 0
        regs: list[tuple[Any, Any]] = []
        try:
            for a in self.agents():
                regs.append((a, a.register_memory([(key[0], key[1], dev, "")], kind)))
        except StoreError:
            _deregister(regs)
            raise
        except Exception as e:
            _deregister(regs)
            raise NixlSetupError(
                f"{what}: cannot register {key[1]} bytes of {kind} to read into: {e}"
            ) from None
        self._regs[key] = [regs, storage, 0]
        return key

    def _unused(self) -> None:
        """Deregister (and let go of) storages no kept request uses."""
        for key in [k for k, r in self._regs.items() if r[2] == 0]:
            _deregister(self._regs.pop(key)[0])

    def _forget(self, key: tuple[Any, ...]) -> None:
        """Release the request ``key`` and the registrations only it used."""
        handles, regs = self._requests.pop(key)
        self._release(handles)
        for r in regs:
            self._regs[r][2] -= 1
        self._unused()

    def read(self, vol: VolumeInfo, jobs: list[ReadJob], gate: Gate | None) -> None:
        if gate is not None:
            for job in jobs:
                gate(job.slot)
        key = (vol.store_id, vol.id, vol.address)
        if key not in self._fell_back:
            try:
                with self._lock:
                    self._read(vol, jobs)
                return
            except NixlSetupError as e:
                if self._fallback is None:
                    raise
                self._fell_back.add(key)
                log.warning("%s; reading it over TCP", e)
        assert self._fallback is not None, "set when a volume falls back"
        self._fallback.read(vol, jobs, None)

    def _read(self, vol: VolumeInfo, jobs: list[ReadJob]) -> None:
        jobs = [j for j in jobs if j.dst.numel()]
        if not jobs:
            return
        remote = self._remote(vol, [j.slot for j in jobs])
        direct: list[ReadJob] = []
        staged: list[ReadJob] = []
        for job in jobs:
            (direct if runs_ok(job) else staged).append(job)
        bufs: list[tuple[ReadJob, torch.Tensor]] = []
        if staged:
            bufs = self._stage(staged)
        targets = [(j, j.dst) for j in direct] + bufs
        if targets:
            self._transfer(vol, remote, targets)
        with torch.no_grad():
            for job, buf in bufs:
                job.dst.copy_(buf)

    def _stage(self, jobs: list[ReadJob]) -> list[tuple[ReadJob, torch.Tensor]]:
        """Contiguous buffers of the stored dtype for ``jobs``, carved from one scratch
        buffer per device kept registered (grown when too small)."""
        out = []
        by_dev: dict[str, list[ReadJob]] = {}
        for job in jobs:
            by_dev.setdefault(str(job.dst.device), []).append(job)
        for dev, group in by_dev.items():
            sizes = [_nbytes(j.sizes, j.dtype) for j in group]
            total = sum(-(-n // 64) * 64 for n in sizes)
            buf = self._scratch.get(dev)
            if buf is None or buf.numel() < total:  # requests made with the old one keep it
                buf = self._scratch[dev] = torch.empty(total, dtype=torch.uint8, device=dev)
            at = 0
            for job, n in zip(group, sizes, strict=True):
                part = buf[at : at + n].view(job.dtype).view(job.sizes)
                out.append((job, part))
                at += -(-n // 64) * 64
        return out

    def _transfer(
        self, vol: VolumeInfo, remote: _Remote, targets: list[tuple[ReadJob, torch.Tensor]]
    ) -> None:
        what = f"volume {vol.id!r} at {vol.address}, transport nixl"
        storages = {}
        for _, d in targets:
            st = d.untyped_storage()
            storages[(st.data_ptr(), st.nbytes(), "VRAM" if d.is_cuda else "DRAM")] = d
        key = (
            remote.agent,
            tuple(
                (j.slot, remote.slots[j.slot][0], j.src_off, j.sizes, d.data_ptr(), d.stride())
                for j, d in targets
            ),
            tuple(sorted(storages)),
        )
        kept = self._requests.get(key)
        if kept is not None:
            self._requests.move_to_end(key)
            handles = kept[0]
        else:
            regs = tuple(self._register(d, what) for d in storages.values())
            try:
                handles = self._prepare(what, remote, targets)
            except BaseException:
                self._unused()
                raise
            for r in regs:
                self._regs[r][2] += 1
            self._requests[key] = (handles, regs)
            while len(self._requests) > MAX_LAYOUTS:
                self._forget(next(iter(self._requests)))
        self._post(handles, key, what)

    def _prepare(
        self, what: str, remote: _Remote, targets: list[tuple[ReadJob, torch.Tensor]]
    ) -> list[tuple[Any, Any]]:
        """(agent, transfer request) per lane used, together reading every target's runs from
        the volume's slots."""
        local, far = [], []
        for job, dst in targets:
            addr, nbytes = remote.slots[job.slot]
            if job.shard_nbytes > nbytes:
                raise StoreError(f"{what}: slot {job.slot} holds {nbytes} bytes, not more")
            src_runs, dst_runs = runs(job, dst)
            dev = dst.device.index or 0 if dst.is_cuda else 0
            devs = np.full_like(dst_runs[0], dev)
            local.append(np.stack([dst_runs[0], dst_runs[1], devs], 1))
            far.append(np.stack([src_runs[0] + addr, src_runs[1], devs * 0], 1))
        kind = "VRAM" if targets[0][1].is_cuda else "DRAM"
        lo, fa = np.concatenate(local), np.concatenate(far)
        agents = self.agents()
        n = len(agents) if int(lo[:, 1].sum()) >= SPLIT_MIN else 1
        out: list[tuple[Any, Any]] = []
        try:
            for agent, (ll, ff) in zip(agents, split(lo, fa, n), strict=False):
                ldescs = agent.get_xfer_descs(ll.astype(np.uint64), kind)
                rdescs = agent.get_xfer_descs(ff.astype(np.uint64), "DRAM")
                out.append((agent, agent.initialize_xfer("READ", ldescs, rdescs, remote.agent)))
        except Exception as e:
            self._release(out)
            raise NixlSetupError(f"{what}: cannot prepare the read: {e}") from None
        return out

    def _lane_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads that poll lanes 1.. (made on the first split read)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._lanes - 1, thread_name_prefix="tidal-nixl"
            )
        return self._pool

    def _post(self, handles: list[tuple[Any, Any]], key: tuple[Any, ...], what: str) -> None:
        """Post each lane's request and poll them to completion (lane 0 on this thread, the
        others on the pool's); a failure drops the request (and the volume's agent, so that
        the next read asks the volume again)."""
        others = []
        if len(handles) > 1:
            pool = self._lane_pool()
            others = [pool.submit(self._wait, a, h, key, what) for a, h in handles[1:]]
        errors: list[BaseException] = []
        try:
            self._wait(*handles[0], key, what)
        except BaseException as e:
            errors.append(e)
        for f in others:
            try:
                f.result()
            except BaseException as e:
                errors.append(e)
        if errors:
            self._drop(key)
            raise errors[0]

    def _wait(self, agent: Any, handle: Any, key: tuple[Any, ...], what: str) -> None:
        """Post one request and poll it to completion within the timeout."""
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + self._timeout
            sleep = 0.0
            while state == "PROC":  # a dead peer turns it to ERR (or raises) at once
                if time.monotonic() > deadline:
                    raise VolumeLostError(
                        f"{what}: the read did not finish within {self._timeout:g} s"
                    )
                time.sleep(sleep)
                sleep = min(sleep * 2 + 1e-5, 1e-3)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise VolumeLostError(f"{what}: the read failed (NIXL state {state})")
        except StoreError:
            raise
        except Exception as e:
            raise VolumeLostError(f"{what}: the read failed: {e} (volume gone?)") from None

    def _drop(self, key: tuple[Any, ...]) -> None:
        if key in self._requests:
            self._forget(key)
        for rkey, remote in list(self._remotes.items()):
            if remote.agent == key[0]:
                del self._remotes[rkey]
                for a in self.agents():
                    try:
                        a.remove_remote_agent(remote.agent)
                    except Exception:
                        pass

    @staticmethod
    def _release(handles: list[tuple[Any, Any]]) -> None:
        for agent, handle in handles:
            try:
                agent.release_xfer_handle(handle)
            except Exception:  # still in flight after a failure: NIXL frees it with the agent
                pass

    def close(self) -> None:
        with self._lock:
            if not self._agents:
                return
            while self._requests:
                self._forget(next(iter(self._requests)))
            self._unused()
            self._scratch.clear()
            self._agents = []
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None


def _deregister(regs: list[tuple[Any, Any]]) -> None:
    for agent, reg in regs:
        try:
            agent.deregister_memory(reg)
        except Exception:  # the memory goes anyway; nothing a reader can use is left
            pass


def split(local: np.ndarray, far: np.ndarray, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` pieces of the descriptor lists (rows of address, bytes, device) covering equal
    ranges of their bytes (cut at 4 KiB multiples of the running total; a descriptor across a
    cut becomes two). Empty pieces are left out."""
    if n <= 1:
        return [(local, far)]
    lengths = local[:, 1].astype(np.int64)
    end = np.cumsum(lengths)
    start = end - lengths
    total = int(end[-1])
    cuts = [min(total, (total * i // n) >> 12 << 12) for i in range(n)] + [total]
    out = []
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        s, e = np.maximum(start, lo), np.minimum(end, hi)
        keep = e > s
        if not keep.any():
            continue
        skip, size = (s - start)[keep], (e - s)[keep]
        ll, ff = local[keep].copy(), far[keep].copy()
        ll[:, 0] += skip
        ff[:, 0] += skip
        ll[:, 1] = ff[:, 1] = size
        out.append((np.ascontiguousarray(ll), np.ascontiguousarray(ff)))
    return out


def _nbytes(sizes: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in sizes:
        n *= s
    return n


def runs_ok(job: ReadJob) -> bool:
    """Whether ``job`` can land in its destination as is: same dtype, runs long enough,
    not too many descriptors."""
    if job.dst.dtype != job.dtype or not job.dst.numel():
        return False
    run, count = run_shape(job, job.dst)
    return run * job.dtype.itemsize >= MIN_RUN and count <= MAX_DESCS or count == 1


def run_shape(job: ReadJob, dst: torch.Tensor) -> tuple[int, int]:
    """(elements per contiguous run, number of runs) common to the box and ``dst``."""
    k = _common_tail(job, dst)
    run = 1
    for s in job.sizes[k:]:
        run *= s
    count = 1
    for s in job.sizes[:k]:
        count *= s
    return run, count


def _common_tail(job: ReadJob, dst: torch.Tensor) -> int:
    """The first dimension of the longest trailing block that is one contiguous run in the
    slot (C-contiguous ``shard_shape``, box ``src_off``/``sizes``) and in ``dst``."""
    shape, sizes, strides = job.shard_shape, job.sizes, dst.stride()
    k = len(sizes)
    expect = 1  # dst stride of a dense trailing block
    while k > 0:
        d = k - 1
        if sizes[d] != 1 and strides[d] != expect:
            break
        expect *= sizes[d]
        k = d
        if sizes[d] != shape[d]:  # the slot's run ends after a partial dimension
            break
    return k


def runs(job: ReadJob, dst: torch.Tensor) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Byte offsets in the slot and absolute addresses in ``dst`` of each run, with lengths."""
    k = _common_tail(job, dst)
    item = job.dtype.itemsize
    run, _ = run_shape(job, dst)
    src_strides = [1] * len(job.shard_shape)
    for d in range(len(job.shard_shape) - 2, -1, -1):
        src_strides[d] = src_strides[d + 1] * job.shard_shape[d + 1]
    base = sum(o * s for o, s in zip(job.src_off, src_strides, strict=True))
    src = np.array([base], dtype=np.int64)
    out = np.array([0], dtype=np.int64)
    for d in range(k):  # the leading dimensions, outermost first
        idx = np.arange(job.sizes[d], dtype=np.int64)
        src = (src[:, None] + idx[None, :] * src_strides[d]).reshape(-1)
        out = (out[:, None] + idx[None, :] * dst.stride()[d]).reshape(-1)
    lengths = np.full_like(src, run * item)
    return (src * item, lengths), (out * item + dst.data_ptr(), lengths)
