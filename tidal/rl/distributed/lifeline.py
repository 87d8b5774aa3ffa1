"""A role of `tidal rl` ends with the launcher that started it (no torch import: a role
calls it first thing, and a launcher's death must not wait for imports).

The launcher (launch.py) puts its pid in each role's environment as TIDAL_RL_LAUNCHER; the
role's command line (cli.py) calls `die_with_launcher` before anything else.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping

LAUNCHER_ENV = "TIDAL_RL_LAUNCHER"
"""The launcher's pid, in the environment of the roles it starts."""

_PR_SET_PDEATHSIG = 1


def die_with_launcher(environ: Mapping[str, str] | None = None) -> None:
    """In a role started by `tidal rl` (TIDAL_RL_LAUNCHER names the launcher's pid): ask the
    kernel for SIGTERM when this process's parent dies (the launcher, or torchrun's launcher,
    which ends its ranks on SIGTERM), and exit at once (status 1, saying why) when the
    launcher is already gone. A role started any other way is left as it is."""
    env = os.environ if environ is None else environ
    launcher = env.get(LAUNCHER_ENV)
    if not launcher:
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the store's loss still stops the role
        pass
    try:
        os.kill(int(launcher), 0)  # after prctl: a launcher that died before it is seen here
    except ProcessLookupError:
        print(
            f"tidal rl: the launcher (pid {launcher}) that started this role is gone; "
            "this role stops",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)
    except (PermissionError, ValueError):  # another user's pid: it lives; a bad value: no check
        pass
