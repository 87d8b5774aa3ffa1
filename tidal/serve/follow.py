"""Serve the policy an RL run is training: follow a key of a tidal store.

`StoreFollower` is a `Generator.swap_hook`. Between decode steps (at the engine's host
checks, at most every `every` seconds) it asks the store for the key's newest version and,
when it is newer than the one loaded, reads it into the model's parameters in place
(`Generator.load_from_store`). Rows in flight go on with the new weights, and every token is
stamped with the version that produced it: a response's `policy_versions` (the token-id
extension) tells an external agent's trainer which policy sampled each token, as the RL
generators' own samples do. A check that fails (the store gone) is printed and the weights
held serve on; the next check tries again.

    tidal serve --config NAME --store tcp://host:port --store-key policy
"""

from __future__ import annotations

import sys
import time
from typing import Any

from tidal.generate import Generator


class StoreFollower:
    """Loads the newest version of `key` from `store` into `generator`'s weights (see the
    module docstring). `load_first` reads the newest version now (waiting up to `timeout`
    seconds for version 0 when the key has none yet)."""

    def __init__(
        self,
        generator: Generator,
        store: Any,
        key: str,
        *,
        every: float = 1.0,
        timeout: float = 60.0,
    ):
        self.generator, self.store, self.key = generator, store, key
        self.every, self.timeout = every, timeout
        self._checked = float("-inf")
        self.errors = 0
        """Checks that failed (each printed to stderr; the weights held stay)."""

    def load_first(self) -> int:
        """Read the newest committed version (or wait for version 0); returns it."""
        return self.generator.load_from_store(self.store, self.key, timeout=self.timeout)

    def __call__(self) -> int | None:
        now = time.monotonic()
        if now - self._checked < self.every:
            return None
        self._checked = now
        try:
            return self._newer()
        except Exception as e:  # the store gone or a read failed: serve on with the weights held
            self.errors += 1
            print(f"tidal serve: following {self.key!r} failed: {e}", file=sys.stderr)
            return None

    def _newer(self) -> int | None:
        versions = self.store.versions(self.key) if self.store.exists(self.key) else []
        if not versions or (
            self.generator.version is not None and versions[-1] <= self.generator.version
        ):
            return None
        # Read in place, then leave `version` to the caller: the Generator compares what the
        # hook returns with the version it holds to mark the rows in flight.
        held = self.generator.version
        version = self.generator.load_from_store(
            self.store, self.key, version=versions[-1], timeout=self.timeout
        )
        self.generator.version = held
        return version
