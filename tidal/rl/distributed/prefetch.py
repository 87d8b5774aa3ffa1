"""Weight prefetch for asynchronous generators: the next policy version is read from the
store into staging memory in the background, then copied into the live parameters between
decode steps, without draining the batch.

Lifecycle (in a generator process): build `Stager(store, "policy", gen.model.state_dict(),
held=v)` once the generator holds version v; `start()` its thread; set
`gen.swap_hook = stager.swap` so that `Generator.generate` calls it between decode steps;
call `stager.at_batch_start()` before each batch (it swaps too, and counts prefetch hits);
`close()` at the end.

Staging memory is a second set of host tensors shaped like the parameters (pinned when the
parameters are on a GPU), or of device tensors (`on_device`: GPU slots, filled on a CUDA
stream of the thread's own, so the reads overlap the generator's decode steps). The
background thread fills it with the newest committed version (or waits for the next one to
be written, streaming it as it lands; each read returns once its copies are done), then
waits until the generator has swapped it in. A swap is one in-place `copy_` per parameter:
no reallocation, so captured CUDA graphs stay valid; on a GPU the copies are queued on the
generator's current stream (non-blocking from pinned memory) and the staging buffer is
refilled only after they ran.

Tensor-parallel generators: over DTensor parameters the staging tensors are DTensors of the
same layout (each rank reads only its own shards), and the ranks of the parameters' mesh
agree on every swap: each swap point is one small all-reduce of the version each rank has
staged. They swap when they all hold the same version; when they differ, nobody swaps and
the ranks behind drop theirs and fetch the newest one offered, so they agree at a later
point. Every rank of the generator calls `swap` and `at_batch_start` at the same points
(they run the same loop in lockstep).

Prefetch hit rate: a version was needed at a batch start when one newer than the version
the previous batch started with has been committed in the store since; it is a hit when the
generator then holds the newest committed version (prefetched and swapped in during the last
batch, or staged and swapped in at this start), a miss when the batch starts behind it (the
newest was still being read: the generator never waits).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tidal.models.profiling import span
from tidal.store.errors import (
    KeyNotFoundError,
    StoreError,
    VersionNotFoundError,
    WaitExpiredError,
)


class Stager:
    """Background prefetch of policy versions into staging tensors (see the module
    docstring).

    Args:
        store: this process's `tidal.store.Store`.
        key: the policy's key ("policy").
        params: the live state dict (`model.state_dict()`), plain tensors or DTensors (a
            tensor-parallel generator: see the module docstring); swaps copy into it.
        held: the version the live parameters hold now.
        last: the last version there will be (the thread stops after staging it).
        slice_s: longest single wait for an unwritten version (the thread rechecks for a
            newer one and for `close()` between waits).
        on_device: stage in a second set of tensors on the parameters' device (GPU slots:
            a second copy of the weights in GPU memory, filled device to device when the
            store keeps versions in GPU memory) instead of host memory.
    """

    def __init__(
        self,
        store: Any,
        key: str,
        params: Mapping[str, torch.Tensor],
        *,
        held: int,
        last: int,
        slice_s: float = 0.5,
        on_device: bool = False,
    ) -> None:
        self.store, self.key, self.params = store, key, dict(params)
        self.last, self.slice_s = last, slice_s
        pin = any(t.is_cuda for t in self.params.values()) and torch.cuda.is_available()
        self.staging = {k: _staging_like(t, on_device, pin) for k, t in self.params.items()}
        mesh = next((t.device_mesh for t in self.params.values() if isinstance(t, DTensor)), None)
        self._group = mesh.get_group() if mesh is not None and mesh.size() > 1 else None
        self._device = next(iter(self.params.values())).device
        self._target: int | None = None  # TP: the version the other ranks hold staged
        self.held = held
        self.hits = self.misses = self.swaps = 0
        self._batch_version = held  # the version the last batch started with
        self.swap_s = 0.0
        """Seconds the generator spent in swaps (copying staged weights into its own)."""
        self.error: BaseException | None = None
        self.torn: list[tuple[int, str]] = []
        """Versions aborted mid-put (their writer died), never staged, and why."""
        self._staged: int | None = None  # version complete in staging, not yet swapped in
        self._copied: Any = None  # CUDA event: the last swap's copies have run
        self._cv = threading.Condition()
        self._halt = False
        self._thread = threading.Thread(target=self._run, name="tidal-rl-prefetch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._cv:
            self._halt = True
            self._cv.notify_all()
        self._thread.join(timeout=10 * self.slice_s + 10)

    # -- the background thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            # GPU staging slots are filled on a stream of this thread's own: on the thread's
            # default stream the reads would queue behind the generator's decode steps, and
            # their closing synchronize would wait for those too.
            on_gpu = _local(next(iter(self.staging.values()))).is_cuda
            with torch.cuda.stream(torch.cuda.Stream(self._device) if on_gpu else None):
                self._loop()
        except BaseException as e:  # reported by the next swap, in the generator's thread
            with self._cv:
                self.error = e
                self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._staged is not None and not self._halt:
                    self._cv.wait()
                if self._halt:
                    return
                held = self.held
            if held >= self.last:
                return
            if self._copied is not None:
                self._copied.synchronize()  # the last swap has read the staging buffer
            version = self._fetch(held)
            if version is not None:
                with self._cv:
                    self._staged = version
                    self._cv.notify_all()

    def _fetch(self, held: int) -> int | None:
        """Read the newest committed version above `held` (or wait a slice for held + 1)
        into staging; returns it, or None when nothing new came."""
        try:
            newest = self.store.versions(self.key)[-1]
        except (KeyNotFoundError, IndexError):
            newest = -1
        with self._cv:
            agreed, self._target = self._target, None  # the ranks' agreed version (TP)
        target = held + 1
        while target in {v for v, _ in self.torn}:
            target += 1  # never readable: wait for the one after
        try:
            if agreed is not None and agreed > held:
                self.store.get_state_dict(self.key, into=self.staging, version=agreed)
                return agreed
            if newest > held:
                self.store.get_state_dict(self.key, into=self.staging, version=newest)
                return newest
            self.store.get_state_dict(
                self.key, into=self.staging, version=target, wait=self.slice_s
            )
            return target
        except VersionNotFoundError as e:
            # A version aborted mid-put (the staging buffer may hold part of its bytes, and
            # is never swapped in for it); else not written yet or dropped: ask again.
            if "aborted" in str(e) and newest <= held:
                self.torn.append((target, str(e)))
            return None
        except (KeyNotFoundError, WaitExpiredError):
            return None  # not written yet: ask again

    # -- the generator's side ---------------------------------------------------------------

    def swap(self) -> int | None:
        """If a version newer than the held one is staged, copy it into the live parameters
        in place and return it; else None. Called between decode steps.

        Raises:
            StoreError: the background read failed (the store is gone).
        """
        if self.error is not None:
            err, self.error = self.error, None
            if isinstance(err, StoreError | OSError):
                raise StoreError(f"prefetching policy versions failed: {err}") from err
            raise err
        with self._cv:
            version = self._agreed(self._staged)
        if version is None:
            return None
        t0 = time.perf_counter()
        with span("rl/load_weights"), torch.no_grad():
            for name, dst in self.params.items():
                _local(dst).copy_(_local(self.staging[name]), non_blocking=True)
        if any(t.is_cuda for t in self.params.values()):
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.swap_s += time.perf_counter() - t0
        with self._cv:
            self.held, self._staged = version, None
            self.swaps += 1
            self._cv.notify_all()
        return version

    def _agreed(self, staged: int | None) -> int | None:
        """The version to swap in now: the staged one with one rank; under tensor
        parallelism the one every rank has staged, else None (the ranks behind the newest
        staged version drop theirs and fetch that one). Called with the lock held."""
        if self._group is None:
            return staged
        mine = -1 if staged is None else staged
        both = torch.tensor([mine, -mine], dtype=torch.long, device=self._device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self._group)
        newest, oldest = int(both[0]), -int(both[1])
        if newest == oldest:
            return staged
        if mine < newest:
            self._staged, self._target = None, newest  # refetch: the thread stages `newest`
            self._cv.notify_all()
        return None

    def wait_staged(self, timeout: float) -> int | None:
        """Block until a version newer than the held one is staged (at most `timeout` s);
        returns it, or None. For callers that choose to wait; the async loop never does."""
        with self._cv:
            self._cv.wait_for(
                lambda: self._staged is not None or self.error is not None, timeout=timeout
            )
            return self._staged

    def at_batch_start(self) -> int | None:
        """Before a batch: swap in a staged version, and count a prefetch hit or miss when a
        version newer than the last batch's was committed (see the module docstring).
        Returns the version swapped in, or None."""
        try:
            newest = self.store.versions(self.key)[-1]
        except (KeyNotFoundError, IndexError):
            newest = -1
        swapped = self.swap()
        if newest > self._batch_version:
            if self.held >= newest:
                self.hits += 1
            else:
                self.misses += 1
        self._batch_version = self.held
        return swapped


def _staging_like(t: torch.Tensor, on_device: bool, pin: bool) -> torch.Tensor:
    """An empty staging tensor for parameter `t`: on its device (`on_device`) or in host
    memory; for a DTensor, a DTensor of the same layout over such a local tensor."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if on_device:
        buf = torch.empty_like(local)
    else:
        buf = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
    if not isinstance(t, DTensor):
        return buf
    return DTensor.from_local(
        buf, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
