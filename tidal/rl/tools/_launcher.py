"""The sandbox's launcher: a trusted, stdlib-only script run as ``python -I -S _launcher.py``.

It never imports tidal (``-I -S``: no site-packages, no user paths, no PYTHON* variables) and
never runs model code itself. Lifecycle, all on Linux unless noted:

1. The parent (`tidal.rl.tools.sandbox.run_python`) starts it in a new session (its own process
   group), with an empty environment, cwd the private temporary directory, stdin /dev/null,
   stdout/stderr pipes, and a report pipe (fd given in the JSON config, ``argv[1]``).
2. It enters new namespaces, each tried alone so that one refusal does not cost the others:
   a user namespace first when not root (so the rest need no privilege), then network, mount
   and pid namespaces.
3. In the mount namespace it makes every mount private, builds a minimal read-only root on a
   tmpfs over the temporary directory (system dirs, the interpreter, a few devices, and the
   work dir at its own path: a size-limited tmpfs holding ``main.py``) and chroots into it.
4. It forks. The child, pid 1 of the new pid namespace, mounts a fresh /proc, drops to a
   throwaway uid/gid (``1_900_000_000 + launcher pid``) when root, sets the parent-death
   signal to SIGKILL, applies the rlimits and execs ``python -I -S main.py`` with a minimal
   environment. When pid 1 exits, the kernel kills every process left in its namespace.
5. It writes one JSON line to the report pipe saying which isolation holds, waits for the
   child, and writes a second line with its exit code or signal.

Every step that the OS refuses is recorded in the report (the parent turns it into the
result's ``isolation`` notes) instead of failing the run.
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
SYS_MOUNT_SETATTR = 442  # the same number on every Linux architecture (generic table)
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY = 0x1
PR_SET_PDEATHSIG = 1
THROWAWAY_UID_BASE = 1_900_000_000


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(libc, flags, what):
    _check(libc.unshare(ctypes.c_int(flags)), f"unshare({what})")


def _mount(libc, src, target, fstype, flags, data):
    enc = [None if s is None else s.encode() for s in (src, target, fstype, data)]
    _check(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def _set_readonly(libc, path, readonly, recursive):
    attr = _MountAttr(MOUNT_ATTR_RDONLY if readonly else 0, 0 if readonly else MOUNT_ATTR_RDONLY)
    flags = AT_RECURSIVE if recursive else 0
    ret = libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        path.encode(),
        ctypes.c_uint(flags),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(ret, f"mount_setattr {path}")


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _user_procs(uid):
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def _enter_namespaces(libc, cfg, report):
    """Returns (network, mounts, pids): which namespaces were entered."""
    uid, gid = os.getuid(), os.getgid()
    if os.geteuid() != 0:
        try:
            _unshare(libc, CLONE_NEWUSER, "user")
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
            report["user_namespace"] = True
            # Counted per user namespace: the code cannot nest another, the usual first step
            # of kernel exploits through namespaces. (Never written as root: that would be
            # the host's own limit.)
            _write("/proc/sys/user/max_user_namespaces", "0")
        except OSError as e:
            report["notes"].append(f"no user namespace ({e})")
            return False, False, False
    entered = []
    for flag, name in ((CLONE_NEWNET, "net"), (CLONE_NEWNS, "mount"), (CLONE_NEWPID, "pid")):
        try:
            _unshare(libc, flag, name)
            entered.append(True)
        except OSError as e:
            report["notes"].append(f"no {name} namespace ({e})")
            entered.append(False)
    return entered[0], entered[1], entered[2]


def _others_can_run(path):
    """Whether a uid with no rights but "others" can reach and execute `path`."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        if not os.stat(os.sep.join(parts[:i])).st_mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & 0o005 == 0o005)


SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
"""What the minimal root shows of the host, read-only (symlinks, as merged /usr has, kept)."""
DEVICES = ("null", "zero", "full", "random", "urandom")
OLD_ROOT = "/.oldroot"
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
MNT_DETACH = 2


