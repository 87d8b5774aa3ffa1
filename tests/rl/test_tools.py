"""The `python` sandbox against hostile programs, and the `calc` tool.

Each hostile run is bounded by its own limits (seconds at most); after each, the test checks
that the calling process goes on, the run's process group (and, as root, its throwaway uid)
has no live process, and its temporary directory is gone.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tidal.rl.tools import (
    SandboxConfig,
    calc,
    calc_tool,
    make_tool,
    probe_isolation,
    python_tool,
    run_python,
)
from tidal.rl.tools.sandbox import THROWAWAY_UID_BASE

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the sandbox's guarantees are Linux ones"
)

FAST = SandboxConfig(wall_seconds=20.0, cpu_seconds=1, memory_bytes=256 << 20, processes=16)


@pytest.fixture(scope="module")
def isolation():
    return probe_isolation()


def _live(pgid: int, uid: int) -> list[int]:
    """Live (not zombie) processes in the group `pgid` or, for a throwaway uid, with `uid`."""
    live = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            owner = os.stat(f"/proc/{name}").st_uid
        except OSError:
            continue
        if fields[0] == b"Z":
            continue
        if int(fields[2]) == pgid or (uid >= THROWAWAY_UID_BASE and owner == uid):
            live.append(int(name))
    return live


def _check_clean(r):
    assert r.pgid > 0
    assert r.stray_processes == 0
    assert _live(r.pgid, r.isolation.uid) == []
    assert r.workdir and not os.path.exists(r.workdir)


# -- normal programs -------------------------------------------------------------------------


def test_prints_and_isolation(isolation):
    r = run_python("import os\nprint(sum(range(10)))\nprint(sorted(os.environ))")
    assert r.ok and r.limit is None and r.exit_code == 0
    assert r.stdout.splitlines() == ["45", "['HOME', 'LC_ALL', 'TMPDIR']"]
    assert r.tool_text() == r.stdout.rstrip("\n")
    if os.geteuid() == 0:
        assert r.isolation.uid >= THROWAWAY_UID_BASE
    _check_clean(r)


def test_exception_gives_traceback():
    r = run_python("def f():\n    return 1 / 0\nprint('before')\nf()")
    assert r.limit is None and r.exit_code == 1
    text = r.tool_text()
    assert text.startswith("before\nTraceback (most recent call last):")
    assert "ZeroDivisionError: division by zero" in text and "(exit status 1)" in text
    _check_clean(r)


def test_syntax_error():
    r = run_python("def f(:\n    pass")
    assert r.limit is None and r.exit_code == 1
    assert "SyntaxError" in r.stderr
    _check_clean(r)


def test_writes_inside_its_directory_and_stdin_is_empty():
    code = (
        "import sys, tempfile\n"
        "open('a.txt', 'w').write('hi')\n"
        "with tempfile.NamedTemporaryFile('w') as f: f.write('x')\n"
        "print(open('a.txt').read(), repr(sys.stdin.read()))"
    )
    r = run_python(code)
    assert r.ok, r.stderr
    assert r.stdout == "hi ''\n"
    _check_clean(r)


def test_code_too_long_is_not_run():
    r = run_python("x = 1\n" * 100, SandboxConfig(code_bytes=100))
    assert r.limit == "code_size" and r.exit_code is None
    assert r.error() == "Tool error: the code is longer than 100 bytes"


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="wall_seconds"):
        SandboxConfig(wall_seconds=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        SandboxConfig(memory_bytes=1 << 20)


# -- hostile programs ------------------------------------------------------------------------


def test_infinite_loop_hits_cpu_limit():
    r = run_python("while True:\n    pass", FAST)
    assert r.limit == "cpu_time", (r.limit, r.exit_code, r.cpu_seconds)
    assert r.error() == "Tool error: the program used more than 1s of CPU time and was killed"
    assert r.elapsed < FAST.wall_seconds
    _check_clean(r)


def test_sleeper_hits_wall_limit():
    cfg = SandboxConfig(wall_seconds=1.0)
    r = run_python("import time\nprint('start', flush=True)\ntime.sleep(60)", cfg)
    assert r.limit == "wall_time"
    assert 1.0 <= r.elapsed < 4.0
    assert r.stdout == "start\n"  # what came before the kill is kept
    assert r.tool_text().startswith("Tool error: the program ran past the 1.0s wall-clock")
    _check_clean(r)


def test_fork_bomb(isolation):
    r = run_python("import os\nwhile True:\n    os.fork()", FAST)
    assert r.limit in ("processes", "cpu_time", "wall_time"), (r.limit, r.stderr[-300:])
    if isolation.pids:  # every fork past the limit fails, then pid 1 fails and all die
        assert r.limit == "processes"
    assert r.elapsed < FAST.wall_seconds + 3
    _check_clean(r)


def test_escaped_daemons_are_killed(isolation):
    # Children that leave the process group (setsid) and outlive the program.
    code = (
        "import os, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "print('parent done')"
    )
    r = run_python(code, SandboxConfig(wall_seconds=2.0))
    if not (isolation.pids or os.geteuid() == 0):
        pytest.skip("without a pid namespace or a throwaway uid, setsid escapes the sandbox")
    assert r.stdout == "parent done\n"
    assert r.elapsed < 4.0
    _check_clean(r)


def test_ten_gigabyte_allocation():
    r = run_python("x = bytearray(10 * 1024**3)\nprint('allocated')", FAST)
    assert r.limit == "memory"
    assert r.stdout == "" and "MemoryError" in r.stderr
    assert r.error() == "Tool error: the program ran out of memory (limit 256 MiB)"
    assert r.elapsed < 5.0
    _check_clean(r)


def test_write_outside_the_directory(isolation):
    target = Path(tempfile.gettempdir()) / f"tidal-sandbox-escape-{os.getpid()}"
    code = f"open({str(target)!r}, 'w').write('escaped')"
    r = run_python(code, FAST)
    assert not target.exists()
    if not (isolation.read_only_root or os.geteuid() == 0):
        pytest.skip("no mount namespace and not root: only the user's permissions hold")
    if isolation.read_only_root:
        assert r.limit == "filesystem" and "Read-only file system" in r.stderr
    assert r.exit_code == 1
    _check_clean(r)


def test_host_sockets_and_files_are_out_of_sight(isolation):
    """A world-writable unix socket on the host (a docker.sock, an agent) is not reachable:
    the minimal root shows only system dirs, the interpreter and the work dir."""
    if not isolation.minimal_root:
        pytest.skip(f"no mount namespace here: {isolation.notes}")
    host = tempfile.mkdtemp(prefix="tidal-sandbox-test-")
    path = os.path.join(host, "agent.sock")
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(path)
        listener.listen()
        listener.setblocking(False)
        os.chmod(host, 0o755)
        os.chmod(path, 0o777)
        code = (
            "import ctypes, json, os, socket\n"
            "before = [os.listdir('/'), os.listdir('/tmp'), os.listdir('/.oldroot')]\n"
            # the classic chroot escape, with CAP_SYS_CHROOT from a nested user namespace
            "libc = ctypes.CDLL(None)\n"
            "if libc.unshare(0x10000000) == 0:\n"
            "    os.mkdir('jail'); libc.chroot(b'jail')\n"
            "    for _ in range(20): os.chdir('..')\n"
            "    libc.chroot(b'.')\n"
            "print(json.dumps(before + [sorted(os.listdir('/'))]))\n"
            f"socket.socket(socket.AF_UNIX).connect({path!r})"
        )
        r = run_python(code, FAST)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing connected
    finally:
        listener.close()
        shutil.rmtree(host)
    assert "FileNotFoundError" in r.stderr
    shown, tmp, old_root, after_escape = json.loads(r.stdout)
    assert sorted(shown) == after_escape and old_root == []
    system = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr"}
    system.add(".oldroot")  # where the host's root was, detached
    # and the first directory of the interpreter's prefix when it is not a system one
    prefix_top = os.path.realpath(sys.base_prefix).split("/")[1]
    assert set(shown) <= system | {prefix_top}, shown
    assert tmp == [os.path.basename(r.workdir)]
    _check_clean(r)


def test_big_file_hits_file_size_limit():
    cfg = SandboxConfig(file_bytes=1 << 20, wall_seconds=10.0)
    r = run_python("open('big', 'wb').write(b'x' * (4 << 20))", cfg)
    assert r.limit == "file_size", r.stderr[-300:]
    _check_clean(r)


def test_socket_has_no_network(isolation):
    if not isolation.network:
        pytest.skip(f"no network namespace here: {isolation.notes}")
    code = "import socket\ns = socket.socket()\ns.settimeout(5)\ns.connect(('1.1.1.1', 80))"
    r = run_python(code, FAST)
    assert r.limit == "network", r.stderr[-300:]
    assert "Network is unreachable" in r.stderr
    assert r.elapsed < 5.0
    _check_clean(r)


def test_print_100_megabytes():
    cfg = SandboxConfig(output_bytes=1 << 20, wall_seconds=20.0)
    start = time.monotonic()
    r = run_python("import sys\nsys.stdout.write('x' * 100_000_000)", cfg)
    assert r.limit == "output"
    assert len(r.stdout) + len(r.stderr) == 1 << 20
    assert time.monotonic() - start < 10.0
    text = r.tool_text(max_chars=200)
    assert text.startswith("Tool error: the program printed more than 1048576 bytes")
    assert len(text) < 300
    _check_clean(r)


def test_network_isolation_required_refuses_without_it(isolation):
    r = run_python("print('ran')", SandboxConfig(require_network_isolation=True))
    if isolation.network:
        assert r.ok and r.stdout == "ran\n"
    else:
        assert r.limit == "sandbox" and r.stdout == ""


_NON_ROOT_SCRIPT = """
import json, sys, warnings
sys.path.insert(0, sys.argv[1])
from tidal.rl.tools.sandbox import run_python, SandboxConfig
cfg = SandboxConfig(wall_seconds=20.0, cpu_seconds=1, processes=16)
daemon = "import os, time\\nif os.fork() == 0:\\n    os.setsid(); time.sleep(60)\\nprint(1)"
codes = {
    "print": "print(42)",
    "fork_bomb": "import os\\nwhile True: os.fork()",
    "socket": "import socket; socket.socket().connect(('1.1.1.1', 80))",
    "write": f"open({sys.argv[2]!r}, 'w')",
    "alloc": "x = bytearray(10 << 30)",
    "daemon": daemon,
}
for name, code in codes.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = run_python(code, cfg)
    print(json.dumps([name, r.limit, r.exit_code, r.stray_processes, r.elapsed < 5,
                      r.isolation.user_namespace, r.isolation.network, len(caught)]))
