"""Which generators are in the job: found through the store, never a fixed list.

A generator is a member while its heartbeat (`alive/generator<g>`, put by its
`coupling.Link`) advances. Trainer rank 0 keeps a `Members` and polls it between the slices
of its waits. A generator's state, as the trainer sees it:

    joined  its heartbeat advanced since the trainer began watching, saying it is ready (a
            late `tidal rl generator --index k` joins this way; a heartbeat left by an earlier
            run or a dead process does not advance and never counts; a generator beats from
            its start but says it is ready only after its warm-up (`Generator.warm_up`), so
            neither the first step nor a late joiner's first batch waits for compiles)
    lost    no new heartbeat for `rl.lost_after_s` (killed, hung, or its host gone): the
            trainer says so and goes on with the others
    left    it deleted its heartbeat key at a clean exit (`leave`), after putting its reason
            under control/left/<g>

A generator that beats again after being lost, or one restarted under the same index (its
heartbeat carries a new process id), is taken back as a new member. Fewer than
`rl.min_generators` live stops the trainer with an error naming what happened to the others.

Sync mode: before publishing version v the trainer announces `control/members@v`, the
generators that make batch v + 1 with their process ids and their shares of
`rollout.prompts_per_step` (`announce`). A generator samples only when it is listed with its
own id (`share_of`), so each step asks the whole prompts_per_step of whoever is live. A
member lost during a step is dropped from that step (its batch is never read: a rollout is
one version of a key, readable only once completely written), and the next step's shares go
to the others. Async mode needs no announcement: the trainer takes the next batches from any
generator (tidal/rl/distributed/intake.py).

Lifecycle: trainer rank 0 makes `Members(store, cfg, log=)` and `start()`s its thread,
which polls every half heartbeat (so a loss is reported within about rl.lost_after_s even
while the trainer is in a long step); it calls `wait_for(link, count)` before the first
version, `poll()` from its waits (rate-limited to 4 per heartbeat), `require()` where it
needs a generator, `announce(version)` (sync) before each publish, and `close()` at the end.
A generator calls `share_of(link, version, index)` (sync) and `leave(link, index, reason)`
at a clean exit.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidal.rl.config import RLConfig
from tidal.rl.distributed.coupling import ALIVE, MEMBERS, Link, NotYet, RoleStopped, left_key
from tidal.store.errors import KeyNotFoundError, StoreError, VersionNotFoundError

Log = Callable[[str], None]

PREFIX = ALIVE + "generator"


@dataclass(kw_only=True)
class Member:
    """One generator index, as the trainer last saw it."""

    index: int
    id: str = ""
    """The process id of its heartbeats (a restart under the same index changes it)."""
    token: tuple[Any, Any] = (None, None)
    """Its last heartbeat, (id, t): a new one means it beat again (compared, never timed)."""
    seen: float = 0.0
    """When (the trainer's monotonic clock) the heartbeat last changed."""
    state: str = "unknown"
    """unknown (a heartbeat seen, not yet advancing), live, lost or left."""
    why: str = ""
    """What happened to it (lost or left)."""
    ready: bool = True
    """Its last heartbeat said it is ready (False while it warms up)."""


class Members:
    """The trainer's view of the generators (see the module docstring).

    Args:
        store: trainer rank 0's `tidal.store.Store`.
        cfg: the run's config (`rl.lost_after_s`, `rl.min_generators`, `rl.heartbeat_s`,
            `rollout.prompts_per_step`).
        log: where joins, losses and departures are reported.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(
        self, store: Any, cfg: RLConfig, *, log: Log, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.store, self.cfg, self.log, self.clock = store, cfg, log, clock
        self.gens: dict[int, Member] = {}
        self.lost = 0
        """Generators lost or left so far (restarts included)."""
        self._polled = -math.inf
        self._lock = threading.RLock()  # the watcher thread polls too
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Poll in a daemon thread every half heartbeat until `close()`."""
        self._thread = threading.Thread(target=self._watch, name="tidal-rl-members", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._halt.wait(self.cfg.rl.heartbeat_s / 2):
            try:
                self.poll()
            except (StoreError, OSError):  # the store is gone: the trainer's waits report it
                return

    def close(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.cfg.rl.heartbeat_s + 5)
            self._thread = None

    # -- what the trainer asks ----------------------------------------------------------

    def live(self) -> list[Member]:
        with self._lock:
            return [m for _, m in sorted(self.gens.items()) if m.state == "live"]

    def is_live(self, index: int, ident: str) -> bool:
        """Whether generator `index` is live and still the process `ident`."""
        with self._lock:
            m = self.gens.get(index)
            return m is not None and m.state == "live" and m.id == ident

    def why(self, index: int) -> str:
        with self._lock:
            m = self.gens.get(index)
            if m is None or m.state == "live":
                return "restarted as a new process" if m is not None else "never seen"
            return m.why

    def _may_return(self, m: Member) -> bool:
        """A lost generator silent for less than rl.dead_after_s may still come back (a pause,
        not a death), and one that beats while it warms up is coming: the run does not stop
        for want of it yet."""
        paused = m.state == "lost" and m.why.startswith("lost:")
        warming = m.state != "live" and not m.ready
        return (paused or warming) and self.clock() - m.seen < self.cfg.rl.dead_after_s

    def gone(self, index: int, ident: str) -> bool:
        """Whether generator `index`'s process `ident` is gone for good: it left, was
        restarted, or is lost and silent for rl.dead_after_s."""
        with self._lock:
            m = self.gens.get(index)
            if m is None or m.id != ident:
                return True
            return m.state != "live" and not self._may_return(m)

    def require(self, doing: str) -> None:
        """Raise RoleStopped when fewer than rl.min_generators are live (a lost one counts
        until rl.dead_after_s: it may come back; one warming up counts while it beats)."""
        live, need = self.live(), self.cfg.rl.min_generators
        if len(live) >= need:
            return
        with self._lock:
            if len(live) + sum(self._may_return(m) for m in self.gens.values()) >= need:
                return
            gone = [
                f"generator {m.index} {m.why}"
                for _, m in sorted(self.gens.items())
                if m.state in ("lost", "left")
            ]
        raise RoleStopped(
            f"trainer: {len(live)} generator(s) live while {doing}, fewer than "
            f"rl.min_generators={need}"
            + (f": {'; '.join(gone)}" if gone else "")
            + "; the run stops (start generators with `tidal rl generator --index i`)"
        )

    # -- watching -------------------------------------------------------------------------

    def poll(self, *, force: bool = False) -> None:
        """Read every generator's heartbeat (at most 4 times a heartbeat unless `force`) and
        report joins, losses and departures."""
        with self._lock:
            self._poll(force)

    def _poll(self, force: bool) -> None:
        now = self.clock()
        if not force and now - self._polled < self.cfg.rl.heartbeat_s / 4:
            return
        self._polled = now
        present: set[int] = set()
        for key in self.store.keys(PREFIX):
            tail = key[len(PREFIX) :]
            if not tail.isdigit():
                continue
            g = int(tail)
            try:
                beat = self.store.get_state_dict(key)
            except (KeyNotFoundError, VersionNotFoundError):
                continue  # it left between the two calls
            present.add(g)
            token, ready = (beat.get("id"), beat.get("t")), bool(beat.get("ready", True))
            m = self.gens.get(g)
            if m is None:  # first sighting: a member once it beats again
                self.gens[g] = Member(
                    index=g, id=str(beat.get("id")), token=token, seen=now, ready=ready
                )
                continue
            if token != m.token:
                m.token, m.seen, m.ready = token, now, ready
                ident = str(beat.get("id"))
                if not ready:  # warming up: a member once it is ready
                    if m.state == "live" and m.id != ident:  # the old process is gone
                        self._gone(m, "lost", "restarted as a new process")
                    m.id = ident
                elif m.state != "live" or m.id != ident:
                    self._join(m, ident)
            elif m.state == "live" and now - m.seen > self.cfg.rl.lost_after_s:
                self._gone(
                    m,
                    "lost",
                    f"lost: no heartbeat for {now - m.seen:.1f} s "
                    f"(rl.lost_after_s={self.cfg.rl.lost_after_s:g})",
                )
        for g, m in self.gens.items():
            if g not in present and m.state == "live":
                self._gone(m, "left", f"left ({self._left_reason(g)})")

    def _join(self, m: Member, ident: str) -> None:
        again = m.state != "unknown"
        if m.state == "live":  # restarted within rl.lost_after_s: the old process is gone
            self._gone(m, "lost", "restarted as a new process")
        m.id, m.state, m.why = ident, "live", ""
        verb = "joined again" if again else "joined"
        self.log(f"trainer: generator {m.index} {verb} ({len(self.live())} live)")

    def _gone(self, m: Member, state: str, why: str) -> None:
        m.state, m.why = state, why
        self.lost += 1
        self.log(
            f"trainer: generator {m.index} {why}; going on with {len(self.live())} generator(s)"
        )

    def _left_reason(self, g: int) -> str:
        try:
            return str(self.store.get_state_dict(left_key(g)).get("reason", "no reason given"))
        except (KeyNotFoundError, VersionNotFoundError):
            return "its heartbeat was deleted"

    def wait_for(self, link: Link, count: int) -> None:
        """Before the first version: wait until `count` generators are live. After
        rl.wait_timeout_s it goes on with those there (at least rl.min_generators).

        Raises:
            TimeoutError: fewer than rl.min_generators joined within rl.wait_timeout_s.
        """

        def attempt(seconds: float) -> None:
            self.poll(force=True)
            if len(self.live()) < count:
                time.sleep(min(seconds, self.cfg.rl.heartbeat_s / 4))  # heartbeats to come
                raise NotYet
            return None

        try:
            link.wait(f"{count} generator(s) to join", attempt)
        except TimeoutError:
            live = self.live()
            with self._lock:
                warming = [m.index for _, m in sorted(self.gens.items()) if not m.ready]
            hint = "start them with `tidal rl generator --store ADDR --index i`"
            if warming:
                hint = (
                    f"generator(s) {warming} beat but were still warming up (compiles "
                    f"and CUDA graphs): raise rl.wait_timeout_s"
                )
            if len(live) < self.cfg.rl.min_generators:
                raise TimeoutError(
                    f"trainer: {len(live)} of generator.count={count} generators joined within "
                    f"rl.wait_timeout_s={self.cfg.rl.wait_timeout_s:g} s (rl.min_generators="
                    f"{self.cfg.rl.min_generators}); {hint}"
                ) from None
            self.log(
                f"trainer: {len(live)} of generator.count={count} generators joined within "
                f"rl.wait_timeout_s; going on with them"
            )

    # -- sync announcements ----------------------------------------------------------------

    def announce(self, version: int) -> list[list[Any]]:
        """Put control/members@version: each live generator, its id and its prompts of batch
        version + 1 (prompts_per_step split evenly, the remainder to the first). Returns it.

        Raises:
            RoleStopped: fewer than rl.min_generators are live, or none for
                rl.wait_timeout_s (while one warms up)."""
        self.poll(force=True)
        deadline = time.monotonic() + self.cfg.rl.wait_timeout_s
        # None live, one may come back (within rl.dead_after_s) or is warming up: wait for it.
        while True:
            self.require(f"publishing policy version {version}")
            if live := self.live():
                break
            if time.monotonic() > deadline:
                raise RoleStopped(
                    f"trainer: no generator live for rl.wait_timeout_s="
                    f"{self.cfg.rl.wait_timeout_s:g} s while publishing policy version "
                    f"{version} (the ones beating are still warming up)"
                )
            time.sleep(self.cfg.rl.heartbeat_s / 4)
            self.poll(force=True)
        share, extra = divmod(self.cfg.rollout.prompts_per_step, len(live))
        members = [[m.index, m.id, share + (1 if j < extra else 0)] for j, m in enumerate(live)]
        self.store.put_state_dict({"generators": members}, MEMBERS, version=version, keep=4)
        return members


def share_of(link: Link, version: int, index: int, ident: str | None = None) -> int:
    """Sync, in generator `index`: its prompts of batch version + 1 as the trainer announced
    with policy version `version` (0: not a member of that batch, e.g. it joined since).
    `ident`: the id its heartbeats carry (default this process's `link.ident`; the ranks of
    a generator in several processes pass their beating rank's)."""
    ident = link.ident if ident is None else ident
    members = link.wait_version(MEMBERS, version, f"the generators of policy version {version}")
    for g, member, prompts in members["generators"]:
        if g == index and member == ident:
            return int(prompts)
    return 0


def leave(link: Link, index: int, reason: str) -> None:
    """Generator `index` leaves the job cleanly: it stops beating, says why under
    control/left/<index> and deletes its heartbeat key, so the trainer drops it at once
    (best effort: the store may be gone)."""
    link.close()
    try:
        link.store.put_state_dict({"reason": reason[:300], "id": link.ident}, left_key(index))
        link.store.delete(Link.key(link.name))
    except (StoreError, KeyNotFoundError, ValueError, OSError):
        pass
