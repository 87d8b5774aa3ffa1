"""Waiting with a deadline: for a version to begin, for a slot to be written.

The controller blocks a request for at most the ``wait_ms`` it names, so a client waiting
longer than its socket timeout asks again in slices (:func:`until`); each slice is one
request on the handle's waiting connection, which nothing else uses, so waits never hold up
the puts and gets of other threads. :class:`Gate` is the streaming read's wait for each slot
of a pending version.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from tidal.store import ops
from tidal.store.conn import Conn
from tidal.store.errors import WaitExpiredError

T = TypeVar("T")


def until(
    deadline: float,
    timeout: float,
    attempt: Callable[[int], T | None],
    expired: Callable[[], Exception],
) -> T:
    """Call ``attempt(wait_ms)`` with waits shorter than half the socket ``timeout`` until it
    returns something other than None; raise ``expired()`` once ``deadline`` has passed."""
    while True:
        left = deadline - time.monotonic()
        chunk = max(0.0, min(left, timeout / 2))
        got = attempt(int(chunk * 1000))
        if got is not None:
            return got
        if time.monotonic() >= deadline:
            raise expired()


class Gate:
    """For a pending version: ``gate(slot)`` returns once that slot's bytes are in place,
    ``gate.committed()`` once the version is committed. Both raise if the version is aborted
    or the deadline passes. ``expect(slots)`` names the slots the read will copy, in order:
    each wait then asks for all of them still missing and learns every one written so far,
    one round trip per progress report of the writer rather than one per slot."""

    def __init__(
        self, conn: Callable[[], Conn], key: str, version: int, deadline: float, wait: float
    ) -> None:
        self._conn, self.key, self.version = conn, key, version
        self._deadline, self._wait = deadline, wait
        self._written: set[int] = set()
        self._order: list[int] = []
        self._committed = False

    def expect(self, slots: list[int]) -> None:
        self._order = list(dict.fromkeys(slots))

    def __call__(self, slot: int) -> None:
        if self._committed or slot in self._written:
            return
        missing = [s for s in self._order if s not in self._written]
        if slot in missing:  # ask from this slot on (it first), the rest after it
            i = missing.index(slot)
            missing = missing[i:] + missing[:i]
        else:
            missing = [slot]
        self._ask(missing)

    def committed(self) -> None:
        if not self._committed:
            self._ask([])

    def _ask(self, slots: list[int]) -> None:
        conn = self._conn()

        def attempt(wait_ms: int) -> bool | None:
            r = conn.request(
                ops.WAIT, key=self.key, version=self.version, slots=slots, wait_ms=wait_ms
            )
            if not r["done"]:
                return None
            self._committed = r["committed"]
            self._written.update(r["written"])
            return True

        until(
            self._deadline,
            conn.timeout,
            attempt,
            lambda: WaitExpiredError(
                f"version {self.version} of key {self.key!r} was not completely written within "
                f"{self._wait:g} s"
            ),
        )
