"""Storage volume: owns the memory that holds stored shards.

A volume keeps one CPU shared-memory segment per slot. A slot of n bytes is stored in
ceil(n / ``PART_BYTES``) files, its parts: part 0 is ``<shm_dir>/tidal-<store id>-<volume
id>-<slot>`` and part k ``...-<slot>.<k>`` (:func:`segment_path`: the only place such a name is
built, from ids the store issued and checked, never from a path received; 0-byte slots have
no file). Parts exist because fresh tmpfs pages do not fill faster with more threads inside
one file, but do across files: on the 16-core H200 host, one 512 MB file took pwrite at
2.4-3 GB/s and populated at 4.4-4.8 GB/s with 4-16 threads, while eight 64 MB files written
by 8 threads at once took 14.3 GB/s. Every user of a slot still sees one flat buffer:
:func:`map_segment` maps all parts into one contiguous virtual range.

Slots are created once and reused for later versions of the same shard (the controller hands
a freed slot to the next writer of the same key, tensor and size), because the first touch of
fresh shared memory costs page faults (benchmarks/store_sync.py prints a cold put and the
steady state).

A slot is created as sparse files of its size (no page is touched: the server does not zero
gigabytes in one thread while a put waits). Its pages are allocated by the first writer,
with ``pwrite`` per part in parallel threads (tidal/store/transports/shm.py) or, when it maps
the slot, with ``MADV_POPULATE_READ`` (:func:`populate`: a full tmpfs fails there with a
clear error, never a SIGBUS), or by this process before the first TCP write into it.

Writers and readers on the volume's host map the segments and copy straight in or out;
remote peers go through ``vol_write`` / ``vol_read`` over TCP, which this class serves from
the same memory. A TCP write needs the grant the controller issued for the slot's pending
version (:meth:`grant`); the controller seals the slots before the version becomes visible
(:meth:`seal`), so no committed slot is ever written through the network.

Lifecycle: the process that runs a :class:`~tidal.store.server.Server` with a volume owns it;
``close()`` unlinks every part file it created, and nothing else. A standalone volume
(``tidal store volume``) registers with a controller and exits when the controller goes away.
"""

from __future__ import annotations

import collections.abc
import ctypes
import errno
import hmac
import mmap
import os
import re
import secrets
import socket
import stat
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from typing import Any

import torch

from tidal.store import numa, wire
from tidal.store.errors import StoreError
from tidal.store.reserve import Reserve

_STORE_ID = re.compile(r"\d+\.\d+x[0-9a-f]{6}")
_VOLUME_ID = re.compile(r"[A-Za-z0-9_.-]{1,96}")
# A part file's name (groups: pid namespace, pid), and a part 0's (groups: store id, volume id,
# slot). Slots and parts are printed by str() of a positive int: no leading zero.
_SEGMENT = re.compile(
    r"tidal-(\d+)\.(\d+)x[0-9a-f]{6}-[A-Za-z0-9_.-]{1,96}-([1-9]\d*(\.[1-9]\d*)?|reserve\.[1-9]\d*)"
)
_PART0 = re.compile(r"tidal-(\d+\.\d+x[0-9a-f]{6})-([A-Za-z0-9_.-]{1,96})-([1-9]\d*)")

# Bytes per file of a slot: a multiple of the page size (and of 2 MB, should hugepages
# back tmpfs), and part of the layout every process of a store must agree on.
PART_BYTES = 64 << 20
POOL_IDLE_S = 0.5  # a volume's pool refills once no slot was created or sealed for this long