def _bind(libc, src, root):
    """Show host path `src` at the same path under `root` (a symlink stays a symlink)."""
    dst = root + src
    os.makedirs(os.path.dirname(dst), 0o755, exist_ok=True)
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    if os.path.isdir(src):
        os.makedirs(dst, 0o755, exist_ok=True)
    else:
        os.close(os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644))
    _mount(libc, src, dst, None, MS_BIND | MS_REC, None)


def _build_root(libc, cfg, report, run_uid, run_gid):
    """In the new mount namespace: build a minimal read-only root and chroot into it.

    The root is a tmpfs mounted over the work dir. It shows SYSTEM_DIRS, the interpreter's
    prefix, a few devices, an empty /tmp, /proc (mounted by the child) and, at its own path,
    the work dir: a second tmpfs of `disk_bytes`, the only writable place. Nothing else of
    the host is visible: not /home, /root, /run, /var, /tmp, nor any unix socket in them.
    """
    work = cfg["workdir"]
    with open(os.path.join(work, "main.py"), "rb") as f:
        code = f.read()
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None)
    root = work
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    prefix = os.path.realpath(sys.base_prefix)
    shown = [d for d in SYSTEM_DIRS if os.path.lexists(d)]
    if not any(prefix == d or prefix.startswith(d + "/") for d in shown):
        shown.append(prefix)
    for d in shown:
        _bind(libc, d, root)
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            _bind(libc, f"/dev/{name}", root)
    for d in ("/proc", "/tmp", OLD_ROOT):
        os.makedirs(root + d, 0o755, exist_ok=True)
    inner = root + work
    os.makedirs(inner, 0o755, exist_ok=True)
    opts = f"size={cfg['disk_bytes']},mode=0700,uid={run_uid},gid={run_gid}"
    _mount(libc, "tmpfs", inner, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    fd = os.open(os.path.join(inner, "main.py"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, code)
    os.close(fd)
    os.chown(os.path.join(inner, "main.py"), run_uid, run_gid)
    report["tmpfs"] = report["minimal_root"] = True
    try:
        _set_readonly(libc, root, True, recursive=True)
        _set_readonly(libc, inner, False, recursive=False)
        report["read_only_root"] = True
    except OSError as e:
        _set_readonly_fallback(libc, root, inner, report, e)
    _enter_root(libc, root, report)
    os.chdir(work)


def _enter_root(libc, root, report):
    """pivot_root into `root`, the host's root left at OLD_ROOT for the child to detach once
    it has mounted /proc (which needs a visible proc mount in a user namespace). Then no
    mount of the host's root is left in the namespace at all. On an architecture whose
    syscall number is not known: chroot, which the code cannot leave either (it has no
    CAP_SYS_CHROOT, and Linux refuses a new user namespace to a chrooted process), but under
    which the host's root stays mounted in the namespace.
    """
    import platform

    number = PIVOT_ROOT.get(platform.machine())
    if number is not None:
        ret = libc.syscall(ctypes.c_long(number), root.encode(), (root + OLD_ROOT).encode())
        _check(ret, "pivot_root")
        report["pivot_root"] = True
        os.chdir("/")
        return
    report["notes"].append(
        f"pivot_root's number unknown on {platform.machine()}: chroot, the host root stays "
        "mounted (unreachable)"
    )
    os.chroot(root)


def _set_readonly_fallback(libc, root, inner, report, err):
    """Before mount_setattr (Linux < 5.12): only the root tmpfs itself becomes read-only; the
    bound system dirs keep their host flags and are guarded by file permissions."""
    try:
        _mount(libc, None, root, None, MS_REMOUNT | MS_NOSUID | MS_NODEV | MS_RDONLY, None)
    except OSError as e:
        report["notes"].append(f"minimal root not read-only ({err}; {e})")
        return
    report["notes"].append(f"bound system dirs keep their host flags ({err})")


def _limits(cfg, counted_uid):
    mem = cfg["memory_bytes"]
    cpu = cfg["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # soft == hard: the kernel sends SIGKILL at the limit. SIGXCPU (the soft signal) would be
    # ignored by pid 1 of a pid namespace, which the code is.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_bytes"], cfg["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["open_files"], cfg["open_files"]))
    nproc = cfg["processes"]
    if counted_uid is not None:  # no own uid or user namespace: the count includes the user's
        nproc += _user_procs(counted_uid)
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def _child(libc, cfg, report_fd, exe, run_uid, run_gid, pids, mounts, drop, counted_uid):
    """Set up and exec the code. The report fd is close-on-exec: open until the exec, so a
    setup failure is reported there, never mistaken for the code's own exit status."""
    try:
        if pids and mounts:
            try:
                _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
            except OSError:
                pass  # no /proc then; Python does not need one
        if os.path.isdir(OLD_ROOT) and os.listdir(OLD_ROOT):
            _check(libc.umount2(OLD_ROOT.encode(), MNT_DETACH), "umount old root")
        if drop:
            os.setgroups([])
            os.setresgid(run_gid, run_gid, run_gid)
            os.setresuid(run_uid, run_uid, run_uid)
        # After the uid change, which clears it. If the launcher died before this line, the
        # parent's killpg (same process group) reaches this process.
        _check(libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl")
        _limits(cfg, counted_uid)
        env = {"LC_ALL": "C.UTF-8", "HOME": cfg["workdir"], "TMPDIR": cfg["workdir"]}
        os.execve(exe, [exe, "-I", "-S", "main.py"], env)
    except BaseException as e:  # noqa: BLE001 - report any setup failure, never run the code
        os.write(report_fd, (json.dumps({"setup_error": repr(e)}) + "\n").encode())
    os._exit(126)


def main():
    cfg = json.loads(sys.argv[1])
    report_fd = cfg["report_fd"]
    os.set_inheritable(report_fd, False)
    os.umask(0o022)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    report = {
        "user_namespace": False,
        "network": False,
        "mounts": False,
        "pids": False,
        "tmpfs": False,
        "minimal_root": False,
        "read_only_root": False,
        "pivot_root": False,
        "uid": os.getuid(),
        "notes": [],
    }
    root = os.geteuid() == 0
    run_uid = THROWAWAY_UID_BASE + os.getpid() if root else os.getuid()
    run_gid = run_uid if root else os.getgid()
    libc = _libc() if sys.platform.startswith("linux") else None
    network = mounts = pids = False
    if libc is not None:
        network, mounts, pids = _enter_namespaces(libc, cfg, report)
    else:
        report["notes"].append(f"no namespaces on {sys.platform}")
    report.update(network=network, mounts=mounts, pids=pids)
    if cfg["require_network"] and not network:
        report["notes"].append("network isolation required but unavailable; not run")
        os.write(report_fd, (json.dumps(report) + "\n").encode())
        os._exit(125)
    if root:
        report["uid"] = run_uid
        if not mounts:
            os.chown(cfg["workdir"], run_uid, run_gid)
            os.chown(os.path.join(cfg["workdir"], "main.py"), run_uid, run_gid)
    exe = os.path.realpath(sys.executable)
    if mounts:
        try:
            _build_root(libc, cfg, report, run_uid, run_gid)
        except OSError as e:
            report["notes"].append(f"mount setup failed ({e})")
            os.write(report_fd, (json.dumps(report) + "\n").encode())
            os._exit(125)
    elif root and not _others_can_run(exe):
        report["notes"].append(
            f"{exe} is not reachable by the throwaway uid and no mount namespace can expose "
            "it; set SandboxConfig.python to a world-readable interpreter"
        )
        os.write(report_fd, (json.dumps(report) + "\n").encode())
        os._exit(125)
    counted_uid = None if (root or report["user_namespace"]) else os.getuid()
    pid = os.fork()
    if pid == 0:
        _child(libc, cfg, report_fd, exe, run_uid, run_gid, pids, mounts, root, counted_uid)
    report["child"] = pid
    os.write(report_fd, (json.dumps(report) + "\n").encode())  # after the fork: one writer
    _, status, usage = os.wait4(pid, 0)
    done = {"exit": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime}
    os.write(report_fd, (json.dumps(done) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
