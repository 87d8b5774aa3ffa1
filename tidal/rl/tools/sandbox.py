"""Run model-written Python in a confined subprocess, never in the calling process.

`run_python(code, config)` writes the code to ``main.py`` in a fresh private temporary
directory and starts ``python -I -S _launcher.py`` there (see `_launcher.py` for the
lifecycle): the launcher enters namespaces, applies the limits and execs
``python -I -S main.py``. Nothing crosses the boundary but bytes: the code as a file, a JSON
config in argv, stdout/stderr and a JSON report on pipes. No pickle, no eval/exec here.

What each limit guarantees, on Linux (checked on kernel 6.18; needs 5.12+ for the read-only
mounts):

- Wall time (`SandboxConfig.wall_seconds`): the parent kills the launcher's process group
  and every process left in the pid namespace (pid 1 dies, the kernel kills the rest); it
  then sweeps /proc for anything left in the group or, as root, with the run's uid. Holds
  for root and non-root.
- CPU time (`cpu_seconds`): RLIMIT_CPU, SIGKILL at the limit, per process (a program that
  forks gets at most `processes` times as much; the wall limit bounds the total).
- Memory (`memory_bytes`): RLIMIT_AS, the address space of each process; an allocation past
  it fails (Python raises MemoryError). Not a cgroup: `processes` x `memory_bytes` bounds
  the total.
- Processes (`processes`): RLIMIT_NPROC. As root the code runs as a throwaway uid
  (`THROWAWAY_UID_BASE` + the launcher's pid, ``1_900_000_000 + pid``), as non-root in its
  own user namespace: both count only the run's own processes. Without either (no user
  namespaces), the limit is set to the user's current process count plus `processes`, which
  other processes of the user race.
- Output (`output_bytes`): stdout plus stderr; the parent stops reading and kills the run
  at the limit, keeping what came first.
- Files: the code runs in a minimal root built in its mount namespace (``pivot_root``, the
  host's root detached afterwards): /usr, /bin,
  /sbin, /lib*, /etc and the interpreter's prefix bound read-only, /dev/{null,zero,full,
  random,urandom}, a fresh /proc, an empty /tmp, and the work dir at its own path: a tmpfs
  of `disk_bytes`, gone with the namespace, the only writable place. The rest is made
  read-only with ``mount_setattr(AT_RECURSIVE)`` (Linux 5.12+; before it, only the root's
  own tmpfs is, and the bound dirs keep their host flags). Nothing else of the host is visible:
  not /home, /root, /run, /var or the host's /tmp, so no unix socket there either (a
  network namespace does not cover pathname sockets). RLIMIT_FSIZE caps each file. As root
  the throwaway uid adds file permissions.
- Network: a new network namespace with only a loopback interface, which is down: connect
  fails with ENETUNREACH, DNS fails. Root enters it directly; non-root through a user
  namespace (``kernel.unprivileged_userns_clone`` / ``user.max_user_namespaces``), in which
  ``max_user_namespaces`` is then set to 0: the code cannot nest one.
- Environment: the code sees only ``LC_ALL``, ``HOME`` and ``TMPDIR`` (the work dir);
  ``-I -S`` ignores PYTHON* variables, the user site and site-packages (stdlib only).
- Reads: inside the minimal root, what its uid may read of /etc, /usr and the interpreter;
  without a mount namespace, whatever its uid can read anywhere.

Where the OS refuses a step (a container without CAP_SYS_ADMIN, user namespaces disabled),
the run goes on with what holds, and `SandboxResult.isolation` says what did, and a
RuntimeWarning names what did not; `require_network_isolation=True` refuses to run instead.
Without namespaces, writes go wherever the uid may (as root's throwaway uid: world-writable
places such as /tmp), and a child that calls setsid() leaves the process group: the cleanup
still kills it by uid (root) or because it holds the run's output pipes (non-root); one
that also closes them escapes. The interpreter must live under its base prefix or a system
dir (a venv made with ``--copies`` does not): otherwise the exec fails, a "sandbox" error.
On macOS and other Unixes only the rlimits, the process group, the empty environment and
the temporary cwd hold: no network or filesystem isolation. Windows is not supported (no
``resource`` module).
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tidal.rl.tools._launcher import THROWAWAY_UID_BASE

LAUNCHER = str(Path(__file__).with_name("_launcher.py"))

Limit = Literal[
    "wall_time",
    "cpu_time",
    "memory",
    "processes",
    "output",
    "file_size",
    "disk",
    "filesystem",
    "network",
    "code_size",
    "sandbox",
]

_MESSAGES: dict[str, str] = {
    "wall_time": "the program ran past the {wall}s wall-clock limit and was killed",
    "cpu_time": "the program used more than {cpu}s of CPU time and was killed",
    "memory": "the program ran out of memory (limit {mem} MiB)",
    "processes": "the program tried to start more than {procs} processes",
    "output": "the program printed more than {out} bytes and was killed",
    "file_size": "the program wrote a file larger than {file} bytes",
    "disk": "the program filled its {disk} MiB working directory",
    "filesystem": "the program tried to write outside its working directory (read-only)",
    "network": "the program tried to use the network, which the sandbox does not have",
    "code_size": "the code is longer than {code} bytes",
    "sandbox": "the sandbox could not run the program",
}

# Last stderr line (the exception Python printed) -> the limit it means.
_STDERR_LIMITS: tuple[tuple[str, Limit], ...] = (
    ("MemoryError", "memory"),
    ("[Errno 11] Resource temporarily unavailable", "processes"),
    ("[Errno 27] File too large", "file_size"),
    ("[Errno 28] No space left on device", "disk"),
    ("[Errno 30] Read-only file system", "filesystem"),
    ("[Errno 101] Network is unreachable", "network"),
    ("socket.gaierror", "network"),
)


_DRAIN_SECONDS = 0.5
"""After the code's first process exits, how long its output pipes may stay open (held by
processes it left behind, which are then killed)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SandboxConfig:
    """Limits for one `run_python` call. Defaults suit short computations by a model."""

    wall_seconds: float = 10.0
    """Wall-clock limit; at it the whole run is killed."""
    cpu_seconds: int = 5
    """CPU-time limit of each process (RLIMIT_CPU)."""
    memory_bytes: int = 512 << 20
    """Address-space limit of each process (RLIMIT_AS)."""
    processes: int = 32
    """Most processes at once, the first included (RLIMIT_NPROC)."""
    output_bytes: int = 1 << 20
    """Most bytes of stdout plus stderr kept; more kills the run."""
    file_bytes: int = 16 << 20
    """Largest file the program may write (RLIMIT_FSIZE)."""
    disk_bytes: int = 64 << 20
    """Size of the private tmpfs working directory (where mount namespaces work)."""
    open_files: int = 64
    """Most open file descriptors of each process (RLIMIT_NOFILE)."""
    code_bytes: int = 64 << 10
    """Longest code accepted (UTF-8 bytes); longer is a tool error, not run."""
    require_network_isolation: bool = False
    """Refuse to run (a "sandbox" tool error) when no network namespace can be made."""
    python: str = sys.executable
    """The interpreter for the launcher and the code."""
    tmp_root: str | None = None
    """Where the temporary directories go (None: the system default). As root without a
    mount namespace, every directory above it must be searchable by others (the code runs
    as a throwaway uid)."""

    def __post_init__(self) -> None:
        for name in ("wall_seconds", "cpu_seconds", "memory_bytes", "processes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("output_bytes", "file_bytes", "disk_bytes", "open_files", "code_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.memory_bytes < 64 << 20:
            raise ValueError(
                f"SandboxConfig.memory_bytes must be >= 64 MiB (the interpreter's own address "
                f"space), got {self.memory_bytes}"
            )
        if self.open_files < 8:
            raise ValueError(f"SandboxConfig.open_files must be >= 8, got {self.open_files}")


@dataclass(kw_only=True, slots=True, frozen=True)
class Isolation:
    """Which confinement held for a run, as the launcher reported it."""

    network: bool = False
    """In a network namespace without interfaces."""
    pids: bool = False
    """In a pid namespace: everything dies with the first process."""
    minimal_root: bool = False
    """Chrooted into a minimal root: system dirs, the interpreter and the working directory."""
    read_only_root: bool = False
    """Everything visible but the working directory read-only."""
    tmpfs: bool = False
    """The working directory is a private size-limited tmpfs."""
    user_namespace: bool = False
    """Non-root: in a user namespace (which made the others possible)."""
    uid: int = -1
    """The uid the code ran as (as root: a throwaway uid)."""
    notes: tuple[str, ...] = ()
    """What the OS refused, and why."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SandboxResult:
    """The outcome of `run_python`."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The code's exit status; negative: killed by that signal; None: it never reported."""
    limit: Limit | None
    """The limit (or denial) that ended the run; None when it ended on its own."""
    elapsed: float
    """Wall seconds from start to cleanup."""
    cpu_seconds: float = 0.0
    """CPU time of the code's first process."""
    isolation: Isolation = field(default_factory=Isolation)
    workdir: str = ""
    """The private temporary directory (removed when `run_python` returns)."""
    pgid: int = 0
    """The run's process group (the launcher's pid)."""
    stray_processes: int = 0
    """Processes of the run still alive after cleanup (0 unless the OS would not kill them)."""
    config: SandboxConfig = field(default_factory=SandboxConfig)

    @property
    def ok(self) -> bool:
        return self.limit is None and self.exit_code == 0

    def error(self) -> str | None:
        """The tool-error sentence for a limit, or None."""
        if self.limit is None:
            return None
        c = self.config
        return "Tool error: " + _MESSAGES[self.limit].format(
            wall=c.wall_seconds,
            cpu=c.cpu_seconds,
            mem=c.memory_bytes >> 20,
            procs=c.processes,
            out=c.output_bytes,
            file=c.file_bytes,
            disk=c.disk_bytes >> 20,
            code=c.code_bytes,
        )

    def tool_text(self, max_chars: int = 4000) -> str:
        """What the model reads: the error (if a limit hit), then stdout and stderr, clipped.

        An exception in the code shows as its traceback (stderr) and the exit status.
        """
        parts = []
        if (err := self.error()) is not None:
            parts.append(err + ".")
        if self.stdout:
            parts.append(self.stdout)
        if self.stderr:
            parts.append(self.stderr)
        if self.limit is None and self.exit_code not in (0, None):
            parts.append(f"(exit status {self.exit_code})")
        text = "\n".join(p.rstrip("\n") for p in parts) if parts else "(no output)"
        if len(text) > max_chars:
            half = max_chars // 2
            text = f"{text[:half]}\n... [{len(text) - 2 * half} characters cut] ...\n{text[-half:]}"
        return text


def run_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Run `code` as a Python program under the sandbox's limits and return what happened.

    Never raises for anything the code does: limits, crashes and denials are in the result.

    Example::

        r = run_python("print(sum(range(10)))")
        r.stdout, r.limit      # ("45\\n", None)
    """
    cfg = config or SandboxConfig()
    start = time.monotonic()
    if len(code.encode("utf-8", "surrogatepass")) > cfg.code_bytes:
        return SandboxResult(
            stdout="", stderr="", exit_code=None, limit="code_size", elapsed=0.0, config=cfg
        )
    work = tempfile.mkdtemp(prefix="tidal-sandbox-", dir=cfg.tmp_root)
    try:
        return _run_in(work, code, cfg, start)
    finally:
        _remove_tree(work)


def probe_isolation(config: SandboxConfig | None = None) -> Isolation:
    """The isolation this machine gives (runs an empty program)."""
    return run_python("pass", config).isolation


def _run_in(work: str, code: str, cfg: SandboxConfig, start: float) -> SandboxResult:
    with open(os.path.join(work, "main.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(code)
    report_r, report_w = os.pipe()
    launch = {
        "report_fd": report_w,
        "workdir": work,
        "cpu_seconds": cfg.cpu_seconds,
        "memory_bytes": cfg.memory_bytes,
        "processes": cfg.processes,
        "file_bytes": cfg.file_bytes,
        "disk_bytes": cfg.disk_bytes,
        "open_files": cfg.open_files,
        "require_network": cfg.require_network_isolation,
    }
    try:
        proc = subprocess.Popen(
            [cfg.python, "-I", "-S", LAUNCHER, json.dumps(launch)],
            cwd=work,
            env={},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(report_w,),
            start_new_session=True,
        )
    finally:
        os.close(report_w)
    root = os.geteuid() == 0
    run_uid = THROWAWAY_UID_BASE + proc.pid if root else None
    out = err = report = b""
    limit: Limit | None = None
    try:
        out, err, report, limit = _collect(proc, report_r, cfg, start)
        if limit is not None:
            report = _stop_child(proc.pid, report_r, report)
    finally:
        os.close(report_r)
        assert proc.stdout is not None and proc.stderr is not None
        pipes = {os.fstat(f.fileno()).st_ino for f in (proc.stdout, proc.stderr)}
        if _parse_report(report)[0].pids:
            pipes = set()  # the pid namespace is gone with its first process: no fd scan
        stray = _kill_all(proc.pid, run_uid, pipes)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    isolation, done = _parse_report(report)
    exit_code = done.get("exit")
    cpu = float(done.get("cpu", 0.0))
    stderr = err.decode("utf-8", "replace")
    if "setup_error" in done:
        stderr += f"sandbox setup failed: {done['setup_error']}\n"
    elif exit_code is None and not done:
        stderr += "sandbox: the launcher ended without reporting the program's exit\n"
    if limit is None:
        limit = _limit_from_exit(done, cpu, stderr, cfg, isolation)
    if not isolation.network and isolation.notes:
        warnings.warn(
            "tidal sandbox: no network namespace; code can reach the network ("
            + "; ".join(isolation.notes)
            + ")",
            RuntimeWarning,
            stacklevel=3,
        )
    return SandboxResult(
        stdout=out.decode("utf-8", "replace"),
        stderr=stderr,
        exit_code=exit_code,
        limit=limit,
        elapsed=time.monotonic() - start,
        cpu_seconds=cpu,
        isolation=isolation,
        workdir=work,
        pgid=proc.pid,
        stray_processes=stray,
        config=cfg,
    )


def _collect(
    proc: subprocess.Popen[bytes], report_r: int, cfg: SandboxConfig, start: float
) -> tuple[bytes, bytes, bytes, Limit | None]:
    """Read stdout, stderr and the report until all close, a limit hits or time runs out."""
    assert proc.stdout is not None and proc.stderr is not None
    bufs = {"out": bytearray(), "err": bytearray(), "report": bytearray()}
    sel = selectors.DefaultSelector()
    for fd, name in ((proc.stdout.fileno(), "out"), (proc.stderr.fileno(), "err")):
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ, name)
    sel.register(report_r, selectors.EVENT_READ, "report")
    deadline = start + cfg.wall_seconds
    ended = False  # the launcher exited: its child did too; drain what is left, briefly
    limit: Limit | None = None
    try:
        while sel.get_map() and limit is None:
            left = deadline - time.monotonic()
            if left <= 0:
                if not ended:
                    limit = "wall_time"
                break
            for key, _ in sel.select(left):
                try:
                    data = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(key.fd)
                    if key.data == "report":
                        ended = True
                        deadline = min(deadline, time.monotonic() + _DRAIN_SECONDS)
                    continue
                name = key.data
                if name == "report":
                    bufs["report"] += data[: (1 << 16) - len(bufs["report"])]
                    continue
                room = cfg.output_bytes - len(bufs["out"]) - len(bufs["err"])
                bufs[name] += data[:room]
                if len(data) > room:
                    limit = "output"
                    break
    finally:
        sel.close()
    return bytes(bufs["out"]), bytes(bufs["err"]), bytes(bufs["report"]), limit


def _stop_child(launcher_pid: int, report_r: int, report: bytes, grace: float = 2.0) -> bytes:
    """Kill the code's first process so the launcher reaps it and reports; return the report.

    Killing the launcher first would leave that process to init (a zombie where init does not
    reap). The pid is checked through a pidfd: still the launcher's child, so not reused.
    """
    lines = report.split(b"\n")
    try:
        child = int(json.loads(lines[0])["child"]) if len(lines) > 1 else 0
    except (ValueError, KeyError):
        child = 0
    if child <= 0 or not hasattr(os, "pidfd_open"):
        return report
    try:
        fd = os.pidfd_open(child)
    except OSError:
        return report
    try:
        with open(f"/proc/{child}/stat", "rb") as f:
            ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        if ppid != launcher_pid:
            return report
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        return report
    finally:
        os.close(fd)
    buf = bytearray(report)
    deadline = time.monotonic() + grace
    with selectors.DefaultSelector() as sel:
        sel.register(report_r, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0 and sel.select(left):
            data = os.read(report_r, 1 << 16)
            if not data:
                break
            buf += data[: (1 << 16) - len(buf)]
    return bytes(buf)


def _parse_report(report: bytes) -> tuple[Isolation, dict]:
    lines = []
    for line in report.decode("utf-8", "replace").splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            break  # cut short by a kill
    first = lines[0] if lines else {}
    done: dict = {}
    for later in lines[1:]:
        done.update(later)
    isolation = Isolation(
        network=bool(first.get("network", False)),
        pids=bool(first.get("pids", False)),
        minimal_root=bool(first.get("minimal_root", False)),
        read_only_root=bool(first.get("read_only_root", False)),
        tmpfs=bool(first.get("tmpfs", False)),
        user_namespace=bool(first.get("user_namespace", False)),
        uid=int(first.get("uid", -1)),
        notes=tuple(str(n) for n in first.get("notes", ())),
    )
    return isolation, done


def _limit_from_exit(
    done: dict, cpu: float, stderr: str, cfg: SandboxConfig, iso: Isolation
) -> Limit | None:
    exit_code = done.get("exit")
    if exit_code is None or "setup_error" in done:
        return "sandbox"  # the launcher died before reporting the code's end, or failed
    # SIGKILL from RLIMIT_CPU (soft == hard). The kernel checks its own sampled clock, which
    # can run ~10% ahead of the rusage the launcher reads, hence the slack.
    if exit_code == -signal.SIGXCPU or (
        exit_code == -signal.SIGKILL and cpu >= 0.75 * cfg.cpu_seconds
    ):
        return "cpu_time"
    if exit_code == 0:
        return None
    # The exception Python printed last; several processes' tracebacks may interleave.
    lines = [line for line in stderr.splitlines() if line.strip()]
    for line in reversed(lines[-10:]):
        if line.startswith(" "):
            continue  # a traceback's frame or source line
        for needle, limit in _STDERR_LIMITS:
            if needle in line:
                return limit
        if iso.uid >= THROWAWAY_UID_BASE and line.startswith("PermissionError: [Errno 13]"):
            return "filesystem"
    return None


def _proc_table() -> list[tuple[int, int, int, str]]:
    """(pid, pgid, real uid, state) of every process, from /proc."""
    rows = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                tail = f.read().rsplit(b")", 1)[1].split()
            uid = os.stat(f"/proc/{name}").st_uid
        except (OSError, IndexError):
            continue
        rows.append((int(name), int(tail[2]), uid, tail[0].decode()))
    return rows


def _holds_pipe(pid: int, pipes: set[int]) -> bool:
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return False
    return any(link in {f"pipe:[{ino}]" for ino in pipes} for link in links)


def _kill_all(pgid: int, run_uid: int | None, pipes: set[int], grace: float = 3.0) -> int:
    """SIGKILL what is left of the run; return how many processes survive.

    The run's processes: its process group; as root, its throwaway uid; as non-root, the
    user's processes that still hold its stdout or stderr pipe (those that left the group
    with setsid). Inside a pid namespace nothing is left by now; this covers the fallbacks.
    """
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if not os.path.isdir("/proc/self"):
        return 0
    me, my_uid = os.getpid(), os.getuid()
    deadline = time.monotonic() + grace
    while True:
        live = [
            pid
            for pid, group, uid, state in _proc_table()
            if state != "Z"
            and pid != me
            and (
                group == pgid
                or uid == run_uid
                or (run_uid is None and uid == my_uid and _holds_pipe(pid, pipes))
            )
        ]
        if not live or time.monotonic() > deadline:
            return len(live)
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _remove_tree(path: str) -> None:
    """rmtree that also removes what the code made unreadable (chmod 000 directories)."""

    def fix(func: Callable[[str], object], p: str, _exc: object) -> None:
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            os.chmod(p, stat.S_IRWXU)
        except OSError:
            pass
        try:
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)