def pid_namespace() -> int:
    """This process's pid namespace (0 where /proc does not say): store ids name it, so
    :func:`reap_stale` judges only pids of its own namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def new_store_id() -> str:
    """A store id naming the owning process: ``<pid namespace>.<pid>x<random>``, so segments
    left by a killed process can be recognised and removed (:func:`reap_stale`)."""
    return f"{pid_namespace()}.{os.getpid()}x{secrets.token_hex(3)}"


def check_volume_id(volume_id: str) -> str:
    if (
        not isinstance(volume_id, str)
        or not _VOLUME_ID.fullmatch(volume_id)
        or volume_id
        in (
            ".",
            "..",
        )
    ):
        raise ValueError(f"volume id {volume_id!r}: use 1-96 characters [A-Za-z0-9_.-]")
    return volume_id


def segment_path(shm_dir: str, store_id: str, volume_id: str, slot: int, part: int = 0) -> str:
    """The file of part ``part`` of ``slot``; raises StoreError if a component is not one the
    store makes (the components may come from the network: a hostile peer must not steer a
    path)."""
    if (
        not isinstance(shm_dir, str)
        or not os.path.isabs(shm_dir)
        or os.path.normpath(shm_dir) != shm_dir
        or "\x00" in shm_dir
    ):
        raise StoreError(f"shared-memory directory {shm_dir!r} is not a normalized absolute path")
    if not isinstance(store_id, str) or not _STORE_ID.fullmatch(store_id):
        raise StoreError(f"store id {store_id!r} is not one a tidal store makes")
    if not isinstance(volume_id, str) or not _VOLUME_ID.fullmatch(volume_id):
        raise StoreError(f"volume id {volume_id!r} is not one a tidal store accepts")
    if not isinstance(slot, int) or isinstance(slot, bool) or slot < 1:
        raise StoreError(f"slot {slot!r} is not a slot id")
    if not isinstance(part, int) or isinstance(part, bool) or part < 0:
        raise StoreError(f"part {part!r} is not a part number")
    name = f"tidal-{store_id}-{volume_id}-{slot}" + (f".{part}" if part else "")
    return os.path.join(shm_dir, name)


def part_path(path: str, part: int) -> str:
    """The file of part ``part`` of the slot whose part 0 is ``path``. ``path`` is parsed back
    into the ids :func:`segment_path` built it from and the name rebuilt by it, so a path that
    is not a slot's part 0 is refused (StoreError), never extended."""
    shm_dir, name = os.path.split(path)
    m = _PART0.fullmatch(name)
    if m is None:
        raise StoreError(f"{path!r} is not the first file of a tidal slot")
    return segment_path(shm_dir, m[1], m[2], int(m[3]), part)


def part_sizes(nbytes: int) -> list[int]:
    """The sizes of the files a slot of ``nbytes`` is stored in (none for an empty slot)."""
    return [min(PART_BYTES, nbytes - o) for o in range(0, nbytes, PART_BYTES)]


def reserve_for(state_dict: collections.abc.Mapping[str, Any]) -> list[int]:
    """The part files a first put of ``state_dict`` (as it is: shapes and dtypes) needs, for
    a volume's ``reserve``."""
    from tidal.store import boxes

    sizes = []
    for _, t in boxes.tensors_of(boxes.flatten(state_dict)):
        sizes.extend(part_sizes(t.numel() * t.element_size()))
    return sizes


def part_spans(offset: int, size: int) -> Iterator[tuple[int, int, int]]:
    """``(part, offset in that part, bytes)`` covering bytes ``offset``.. (``size`` of them)
    of a slot, in order."""
    end = offset + size
    while offset < end:
        part, at = divmod(offset, PART_BYTES)
        n = min(PART_BYTES - at, end - offset)
        yield part, at, n
        offset += n


