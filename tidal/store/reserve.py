"""A volume's reserve: part files whose pages are allocated ahead, for new slots to take.

The first put of a key writes into fresh shared memory, and every fresh page is a page fault
(on a virtual machine whose free memory goes back to the host, a much slower one). A volume
made with ``reserve=N`` allocates ceil(N / ``PART_BYTES``) full-size part files at start
(or, given the sizes of a state dict's parts, a file of each: its first put then finds every
part it needs), in parallel (``posix_fallocate``, then zeros written over every page), and a
new slot takes its parts from them (a hard link to the slot's name, then an unlink: an
existing name is never replaced; a part shorter than ``PART_BYTES`` takes a file of exactly
its size if the reserve has one, else a full-size one truncated to it). When a slot is destroyed its
parts go back to the reserve, by size, while it holds less than ``N``: deleting a key and
putting another of the same layout then pays no fault at all; past ``N``
they are unlinked and their memory freed.

Reserve files are named ``<shm_dir>/tidal-<store id>-<volume id>-reserve.<n>``, built here
from ids the volume checked, and reaped with the store's other files when its process dies
(volume.reap_stale). Lifecycle: made by :class:`~tidal.store.volume.Volume` at start,
unlinked at its close. Not thread-safe: the volume calls it under its lock.
"""

from __future__ import annotations

import errno
import os
from concurrent.futures import ThreadPoolExecutor

from tidal.store import numa
from tidal.store.errors import StoreError

_ZEROS = bytes(8 << 20)


