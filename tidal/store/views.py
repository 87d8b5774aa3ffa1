"""Zero-copy reads: tensors that alias a stored version's memory.

``get(key, copy=False)`` and ``get_state_dict(key, copy=False)`` return tensors whose bytes
are the volume's shared-memory segments, mapped read-only into the reader, or, for a version
put with ``memory="cuda"``, the writer's GPU memory opened with CUDA IPC. Nothing is copied,
so a same-host weight sync costs the writer's one copy into the store (put) and no copy at
all on the reader's side (benchmarks/store_sync.py prints the figure).

Lifecycle, per view:
- the get pins the version with a lease (as every get does) and maps each slot read-only
  (once per slot: mappings are cached, and slots are reused as a ring, so later versions map
  nothing new);
- each returned tensor holds a numpy array over the mapping; every array of the version
  holds one :class:`Lease` token;
- when the last tensor (or view of one, or parameter made from one) is garbage, its array
  goes, then the token, whose finalizer hands the lease to :class:`Releaser`, which sends the
  ``release`` at once if no other thread is sending one, or from its own thread otherwise.
  Until then the controller keeps the version's slots out of the ring: its bytes stay those
  of that version even after it is evicted or deleted.

The mapping is ``PROT_READ``: an in-place write to a view faults (SIGSEGV) instead of
corrupting the version other readers see. ``clone()`` a view to modify it.

GPU views differ in three ways. CUDA IPC has no read-only mapping, so an in-place write
changes the version every reader sees: never write to one (``clone()`` it). Each tensor is
its own storage over the slot (holding the token, and the slot's IPC mapping open), made by
``torch.as_tensor`` (tidal/store/transports/cuda/runtime.py). And kernels reading a view may
still be queued when it is dropped: the drop records an event on each view device's current
stream, and the lease is released only once those events have completed (by the releaser
thread if they have not yet), so the writer never reuses a slot under a queued read. Work
on other streams must be waited for before the views are dropped. The views stay valid
while the writer's store is open; when the writer closes or dies its GPU memory goes with
it, as for any freed memory.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from tidal.store.errors import StoreError
from tidal.store.server import SERVER_THREAD
from tidal.store.volume import Mapping


class Lease:
    """Held by every array of one zero-copy read; its death releases the version's lease."""

    __slots__ = ("__weakref__",)


def _keep(token: Lease) -> None:
    """Finalizer of an array: dropping the reference to ``token`` is all it does."""


def alias(
    mapping: Mapping, dtype: torch.dtype, shape: tuple[int, ...], token: Lease
) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` over the whole (read-only) ``mapping``."""
    arr = np.frombuffer(memoryview(mapping), dtype=np.uint8)  # a view: keeps the mapping
    weakref.finalize(arr, _keep, token).atexit = False
    with warnings.catch_warnings():
        # torch warns once that it has no read-only tensors; the mapping enforces it.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(arr)
    return flat.view(dtype).view(shape)


def arm(token: Lease, releaser: Releaser, lease: int, devices: list[int]) -> None:
    """Release ``lease`` once ``token`` (and so every tensor holding it) is garbage, and
    the work queued on the current streams of GPUs ``devices`` at that moment is done."""
    weakref.finalize(token, releaser.drop, lease, devices).atexit = False


class Releaser:
    """Sends lease releases for dropped views, from any thread, without blocking it.

    ``drop`` runs inside garbage collection, possibly while its thread is in the middle of a
    store request. It appends to a deque, then sends the pending releases itself when that
    is safe (so a ``del`` releases the version before it returns): no other thread is
    sending, and this is not a thread of a store server in this process, which may hold the
    controller's lock that the release needs. Otherwise it wakes the releaser thread
    through a pipe. Drops in a forked child are ignored: its leases are its parent's.
    """

    def __init__(self, release: Callable[[int], None]) -> None:
        self._release = release
        self._pending: deque[tuple[int, list[torch.cuda.Event]]] = deque()
        self._sending = threading.Lock()
        self._fds = threading.RLock()  # the pipe is not written while it is being closed
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._pid = os.getpid()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tidal-release", daemon=True)
        self._thread.start()

    def drop(self, lease: int, devices: list[int]) -> None:
        if self._closed or os.getpid() != self._pid:
            return  # the leases died with the connection, or belong to the parent process
        events = []
        for d in devices:  # reads of GPU views still queued must finish first
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(d))
            events.append(ev)
        self._pending.append((lease, events))
        if events and not all(ev.query() for ev in events):
            self._wake()  # the releaser thread waits for them, not this one
            return
        if not _server_thread() and self._sending.acquire(blocking=False):
            try:
                self._send()
            finally:
                self._sending.release()
            if not self._pending:
                return
        self._wake()

    def _wake(self) -> None:
        with self._fds:
            if self._closed:
                return
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass  # the pipe is full: a wake-up is already due

    def _send(self) -> None:
        while self._pending:
            lease, events = self._pending.popleft()
            for ev in events:  # polled, with sleeps that let other threads run
                while not ev.query():
                    time.sleep(0.0005)
            try:
                self._release(lease)
            except (StoreError, ValueError):
                pass  # the store is closing: its leases die with the connection

    def _run(self) -> None:
        try:
            while True:
                try:
                    if not os.read(self._wake_r, 4096):
                        return
                except OSError:
                    return
                if self._closed:
                    return
                with self._sending:
                    self._send()
        finally:
            os.close(self._wake_r)  # only this thread reads it

    def close(self) -> None:
        """Stop: later drops are ignored. Safe to call from a release (no join)."""
        with self._fds:
            if self._closed:
                return
            self._closed = True  # first: a finalizer running during close returns early
            self._pending.clear()
            os.close(self._wake_w)  # the thread's read returns b"" and it exits


def _server_thread() -> bool:
    """Whether this thread serves connections of a store server in this process."""
    return threading.current_thread().name.startswith(SERVER_THREAD)