def owner_of(name: str) -> tuple[int, int] | None:
    """The (pid namespace, pid) that made the file ``name`` if it is a tidal part or reserve
    file's name, else None."""
    m = _SEGMENT.fullmatch(name)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def reap_stale(shm_dir: str = "/dev/shm") -> int:
    """Unlink the part files of stores whose owning process is gone; returns how many.

    Only regular files of this user named like a tidal part file and created in this pid
    namespace are considered (another container sharing ``/dev/shm`` has other pids), and a
    live or reused pid keeps its segments.
    """
    ns = pid_namespace()
    n = 0
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return 0
    for name in names:
        owner = owner_of(name)
        if owner is None or ns == 0 or owner[0] != ns:
            continue
        path = os.path.join(shm_dir, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            continue
        try:
            os.kill(owner[1], 0)
            continue  # owner alive (or a reused pid: keep, to be safe)
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        try:
            os.unlink(path)
            n += 1
        except OSError:
            pass
    return n


def open_segment(path: str, nbytes: int, writable: bool) -> int:
    """An fd on an existing part file: a regular file (no symlink followed) of ``nbytes``."""
    # O_NONBLOCK: a FIFO planted at the path would block an open for reading forever; on a
    # regular file (and for mmap, pread, pwrite) it changes nothing.
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise StoreError(
            f"shared-memory segment {path} is gone (its volume was closed or died)"
        ) from None
    except OSError as e:
        raise StoreError(f"cannot open shared-memory segment {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StoreError(f"{path} is not a regular file; not a tidal segment")
        if st.st_size != nbytes:
            raise StoreError(f"segment {path} has {st.st_size} bytes, expected {nbytes}")
    except BaseException:
        os.close(fd)
        raise
    return fd


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10  # Linux values; Python's mmap module does not export these two
_MAP_NORESERVE = 0x4000
_MADV_POPULATE_READ = 22  # Linux 5.14

Mapping = ctypes.Array  # a mapped segment: bytes at a fixed address, unmapped when garbage


def _mmap(addr: int | None, nbytes: int, prot: int, flags: int, fd: int) -> int:
    got = _libc.mmap(addr, nbytes, prot, flags, fd, 0)
    if got is None or got == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return got


def mmap_parts(fds: list[int], nbytes: int, writable: bool) -> Mapping:
    """Map the part files ``fds`` (in order) of a slot of ``nbytes``, shared, into one
    contiguous range, so that every user sees one flat buffer. Unlike Python's ``mmap``,
    which keeps a duplicate of the file descriptor per mapping (a store of thousands of
    segments would run out of them), nothing stays open: the whole range is unmapped once
    the returned buffer, and everything made from it, is garbage."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    if len(fds) == 1:
        addr = _mmap(None, nbytes, prot, mmap.MAP_SHARED, fds[0])
    else:
        # Reserve the range (inaccessible, no memory committed), then lay each part over its
        # share of it: MAP_FIXED replaces the reservation, and no other thread's mapping can
        # land in between.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        addr = _mmap(None, nbytes, 0, flags, -1)  # PROT_NONE
        try:
            for part, fd in enumerate(fds):
                at = part * PART_BYTES
                n = min(PART_BYTES, nbytes - at)
                _mmap(addr + at, n, prot, mmap.MAP_SHARED | _MAP_FIXED, fd)
        except OSError:
            _libc.munmap(addr, nbytes)
            raise
    buf = (ctypes.c_char * nbytes).from_address(addr)
    weakref.finalize(buf, _libc.munmap, addr, nbytes)
    return buf


def map_segment(path: str, nbytes: int, writable: bool = True) -> Mapping:
    """Map an existing slot (shared) whose part 0 is ``path``; raises StoreError naming the
    part file that is gone or has changed."""
    fds: list[int] = []
    try:
        for part, n in enumerate(part_sizes(nbytes)):
            fds.append(open_segment(part_path(path, part), n, writable))
        return mmap_parts(fds, nbytes, writable)
    except OSError as e:
        raise StoreError(f"cannot map shared-memory segment {path}: {e.strerror}") from None
    finally:
        for fd in fds:
            os.close(fd)


POPULATE_CHUNK = 32 << 20  # bytes a thread populates at a time


def populate(regions: list[tuple[int, int, str]], pool: Executor | None = None) -> None:
    """Fault in (allocating where a slot has no page yet) the shared mappings of whole
    slots, each ``(address, nbytes, path of its part 0)``, in ``POPULATE_CHUNK`` pieces that
    never cross a part, the pieces of all regions at once over ``pool``'s threads, the first
    piece of every part before the second of any (fresh pages of one file fault in little
    faster with more threads, those of several files do: on the H200 host one 512 MB file
    populated at 1.8 GB/s with 1 thread and 4.4 with 16).

    ``MADV_POPULATE_READ``, not ``_WRITE``: a tmpfs page needs no write notification, so a
    read fault of a shared writable mapping maps it writable, and read faults map the pages
    around the one faulted that are already in memory (the kernel's fault-around, 64 KB),
    where a write fault maps one page. For a slot whose pages exist (a reused slot, a pool
    file) that is 16x fewer faults: 64 MB populated with 1,025 faults against 16,384, and
    the copy after it took 2 more; 512 MB in 0.065-0.078 s against 0.17-0.19 (2-core dev
    VM, one thread). A hole is allocated by either, at the same cost (0.32-0.37 s for 512
    MB). A kernel without ``MADV_POPULATE_READ`` allocates with ``posix_fallocate`` instead.
    Raises StoreError naming the part file whose pages cannot be allocated (a full tmpfs)."""

    def one(piece: tuple[int, int, int, int]) -> int:
        i, _, at, n = piece
        rc = _libc.madvise(
            ctypes.c_void_p(regions[i][0] + at), ctypes.c_size_t(n), _MADV_POPULATE_READ
        )
        return 0 if rc == 0 else ctypes.get_errno()

    pieces = []  # (region, part, offset in the slot, bytes)
    for i, (_, nbytes, _) in enumerate(regions):
        for part, n in enumerate(part_sizes(nbytes)):
            start = part * PART_BYTES
            pieces += [
                (i, part, o, min(POPULATE_CHUNK, start + n - o))
                for o in range(start, start + n, POPULATE_CHUNK)
            ]
    pieces.sort(key=lambda p: p[2] - p[1] * PART_BYTES)  # by offset in the part (stable)
    errors = list(pool.map(one, pieces)) if pool is not None else [one(p) for p in pieces]
    failed = [(p, e) for p, e in zip(pieces, errors, strict=True) if e]
    if failed and failed[0][1] == errno.EINVAL:  # too old a kernel
        for i in sorted({p[0] for p, _ in failed}):
            fallocate(regions[i][2], regions[i][1])
        return
    if failed:
        (i, part, _, _), err = failed[0]
        raise StoreError(
            f"cannot allocate {regions[i][1]} bytes for {part_path(regions[i][2], part)}: "
            f"{os.strerror(err)} (is the shared-memory file system full? delete keys or "
            "lower retention)"
        )


def fallocate(path: str, nbytes: int) -> None:
    """Allocate the pages of the slot whose part 0 is ``path`` with ``posix_fallocate``
    (where populating is not supported); StoreError if the file system is full."""
    for part, n in enumerate(part_sizes(nbytes)):
        file = part_path(path, part)
        fd = os.open(file, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, n)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return  # not supported here: the first write allocates
            raise StoreError(f"cannot allocate {n} bytes for {file}: {e.strerror}") from None
        finally:
            os.close(fd)


def as_bytes(mapping: Mapping) -> torch.Tensor:
    """A flat uint8 tensor over a writable mapping (no copy; it keeps the mapping)."""
    return torch.frombuffer(mapping, dtype=torch.uint8)


def byte_view(t: torch.Tensor, shape: tuple[int, ...], itemsize: int) -> torch.Tensor:
    """View flat uint8 memory as ``shape`` with a trailing dimension of ``itemsize`` bytes."""
    n = itemsize
    for s in shape:
        n *= s
    return t[:n].view(*shape, itemsize)


class Volume:
    """Shared-memory segments indexed by slot id (the controller allocates the ids)."""

    def __init__(
        self,
        volume_id: str,
        store_id: str,
        shm_dir: str = "/dev/shm",
        capacity: int | None = None,
        reserve: int | Sequence[int] = 0,
        pool: int = 0,
        numa_node: int | str | None = "auto",
    ) -> None:
        """``numa_node``: where the pages of its slots and reserve go on a machine of several
        NUMA nodes (tidal/store/numa.py): ``"auto"`` (the node of this process's GPU if it
        uses one, else of the RDMA NICs), a node number, or None / ``"off"``. On one node
        nothing is bound.

        ``reserve``: shared memory to allocate now, for new slots to take
        (tidal/store/reserve.py): bytes (in full-size part files), or the sizes of the part
        files to make (:func:`reserve_for`). The first puts of new keys then write into
        pages that exist instead of faulting them in.

        ``pool``: bytes of such files a background thread keeps ready (of the sizes the
        last new slots had, see ``Reserve.next_size``), written while no slot was created
        for ``POOL_IDLE_S`` and never past a quarter of the directory's free space: what
        ``tidal store serve`` uses so that a plain first put needs no ``reserve``. Chosen by
        measurement on the 2-core VM (2026-12-07, benchmarks/store_cold.py: 512 MB bf16 in
        16 tensors, two fresh processes through ``tidal store serve``): fresh tmpfs pages
        cost a host fault each there (pwrite, fallocate and first touch of anonymous
        memory all ran at 4.7-5.4 GB/s against memcpy at 15 in one process); the first
        put ran at 3.1-3.2 GB/s without a pool and 4.9-5.1 GB/s with one. No huge pages
        back tmpfs there (``shmem_enabled`` never), and more threads than the 2 cores gain
        nothing: pages written ahead are the only way past the fault rate."""
        self.volume_id = check_volume_id(volume_id)
        self.store_id = store_id
        self.shm_dir = os.path.normpath(os.path.abspath(shm_dir))
        if not os.path.isdir(self.shm_dir) or not os.access(self.shm_dir, os.W_OK | os.X_OK):
            raise ValueError(
                f"shared-memory directory {self.shm_dir!r} does not exist or is not writable "
                "(--shm-dir)"
            )
        segment_path(self.shm_dir, store_id, self.volume_id, 1)  # checks the components
        if isinstance(reserve, int) and not isinstance(reserve, bool):
            if reserve < 0:
                raise ValueError(f"reserve must be a number of bytes >= 0, got {reserve!r}")
            sizes = [PART_BYTES] * -(-reserve // PART_BYTES)
        elif isinstance(reserve, Sequence) and not isinstance(reserve, str | bytes):
            sizes = list(reserve)
        else:
            raise ValueError(f"reserve must be a number of bytes >= 0, got {reserve!r}")
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 0:
            raise ValueError(f"pool must be a number of bytes >= 0, got {pool!r}")
        self.numa_node = numa.volume_node(numa_node)
        self._reserve = Reserve(
            self.shm_dir, f"tidal-{store_id}-{self.volume_id}", PART_BYTES, self.numa_node
        )
        if sizes:
            self._reserve.fill(sizes)
        self._reserve.target = max(self._reserve.target, pool)
        self._pool = pool
        self._closed = False
        self._last_busy = -float("inf")
        self.capacity = capacity
        self.used = 0
        self._segments: dict[int, tuple[Mapping | None, torch.Tensor]] = {}
        self._grants: dict[int, bytes] = {}
        self._populated: set[int] = set()  # slots this process allocated for TCP writes
        self._inflight: dict[int, int] = {}  # slot -> network writes receiving into it
        self._lock = threading.Lock()
        self._done_writing = threading.Condition(self._lock)
        self._pool_wake = threading.Condition(self._lock)
        self._nixl: Any = None  # its NIXL agent, made at the first vol_nixl (transports/nixl.py)
        self.nixl_loopback = True  # the server listens on loopback only: so does UCX
        self._pool_thread: threading.Thread | None = None
        if pool:
            self._pool_thread = threading.Thread(
                target=self._fill_pool, name=f"tidal-pool-{self.volume_id}", daemon=True
            )
            self._pool_thread.start()

    def _fill_pool(self) -> None:
        """Keep the reserve at ``pool`` bytes: one file at a time (its size from
        ``Reserve.next_size``), written outside
        the lock, only once no slot was created or sealed for ``POOL_IDLE_S`` (a put in
        progress keeps the memory bandwidth: steady puts, which reuse their slots and create
        none, seal them at every commit), and not past a quarter of the free space. On the
        2-core VM (load 10, ``tidal store serve``, 12 puts of 0.54 GB back to back) warm
        puts took 0.13-0.46 s while the refill, started by slot creation alone, wrote
        behind them."""
        while True:
            with self._pool_wake:
                while True:
                    if self._closed:
                        return
                    idle = time.monotonic() - self._last_busy
                    held = self._reserve.bytes
                    if held < self._pool and idle >= POOL_IDLE_S:
                        st = os.statvfs(self.shm_dir)
                        if 4 * (held + PART_BYTES) <= st.f_bavail * st.f_frsize + held:
                            break
                    wait = POOL_IDLE_S - idle if idle < POOL_IDLE_S else 1.0
                    self._pool_wake.wait(max(wait, 0.01))
                n, size = self._reserve.number(), self._reserve.next_size(self._pool)
            err = self._reserve.allocate(n, size)
            with self._lock:
                if err is None and not self._closed:
                    self._reserve.add(n, size)
                    continue
                if err is None:
                    self._reserve.discard(n)
                    return
                self._pool = 0  # the directory is full or unusable: stop, puts fault pages
                return

    def path(self, slot: int, part: int = 0) -> str:
        return segment_path(self.shm_dir, self.store_id, self.volume_id, slot, part)

    def create(self, slot: int, nbytes: int) -> None:
        with self._lock:
            self._last_busy = time.monotonic()
            if self._pool:
                self._pool_wake.notify()
            if slot in self._segments:
                raise StoreError(f"volume {self.volume_id}: slot {slot} already exists")
            if self.capacity is not None and self.used + nbytes > self.capacity:
                raise StoreError(
                    f"volume {self.volume_id} is full: {self.used} of {self.capacity} bytes "
                    f"used, cannot add {nbytes}; delete keys or lower retention (keep)"
                )
            mapping: Mapping | None = None
            seg = torch.empty(0, dtype=torch.uint8)
            if nbytes:
                st = os.statvfs(self.shm_dir)
                free = st.f_bavail * st.f_frsize + self._reserve.bytes
                if free < nbytes:
                    raise StoreError(
                        f"volume {self.volume_id}: {self.shm_dir} has {free} bytes free, "
                        f"{nbytes} needed; delete keys or lower retention (keep)"
                    )
                mapping = self._create_parts(slot, nbytes)
                seg = as_bytes(mapping)
            self._segments[slot] = (mapping, seg)
            self.used += nbytes
            if self._nixl is not None:
                self._nixl.register(slot, seg)

    def _create_parts(self, slot: int, nbytes: int) -> Mapping:
        """Create the part files of a new slot (sparse: the first writer allocates the pages)
        and map them; on any failure, the files made so far are unlinked."""
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        sizes = part_sizes(nbytes)
        fds: list[int] = []
        try:
            for part, n in enumerate(sizes):
                path = self.path(slot, part)
                try:
                    if self._reserve.take(path, n):  # pages allocated ahead
                        fds.append(os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC))
                        continue
                    fds.append(os.open(path, flags, 0o600))
                except OSError as e:
                    raise StoreError(
                        f"volume {self.volume_id}: cannot create segment {path}: {e.strerror}"
                    ) from None
            try:
                for fd, n in zip(fds, sizes, strict=True):
                    os.ftruncate(fd, n)
                    numa.bind_file(fd, n, self.numa_node)  # the writer allocates the pages
                return mmap_parts(fds, nbytes, writable=True)
            except OSError as e:
                raise StoreError(
                    f"volume {self.volume_id}: cannot allocate {nbytes} bytes in "
                    f"{self.shm_dir}: {e.strerror}"
                ) from None
        except BaseException:
            for part in range(len(fds)):  # only files this call created (O_EXCL)
                try:
                    os.unlink(self.path(slot, part))
                except FileNotFoundError:
                    pass
            raise
        finally:
            for fd in fds:
                os.close(fd)

    def destroy(self, slots: list[int]) -> None:
        with self._lock:
            for slot in slots:
                rec = self._segments.pop(slot, None)
                if self._nixl is not None:
                    self._nixl.deregister(slot)
                self._grants.pop(slot, None)
                self._populated.discard(slot)
                if rec is None:
                    continue
                _, seg = rec  # the mapping goes with the record
                self.used -= seg.numel()
                for part, n in enumerate(part_sizes(seg.numel())):
                    path = self.path(slot, part)
                    if self._reserve.give(path, n):  # kept allocated for the next new slot
                        continue
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass

    def grant(self, slots: list[int], grant: bytes) -> None:
        """Let whoever shows ``grant`` write these slots over TCP (a pending version's)."""
        with self._lock:
            for slot in slots:
                if slot not in self._segments:
                    raise StoreError(f"volume {self.volume_id} has no slot {slot}")
                self._grants[slot] = grant

    def seal(self, slots: list[int], timeout: float = 60.0) -> None:
        """No more network writes into these slots (their version commits or ends): new
        writes are refused at once, and this returns when those already receiving bytes
        are done. Raises StoreError if one is still receiving after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._done_writing:
            self._last_busy = time.monotonic()  # a put commits: the pool waits (_fill_pool)
            for slot in slots:
                self._grants.pop(slot, None)
            while any(self._inflight.get(s) for s in slots):
                left = deadline - time.monotonic()
                if left <= 0:
                    busy = [s for s in slots if self._inflight.get(s)]
                    raise StoreError(
                        f"volume {self.volume_id}: a network write into slots {busy} is still "
                        f"in flight after {timeout:g} s; the version cannot be sealed"
                    )
                self._done_writing.wait(left)

    def segment(self, slot: int) -> torch.Tensor:
        try:
            return self._segments[slot][1]
        except KeyError:
            raise StoreError(f"volume {self.volume_id} has no slot {slot}") from None

    def writable(self, slot: int, grant: bytes) -> torch.Tensor:
        """The slot's bytes if ``grant`` allows writing them; raises ValueError otherwise.
        The caller is counted as writing the slot until it calls ``_written(slot)``."""
        with self._lock:
            held = self._grants.get(slot)
            if held is None or not hmac.compare_digest(held, grant):
                raise ValueError(
                    f"slot {slot} of volume {self.volume_id} is not open for writing with "
                    "this grant (committed, not yet begun, or another writer's)"
                )
            seg = self.segment(slot)
            self._inflight[slot] = self._inflight.get(slot, 0) + 1
            return seg

    def _written(self, slot: int) -> None:
        with self._done_writing:
            left = self._inflight.get(slot, 1) - 1
            if left:
                self._inflight[slot] = left
            else:
                self._inflight.pop(slot, None)
            self._done_writing.notify_all()

    def write_from(
        self, sock: socket.socket, slot: int, offset: int, nbytes: int, grant: bytes
    ) -> None:
        """Receive ``nbytes`` from the socket straight into the slot at ``offset``; the
        payload is discarded (and ValueError raised) when the write is not allowed. A seal
        of the slot waits for a write that already passed the grant check."""
        try:
            seg = self.writable(slot, grant)
        except (ValueError, StoreError):
            wire.discard(sock, nbytes)
            raise
        try:
            if offset + nbytes > seg.numel():
                wire.discard(sock, nbytes)
                raise ValueError(
                    f"write of {nbytes} bytes at offset {offset} exceeds slot {slot} "
                    f"of {seg.numel()} bytes"
                )
            if slot not in self._populated:  # allocate before recv_into touches a page
                try:
                    populate([(seg.data_ptr(), seg.numel(), self.path(slot))])
                except StoreError:
                    wire.discard(sock, nbytes)
                    raise
                self._populated.add(slot)
            if nbytes:
                wire.recv_into(sock, seg[offset : offset + nbytes].numpy().data)
        finally:
            self._written(slot)

    def read_view(
        self,
        slot: int,
        shape: list[int],
        itemsize: int,
        offsets: list[int],
        sizes: list[int],
    ) -> memoryview:
        """Bytes of a sub-box of the shard stored in ``slot``, contiguous (copied if needed)."""
        seg = self.segment(slot)
        n = itemsize
        for s in shape:
            n *= s
        if n != seg.numel():
            raise ValueError(f"slot {slot} holds {seg.numel()} bytes, shape {shape} needs {n}")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise ValueError(f"box {offsets}/{sizes} does not match shape {shape}")
        for o, s, d in zip(offsets, sizes, shape, strict=True):
            if o + s > d:
                raise ValueError(f"box {offsets}/{sizes} exceeds shape {shape}")
        view = byte_view(seg, tuple(shape), itemsize)
        for d, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
            view = view.narrow(d, o, s)
        if not view.is_contiguous():
            view = view.contiguous()
        return view.reshape(-1).numpy().data

    def nixl_describe(self, slots: list[int]) -> tuple[str, bytes, list[tuple[int, int, int]]]:
        """This volume's NIXL agent name, its metadata for ``slots`` and (slot, address,
        bytes) of each that exists; the agent is made, and every slot registered with it,
        at the first call. StoreError if NIXL is not installed here or the volume is closing."""
        from tidal.store.transports import nixl

        with self._lock:
            if self._closed:  # close() is releasing the agent: make none again
                raise StoreError(f"volume {self.volume_id!r} is closing")
            if self._nixl is None:
                agent = nixl.VolumeAgent(self.volume_id, self.nixl_loopback, self._lock)
                for slot, (_, seg) in self._segments.items():
                    agent.register(slot, seg)
                self._nixl = agent
            return self._nixl.describe(slots)

    @property
    def reserved(self) -> int:
        """Bytes of allocated part files waiting in the reserve."""
        with self._lock:
            return self._reserve.bytes

    @property
    def reserve(self) -> Reserve | None:
        """The files written ahead for new slots (reserve and pool), if this volume keeps any."""
        return self._reserve

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._pool_wake.notify_all()
        if self._pool_thread is not None:
            self._pool_thread.join(60)  # at most one part file being written
        with self._lock:
            self._reserve.target = 0  # destroyed slots' files are unlinked, not kept
        self.destroy(list(self._segments))
        with self._lock:
            self._reserve.close()
            agent, self._nixl = self._nixl, None
        if agent is not None:  # outside the lock: its progress thread takes it
            agent.close()
