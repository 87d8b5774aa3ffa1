"""How the RL roles see each other: only through the store.

Keys of a run (one run per store at a time; the trainer clears an earlier run's at start):

    policy               state dict, version v: the weights after v optimizer steps
    rollouts/<g>         RolloutBatch of generator g, version s: the samples of step s
    eval                 plain values, version v: eval_pass1 of policy version v
    control/start        plain values, version 0: the trainer's first step and the run's length
    control/stop         plain values: a role asks every other to stop (error or Ctrl-C)
    control/done         plain values, version 0: the trainer finished; generators may exit
    control/taken/<g>    plain values, version k (async): the trainer took rollouts/<g>@k,
                         a slot of g's rollout queue is free
    control/intake       plain values, version s: the (generator, batch) pairs trainer
                         rank 0 took for step s; the other ranks read the same
    control/members      plain values, version v (sync): the generators that make batch
                         v + 1 from policy version v, and their prompts
                         (tidal/rl/distributed/membership.py)
    control/left/<g>     plain values: generator g left the job, and why
    alive/<role>         plain values, a new version every `rl.heartbeat_s`: "I am alive",
                         with the process's random id (a restarted generator has a new one)
                         and whether it is ready (a generator is not while it warms up)

Liveness: each role runs a `Link`, whose background thread puts a heartbeat under
`alive/<role>` every `heartbeat_s`. Waiting for another role's output is `Link.wait`: it
asks the store in slices of `heartbeat_s`, and between slices checks `control/stop` and the
heartbeats of the roles it depends on. A heartbeat that has not advanced for `dead_after_s`
(measured on the waiter's own clock, so hosts need no synchronized clocks) means that role
is dead, once it was seen to advance; a role that never beat, or whose heartbeat (an earlier
run's) has not advanced since the waiter started, is dead once `wait_timeout_s` has passed.
Every wait ends within `wait_timeout_s` with an error naming what it waited for.
Generators are not watched this way: the trainer tracks them as members that come and go
(tidal/rl/distributed/membership.py). Once a role has seen the run's `control/start` (`follow_run`),
each check also asks that it is still there: a store whose controller was restarted holds
nothing of the run, and every role then stops saying so.

Lifecycle (in every role process): `Link(store, name, watch=[...], loop=cfg.rl)` after
connecting (`ready=False` for a generator, which says `link.set_ready()` once its warm-up is
done), `link.start()` to begin beating, `link.wait(...)` for each input, `link.stop(why)`
on an error or Ctrl-C (the others see it within a heartbeat), `link.close()` at the end.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tidal.rl.config import LoopConfig
from tidal.store.errors import (
    KeyNotFoundError,
    StoreError,
    VersionNotFoundError,
    WaitExpiredError,
)

T = TypeVar("T")

POLICY = "policy"
EVAL = "eval"
START = "control/start"
STOP = "control/stop"
DONE = "control/done"
INTAKE = "control/intake"
MEMBERS = "control/members"
ALIVE = "alive/"


def rollouts_key(generator: int) -> str:
    """The key generator `generator` puts its rollout batches under."""
    return f"rollouts/{generator}"


def taken_key(generator: int) -> str:
    """async: the key the trainer marks generator `generator`'s taken batches under."""
    return f"control/taken/{generator}"


def left_key(generator: int) -> str:
    """The key generator `generator` puts its reason under when it leaves the job."""
    return f"control/left/{generator}"


def generator_name(index: int) -> str:
    return f"generator {index}"


def stop_reason(e: BaseException, role: str) -> str:
    """What `role` tells the others (`Link.stop`) when `e` ends it."""
    if isinstance(e, KeyboardInterrupt):
        return f"{role} was interrupted (Ctrl-C)"
    return f"{role} failed: {type(e).__name__}: {e}"[:500]


class RoleStopped(RuntimeError):
    """Another role asked every role to stop, or died; the message says which and why."""


class Leaving(Exception):
    """This role was asked to leave the job (a generator's SIGTERM); raised by its next check."""


class NotYet(Exception):
    """Raised by a `Link.wait` attempt: what it waits for is not there yet, ask again."""