"""

# Run as root: a user namespace mapping uids 0..65535 to themselves, with user namespaces
# then switched off inside it, and the script run as uid 65534 there: a non-root user on a
# machine without user namespaces.
_WITHOUT_USERNS = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
r, w = os.pipe(); r2, w2 = os.pipe()
pid = os.fork()
if pid == 0:
    assert libc.unshare(0x10000000) == 0, ctypes.get_errno()
    os.write(w, b"x"); os.read(r2, 1)
    os.setresgid(0, 0, 0); os.setresuid(0, 0, 0)
    open("/proc/sys/user/max_user_namespaces", "w").write("0")
    os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
    os.execve(sys.argv[1], sys.argv[1:], {})
os.read(r, 1)
for name in ("uid_map", "gid_map"):
    open(f"/proc/{pid}/{name}", "w").write("0 0 65536")
os.write(w2, b"x")
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _run_as_nobody(tmp_path: Path, without_userns: bool) -> dict[str, list]:
    python = _world_runnable_python()
    if python is None:
        pytest.skip("no interpreter that an unprivileged uid can run")
    pkg = tmp_path / "pkg" / "tidal" / "rl" / "tools"
    pkg.mkdir(parents=True)
    for parent in (pkg.parent.parent, pkg.parent, pkg):
        (parent / "__init__.py").write_text("")
    src = Path(__file__).parents[2] / "tidal" / "rl" / "tools"
    for name in ("_launcher.py", "sandbox.py"):
        shutil.copy(src / name, pkg / name)
    (tmp_path / "pkg" / "run.py").write_text(_NON_ROOT_SCRIPT)
    for p in [tmp_path, *tmp_path.parents]:
        if p == Path("/"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o005)  # pytest's tmp dirs are 0700
    for p in [tmp_path / "pkg", *(tmp_path / "pkg").rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    target = Path(tempfile.gettempdir()) / f"tidal-sandbox-escape-{os.getpid()}-{without_userns}"
    argv = [python, "-I", str(tmp_path / "pkg" / "run.py"), str(tmp_path / "pkg"), str(target)]
    if without_userns:
        argv = [sys.executable, "-I", "-c", _WITHOUT_USERNS, *argv]
        ids = {}
    else:
        ids = {"user": 65534, "group": 65534, "extra_groups": []}
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, env={}, cwd="/", timeout=60, **ids
        )
        escaped = target.exists()
    finally:
        target.unlink(missing_ok=True)
    assert out.returncode == 0, out.stderr
    rows = {row[0]: row[1:] for row in map(json.loads, out.stdout.splitlines())}
    rows["escaped"] = [escaped]
    return rows


# Each row: limit, exit code, stray processes, elapsed < 5 s, user namespace, network
# namespace, warnings.
@pytest.mark.skipif(os.geteuid() != 0, reason="switches to an unprivileged uid (needs root)")
def test_as_non_root_user(tmp_path):
    """The same guarantees as a plain user: through a user namespace, not a throwaway uid."""
    if not _userns_available():
        pytest.skip("user namespaces are off here")
    rows = _run_as_nobody(tmp_path, without_userns=False)
    assert rows == {
        "print": [None, 0, 0, True, True, True, 0],
        "fork_bomb": ["processes", 1, 0, True, True, True, 0],
        "socket": ["network", 1, 0, True, True, True, 0],
        "write": ["filesystem", 1, 0, True, True, True, 0],
        "alloc": ["memory", 1, 0, True, True, True, 0],
        "daemon": [None, 0, 0, True, True, True, 0],
        "escaped": [False],
    }


@pytest.mark.skipif(os.geteuid() != 0, reason="switches to an unprivileged uid (needs root)")
def test_non_root_without_user_namespaces_falls_back(tmp_path):
    """No namespaces at all: rlimits, the output cap and the kill still hold, with a warning."""
    rows = _run_as_nobody(tmp_path, without_userns=True)
    for name in ("print", "fork_bomb", "alloc", "daemon"):
        assert rows[name][2:] == [0, True, False, False, 1], (name, rows[name])
    assert rows["print"][:2] == [None, 0]
    assert rows["fork_bomb"][:2] == ["processes", 1]
    assert rows["alloc"][:2] == ["memory", 1]
    assert rows["daemon"][:2] == [None, 0]  # the setsid child holding the pipe is killed
    assert rows["write"][0] is None  # /tmp is world-writable: only permissions hold here
    assert rows["escaped"] == [True]


def _world_runnable_python() -> str | None:
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(candidate)
        parts = Path(real).parents
        if os.path.exists(real) and all(os.stat(p).st_mode & 0o001 for p in parts):
            return real
    return None


def _userns_available() -> bool:
    try:
        return int(Path("/proc/sys/user/max_user_namespaces").read_text()) > 0
    except OSError:
        return False


# -- tool wrappers ---------------------------------------------------------------------------


def test_python_tool_schema_and_errors():
    tool = python_tool(SandboxConfig(wall_seconds=10.0))
    spec = tool.spec()
    assert spec["function"]["name"] == "python"
    assert spec["function"]["parameters"]["required"] == ["code"]
    assert tool({"code": "print(6 * 7)"}) == "42"
    assert tool({"source": "print(1)"}) == 'Tool error: python needs a string argument "code"'
    assert tool({"code": 3}) == 'Tool error: python needs a string argument "code"'
    assert tool({"code": "1", "x": 2}).startswith("Tool error: python takes only 'code'")
    assert tool(["print(1)"]) == "Tool error: python takes a JSON object of arguments"  # type: ignore[arg-type]


def test_make_tool():
    assert make_tool("calc")({"expression": "2 ** 10"}) == "1024"
    with pytest.raises(KeyError, match="unknown tool 'search'.*calc"):
        make_tool("search")


# -- calc --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1 + 2 * 3", "7"),
        ("(2 + 3) * 4 / 8", "2.5"),
        ("2 / 3", "0.666666666666667"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("-7 % 3", "2"),
        ("-2 ** 2", "-4"),
        ("2 ** 3 ** 2", "512"),
        ("2 ** -2", "0.25"),
        ("0.1 + 0.2", "0.3"),
        ("(1.5 - .5) * -3", "-3"),
        ("2 ** 100", "1267650600228229401496703205376"),
        ("10 ** 30 / 3", "3.33333333333333e+29"),
        ("6 \u00d7 7", "42"),
    ],
)
def test_calc(text, expected):
    assert calc(text) == expected


@pytest.mark.parametrize(
    "text, error",
    [
        ("1 / 0", "division by zero"),
        ("5 // (2 - 2)", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9 ** 9 ** 9", "more than 4096 bits"),
        ("2 ** 10000", "more than 4096 bits"),
        ("(2 ** 4000) * (2 ** 4000)", "more than 4096 bits"),
        ("2 ** 0.5", "non-integer exponent"),
        ("__import__('os')", "unexpected character '_'"),
        ("1 +", "unexpected end of expression"),
        ("(1 + 2", "unbalanced parentheses"),
        ("2 *** 3", "unexpected '*'"),
        ("1e5", "unexpected character 'e'"),
        ("", "unexpected end of expression"),
        ("1+" * 200 + "1", "longer than 256"),
    ],
)
def test_calc_errors(text, error):
    start = time.monotonic()
    out = calc(text)
    assert out.startswith("Tool error: ") and error in out, out
    assert time.monotonic() - start < 0.1


def test_calc_tool_arguments():
    tool = calc_tool()
    assert tool({"expression": "1/4"}) == "0.25"
    assert tool({"expr": "1"}) == 'Tool error: calc needs a string argument "expression"'
    assert calc(5) == "Tool error: the expression must be a string, got int"  # type: ignore[arg-type]
