"""Configs of the fault tests (tests/rl/test_faults.py), loaded by every role process as
`--config tests/rl/fault_configs.py:NAME`: `tiny`, with one role made to stall once at a
chosen point of a put so that the test can kill it there.

The point is a put of `KEY` at version `VERSION` or later (`TIDAL_TEST_STALL=KEY:VERSION`,
set by the test for the roles' processes), held just before its commit request goes out:
the bytes are written, the version is not visible. The first process to get there creates
`TIDAL_TEST_STALL_FILE` (exclusively) and stalls until it is killed; every other process goes
on. It writes its pid into the file only once its commit is held (the version declared and
its bytes written), so a test that kills it on reading the pid always kills it mid-put, never
before the put began. Without the variables the configs are `tiny` unchanged."""

from __future__ import annotations

import os
import time
from typing import Any

from tests.rl.loop_configs import tiny
from tidal.rl.config import RLConfig

STALL_S = 600.0
"""Longest stall: the test kills the process long before."""


def _claim(key: str, version: Any) -> bool:
    """Whether this put is the stall point and this process the first to reach it."""
    want = os.environ.get("TIDAL_TEST_STALL", "")
    if not want:
        return False
    want_key, _, want_version = want.rpartition(":")
    if key != want_key and not (want_key.endswith("*") and key.startswith(want_key[:-1])):
        return False
    if not isinstance(version, int) or version < int(want_version):
        return False
    try:
        fd = os.open(os.environ["TIDAL_TEST_STALL_FILE"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)  # claimed; the pid is written by the held commit (_hold_commit)
    return True


def _hold_commit(store: Any, key: str, version: int) -> None:
    """Make `store`'s next commit of `key` wait (until this process is killed), saying so in
    the stall file: "<pid> <key> <version>\n"."""
    from tidal.store import ops, testing

    def hook(connection: str, op: Any, fields: dict[str, Any]) -> None:
        if op is ops.PUT_COMMIT and fields.get("key") == key:
            with open(os.environ["TIDAL_TEST_STALL_FILE"], "w") as f:
                f.write(f"{os.getpid()} {key} {version}\n")
            deadline = time.monotonic() + STALL_S
            while time.monotonic() < deadline:
                time.sleep(0.1)  # stalled on purpose: the test kills this process

    testing.on_request(store, hook)


def stall(out: str = "outputs/rl_test") -> RLConfig:
    """`tiny`, with the stall point of TIDAL_TEST_STALL armed in every role process."""
    import tidal.store.client

    Store = tidal.store.client.Store
    real_put, real_async = Store.put_state_dict, Store.put_state_dict_async

    def put_state_dict(self, state_dict, key, **kwargs):
        if _claim(key, kwargs.get("version")):
            _hold_commit(self, key, kwargs["version"])
        return real_put(self, state_dict, key, **kwargs)

    def put_state_dict_async(self, state_dict, key, **kwargs):
        if _claim(key, kwargs.get("version")):
            _hold_commit(self, key, kwargs["version"])
        return real_async(self, state_dict, key, **kwargs)

    Store.put_state_dict = put_state_dict  # type: ignore[method-assign]
    Store.put_state_dict_async = put_state_dict_async  # type: ignore[method-assign]
    return tiny(out)