class Link:
    """One role's heartbeat, stop flag and guarded waits (see the module docstring).

    Args:
        store: this process's `tidal.store.Store`.
        name: this role ("trainer", "generator 0").
        watch: the roles whose output this one waits for; their silence stops the wait.
        loop: the timeouts (`rl.wait_timeout_s`, `rl.heartbeat_s`, `rl.dead_after_s`).
        beat: put heartbeats (one process per role does: trainer rank 0, each generator).
        ready: what the heartbeats say until `set_ready()`: a generator beats from its
            start, not ready while it builds and warms up its Generator (the trainer counts
            it as a member only once it is ready: tidal/rl/distributed/membership.py).
    """

    def __init__(
        self,
        store: Any,
        name: str,
        *,
        watch: list[str],
        loop: LoopConfig,
        beat: bool = True,
        log: Callable[[str], None] | None = None,
        ready: bool = True,
    ) -> None:
        self.store, self.name, self.watch, self.loop = store, name, list(watch), loop
        self.log = log
        self._torn: set[str] = set()
        self._beat = beat
        self._started = time.monotonic()
        self._seen: dict[str, tuple[int, float]] = {}  # role -> (last beat version, when seen)
        self._beating: set[str] = set()  # watched roles seen to beat since this one started
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._run_seen = False
        self.leaving: str | None = None
        """Set (to why) to leave at the next check: `Leaving` is raised there."""
        self.may_leave: Callable[[], bool] | None = None
        """While it answers False, a role asked to leave does not yet (it owes a batch)."""
        self.beat_error: BaseException | None = None
        self.ident = secrets.token_hex(8)
        """This process's id in its heartbeats: a restarted role beats with a new one."""
        self.ready = ready
        """Said in every heartbeat (see `set_ready`)."""

    @staticmethod
    def key(role: str) -> str:
        return ALIVE + role.replace(" ", "")

    def start(self) -> None:
        """Put the first heartbeat now and keep beating in a daemon thread."""
        if not self._beat:
            return
        self.beat()
        self._thread = threading.Thread(
            target=self._run, name=f"tidal-rl-beat-{self.name}", daemon=True
        )
        self._thread.start()

    def beat(self) -> None:
        """Put one heartbeat now (the beating thread calls it every `heartbeat_s`; a test
        beats by hand with it, without the thread)."""
        self.store.put_state_dict(
            {"role": self.name, "t": time.time(), "id": self.ident, "ready": self.ready},
            self.key(self.name),
        )

    def set_ready(self) -> None:
        """Say from the next heartbeat on (within `heartbeat_s`) that this role is ready."""
        self.ready = True

    def follow_run(self) -> None:
        """From now on every check asks that the run's `control/start` is still in the store
        (it is gone when the store's controller was restarted)."""
        self._run_seen = True

    def _run(self) -> None:
        while not self._halt.wait(self.loop.heartbeat_s):
            try:
                self.beat()
            except BaseException as e:  # the store is gone: the waits report it
                self.beat_error = e
                return

    def close(self) -> None:
        """Stop beating (the others then see this role as gone after `dead_after_s`)."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.loop.heartbeat_s + 5)
            self._thread = None

    def stop(self, reason: str) -> None:
        """Ask every role to stop, saying why (best effort: the store may be gone)."""
        try:
            if not self.store.exists(STOP):
                self.store.put_state_dict({"by": self.name, "reason": reason}, STOP)
        except (StoreError, ValueError, OSError):
            pass

    def check(self) -> None:
        """Raise RoleStopped if a role asked to stop, a watched role is silent, or the store
        lost the run (stopped answering, or its controller was restarted); Leaving when this
        role was asked to leave."""
        if self.leaving is not None and (self.may_leave is None or self.may_leave()):
            raise Leaving(self.leaving)
        try:
            self._check_store()
        except StoreError:  # once more: a call that failed drops its connection, and the next
            try:  # goes out on a new one (a restarted controller answers it)
                self._check_store()
            except (StoreError, KeyNotFoundError, VersionNotFoundError) as e:
                raise RoleStopped(
                    f"{self.name}: the store at {self.store.address} stopped "
                    f"answering ({e}); every role stops"
                ) from e
        except (KeyNotFoundError, VersionNotFoundError) as e:
            raise RoleStopped(
                f"{self.name}: the store at {self.store.address} lost this "
                f"run's keys ({e}); every role stops"
            ) from e
        self._check_watched()

    def _check_store(self) -> None:
        if self.store.exists(STOP):
            info = self.store.get_state_dict(STOP)
            raise RoleStopped(
                f"{info.get('by', 'a role')} stopped the run: "
                f"{info.get('reason', '(no reason given)')}"
            )
        if self._run_seen and not self.store.exists(START, 0):
            raise RoleStopped(
                f"{self.name}: the store at {self.store.address} no longer holds this run "
                f"(its {START} is gone): its controller was restarted, or another run "
                f"cleared it; every role stops"
            )

    def _check_watched(self) -> None:
        now = time.monotonic()
        for role in self.watch:
            try:
                version = self.store.versions(self.key(role))[-1]
            except (KeyNotFoundError, IndexError):
                if now - self._started > self.loop.wait_timeout_s:
                    raise RoleStopped(
                        f"{role} never started (no heartbeat in the store within "
                        f"rl.wait_timeout_s={self.loop.wait_timeout_s:g} s)"
                    ) from None
                continue
            last = self._seen.get(role)
            if last is None or last[0] != version:
                if last is not None:
                    self._beating.add(role)
                self._seen[role] = (version, now)
            elif role not in self._beating:  # a heartbeat left by an earlier run, so far
                if now - self._started > self.loop.wait_timeout_s:
                    raise RoleStopped(
                        f"{role} never started (its heartbeat in the store did not advance "
                        f"within rl.wait_timeout_s={self.loop.wait_timeout_s:g} s)"
                    )
            elif now - last[1] > self.loop.dead_after_s:
                raise RoleStopped(
                    f"{role} stopped answering: no heartbeat for {now - last[1]:.1f} s "
                    f"(rl.dead_after_s={self.loop.dead_after_s:g}); it has died or hangs"
                )

    def beating(self, role: str) -> bool:
        """Whether watched `role`'s heartbeat has advanced since this role started (a
        heartbeat left by an earlier run, or by a dead process, does not)."""
        return role in self._beating

    def wait(self, what: str, attempt: Callable[[float], T]) -> T:
        """`attempt(seconds)` until it returns, checking the others between tries.

        `attempt` waits at most `seconds` (e.g. `store.get_state_dict(..., wait=seconds)`) and
        raises VersionNotFoundError (or KeyNotFoundError) when what it waits for is not there,
        WaitExpiredError when it began but was not completely written.

        Raises:
            RoleStopped: a role asked to stop, or one this role depends on died.
            TimeoutError: nothing came within `rl.wait_timeout_s` (the message names `what`).
        """
        deadline = time.monotonic() + self.loop.wait_timeout_s
        failures = 0
        while True:
            self.check()
            left = deadline - time.monotonic()
            slice_s = max(0.0, min(self.loop.heartbeat_s, left))
            try:
                return attempt(slice_s)
            except (VersionNotFoundError, KeyNotFoundError, WaitExpiredError, NotYet) as e:
                # Not there (or not completely written) within this slice: ask again. A
                # version aborted mid-put (its writer died) never becomes readable: say so
                # once, and pause a slice (the store answers at once for it).
                if "aborted" in str(e):
                    if str(e) not in self._torn and self.log is not None:
                        self.log(f"{self.name}: {what}: {e}; it is never read")
                    self._torn.add(str(e))
                    time.sleep(slice_s)
            except StoreError as e:
                # The call dropped its connection: the check asks again on a new one and
                # says when the store is gone or restarted; a second failure in a row is final.
                self.check()
                failures += 1
                if failures > 1:
                    raise RoleStopped(
                        f"{self.name}: the store failed while waiting for {what}: {e}"
                    ) from e
                continue
            failures = 0
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.name}: waited rl.wait_timeout_s={self.loop.wait_timeout_s:g} s for "
                    f"{what}; it never came"
                )

    def wait_version(self, key: str, version: int, what: str, into: Any = None) -> dict:
        """`store.get_state_dict(key, into=, version=)` through `wait`."""
        return self.wait(
            what, lambda s: self.store.get_state_dict(key, into=into, version=version, wait=s)
        )