class Reserve:
    def __init__(self, shm_dir: str, prefix: str, part_bytes: int, node: int | None = None) -> None:
        """``prefix``: the volume's file name prefix (``tidal-<store id>-<volume id>``);
        ``node``: the NUMA node its files' pages go on (tidal/store/numa.py; None: anywhere)."""
        self._dir, self._prefix, self._part = shm_dir, prefix, part_bytes
        self.node = node
        self._free: dict[int, list[int]] = {}  # file size -> numbers of files ready to take
        self._bytes = 0
        self._next = 1
        self.target = 0  # bytes the reserve refills to from destroyed slots
        # A pool's size classes (full-size part files and halves down to 1 MiB) and the bytes
        # of new parts of each class asked for since the pool was last topped up.
        smallest = min(1 << 20, part_bytes)
        self.classes = [part_bytes >> k for k in range(7) if part_bytes >> k >= smallest]
        self._demand: dict[int, int] = {}
        first = self.classes[:4]
        self._shape: dict[int, float] = {c: 1 / len(first) for c in first}

    @property
    def bytes(self) -> int:
        return self._bytes

    def path(self, n: int) -> str:
        return os.path.join(self._dir, f"{self._prefix}-reserve.{n}")

    def fill(self, sizes: list[int], threads: int = 8) -> None:
        """Allocate a file of each of ``sizes`` (each at most a part), ``threads`` at a time;
        StoreError naming the directory if it is full (the files made so far are unlinked)."""
        if any(not 0 < n <= self._part for n in sizes):
            raise ValueError(f"reserve files hold 1 to {self._part} bytes each")
        nbytes = sum(sizes)
        self.target = nbytes
        numbers = list(range(self._next, self._next + len(sizes)))
        self._next += len(sizes)
        with ThreadPoolExecutor(min(threads, max(len(sizes), 1))) as pool:
            results = list(pool.map(self._allocate, numbers, sizes))
        failed = [e for e in results if e is not None]
        made = [(n, size) for n, size, e in zip(numbers, sizes, results, strict=True) if e is None]
        if failed:
            for n, _ in made:
                _unlink(self.path(n))
            raise StoreError(
                f"cannot reserve {nbytes} bytes of shared memory in {self._dir}: {failed[0]}"
            )
        for n, size in made:
            self._free.setdefault(size, []).append(n)
            self._bytes += size

    def _allocate(self, n: int, size: int) -> str | None:
        path = self.path(n)
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            return f"{path}: {e.strerror}"
        try:
            os.ftruncate(fd, size)
            numa.bind_file(fd, size, self.node)  # before any page exists
            try:  # fails at once, cleanly, where the file system is full
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
            # tmpfs clears fallocated pages only when they are first used, and a virtual
            # machine's host backs a page only when it is first written: write every page.
            for off in range(0, size, len(_ZEROS)):
                os.pwrite(fd, _ZEROS[: size - off], off)
            return None
        except OSError as e:
            _unlink(path)
            return f"{path}: {e.strerror}"
        finally:
            os.close(fd)

    def number(self) -> int:
        """A new reserve file number (for :meth:`allocate` outside the volume's lock)."""
        n, self._next = self._next, self._next + 1
        return n

    def allocate(self, n: int, size: int) -> str | None:
        """Make reserve file ``n`` of ``size`` bytes with every page written; the error text
        if it fails (nothing left behind). Thread-safe for distinct ``n``: the volume's pool
        thread calls it without the volume's lock, then :meth:`add`."""
        return self._allocate(n, size)

    def add(self, n: int, size: int) -> None:
        """Put file ``n`` (made by :meth:`allocate`) in the reserve."""
        self._free.setdefault(size, []).append(n)
        self._bytes += size

    def next_size(self, pool: int) -> int:
        """The size of the next file a pool of ``pool`` bytes should make: the class furthest
        below its share. Shares follow the sizes the last puts asked for (a new key of
        the same layout then takes files of its parts' own sizes: no truncation, whose
        freeing of pages cost 60 ms of a 150 ms first put of 16 tensors of 32 MB on the
        2-core VM), at first a quarter each to 64, 32, 16 and 8 MiB."""
        if self._demand:
            total = sum(self._demand.values())
            self._shape = {c: b / total for c, b in self._demand.items()}
            self._demand = {}
        held = {c: c * len(self._free.get(c, ())) for c in self.classes}
        return max(self._shape, key=lambda c: pool * self._shape[c] - held[c])

    def class_of(self, nbytes: int) -> int | None:
        """The smallest class holding ``nbytes`` (None below half the smallest)."""
        fits = [c for c in self.classes if c >= nbytes]
        return min(fits) if fits and nbytes * 2 > self.classes[-1] else None

    def discard(self, n: int) -> None:
        """Unlink file ``n`` (made by :meth:`allocate`, not added)."""
        _unlink(self.path(n))

    def take(self, path: str, nbytes: int) -> bool:
        """Give ``path`` (a new part of ``nbytes`` <= a part) a reserve file's pages: one of
        exactly that size (a destroyed slot's part of the same layout), else the smallest
        one of at most twice it, else a full-size one, truncated to it. False if there is
        none or it cannot be moved (the caller creates a fresh file)."""
        c = self.class_of(nbytes)
        if c is not None:
            self._demand[c] = self._demand.get(c, 0) + c
        near = [s for s, ns in self._free.items() if ns and nbytes < s <= 2 * nbytes]
        size = nbytes if self._free.get(nbytes) else min(near, default=self._part)
        while self._free.get(size):
            n = self._free[size].pop()
            self._bytes -= size
            try:
                os.link(self.path(n), path)  # EEXIST rather than replace an existing name
            except FileExistsError:
                self._free[size].append(n)
                self._bytes += size
                return False
            except OSError:
                _unlink(self.path(n))
                continue  # that reserve file is gone or unusable: try the next
            _unlink(self.path(n))
            if nbytes != size:
                try:
                    os.truncate(path, nbytes)
                except OSError:
                    _unlink(path)
                    return False
            return True
        return False

    def give(self, path: str, nbytes: int) -> bool:
        """Take back a destroyed slot's part ``path`` of ``nbytes`` while the reserve holds
        less than its target; False if the caller should unlink it."""
        if not 0 < nbytes <= self._part or self._bytes + nbytes > self.target:
            return False
        n, self._next = self._next, self._next + 1
        try:
            os.link(path, self.path(n))
        except OSError:
            return False
        _unlink(path)
        self._free.setdefault(nbytes, []).append(n)
        self._bytes += nbytes
        return True

    def close(self) -> None:
        self.target = 0
        for numbers in self._free.values():
            for n in numbers:
                _unlink(self.path(n))
        self._free.clear()
        self._bytes = 0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
