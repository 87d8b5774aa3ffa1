"""A role of `tidal rl` ends with the launcher that started it (no torch import: a role
calls it first thing, and a launcher's death must not wait for imports).

Two parts, so that no role outlives the launcher:
- the launcher (launch.py) starts each role with `start_role`: the child asks the kernel for
  SIGTERM when the launcher dies, before it execs, so torchrun (which ends its ranks on
  SIGTERM) is covered as well as a role started directly;
- the launcher puts its pid in each role's environment as TIDAL_RL_LAUNCHER, and the role's
  command line (cli.py) calls `die_with_launcher` first thing: the same request relative to
  its own parent (torchrun, for a trainer rank), and an exit at once if the launcher died
  before the child made its request.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping

LAUNCHER_ENV = "TIDAL_RL_LAUNCHER"
"""The launcher's pid, in the environment of the roles it starts."""

_PR_SET_PDEATHSIG = 1


def _ask_sigterm_on_parent_death() -> None:
    """prctl(PR_SET_PDEATHSIG, SIGTERM) for this process (Linux; elsewhere a no-op: the
    store's loss still stops a role)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def start_role(argv: list[str], env: Mapping[str, str]) -> subprocess.Popen:
    """`subprocess.Popen(argv, env=env)` whose child gets SIGTERM when this process (the
    launcher) dies; the request survives the child's exec."""
    return subprocess.Popen(argv, env=env, preexec_fn=_ask_sigterm_on_parent_death)


def die_with_launcher(environ: Mapping[str, str] | None = None) -> None:
    """In a role started by `tidal rl` (TIDAL_RL_LAUNCHER names the launcher's pid): ask the
    kernel for SIGTERM when this process's parent dies (the launcher, or torchrun's launcher,
    which ends its ranks on SIGTERM), and exit at once (status 1, saying why) when the
    launcher is already gone. A role started any other way is left as it is."""
    env = os.environ if environ is None else environ
    launcher = env.get(LAUNCHER_ENV)
    if not launcher:
        return
    _ask_sigterm_on_parent_death()
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
