"""NUMA placement of a volume's host slots: on the node of the device or NIC that uses them.

On a machine of several NUMA nodes, memory on the far node of the GPU that copies a slot (or
of the NIC that sends it) crosses the inter-socket link on every transfer. A volume picks a
node once (:func:`volume_node`) and binds every part file it makes, slots and reserve files
alike, to it (:func:`bind_file`) before any page of it exists. On one node nothing is read
past the node list and nothing is bound.

How the node is chosen (:func:`choose_node`, from :func:`read_topology` of ``/sys``):

1. a GPU given by its PCI address (an embedded store in a process that already uses CUDA:
   its current device; a server never initializes CUDA to find out);
2. else the node most of the machine's RDMA NICs (``/sys/class/infiniband``) are on, ties
   to the lowest (what remote readers pull through);
3. else none: pages go where the allocating thread runs, the kernel's default.

A device whose ``numa_node`` is -1 (the firmware does not say) does not count.

How pages are bound: ``mbind(MPOL_PREFERRED)`` on a shared mapping of each part file (the
raw system call through ctypes, no libnuma). On tmpfs that sets the file's *shared* policy,
kept with the file, so every page of it later allocated lands on the node whichever process
or thread faults it in: the writer's ``MADV_POPULATE_READ`` in another process, the put's
``pwrite``, the pool thread's fill (checked here: a second mapping of a bound file reads
``prefer:0`` in ``/proc/self/numa_maps``). Chosen over first-touching from a thread pinned to
the node's CPUs because the first touch of a slot is not the volume's: the writer that maps
it allocates its pages. Preferred, not strict: a full node falls back to another rather than
failing the put with SIGBUS. A kernel or architecture without ``mbind`` leaves the pages
unbound (logged once).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import os
import platform
import re
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("tidal.store")

_PCI = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_NODE = re.compile(r"node(\d+)")
_SYS_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259}
_MPOL_PREFERRED = 1
_MAX_NODES = 1024


@dataclass(frozen=True)
class Topology:
    """What placement needs of ``/sys``: nodes with their CPUs, the node of each PCI device
    that says, and each RDMA NIC's node."""

    nodes: dict[int, tuple[int, ...]]  # node -> its CPUs
    pci: dict[str, int] = field(default_factory=dict)  # PCI address -> node
    rdma: dict[str, int] = field(default_factory=dict)  # RDMA device name -> node


def parse_cpulist(text: str) -> tuple[int, ...]:
    """``0-3,8,10-11`` -> (0, 1, 2, 3, 8, 10, 11); empty for a node without CPUs."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)


def _read_node(path: str) -> int | None:
    """A device's ``numa_node`` file: None if absent, unreadable or -1 (not known)."""
    try:
        with open(path) as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def read_topology(root: str = "/sys") -> Topology:
    """The machine's nodes (``devices/system/node/node*/cpulist``); on several, also the node
    of every PCI device (``bus/pci/devices/*/numa_node``) and RDMA NIC
    (``class/infiniband/*/device/numa_node``). ``root`` is a directory laid out like /sys
    (tests fake one). A machine without the node directory is one node, 0."""
    nodes: dict[int, tuple[int, ...]] = {}
    base = os.path.join(root, "devices/system/node")
    try:
        names = os.listdir(base)
    except OSError:
        names = []
    for name in names:
        m = _NODE.fullmatch(name)
        if m is None:
            continue
        try:
            with open(os.path.join(base, name, "cpulist")) as f:
                nodes[int(m[1])] = parse_cpulist(f.read())
        except (OSError, ValueError):
            nodes[int(m[1])] = ()
    if not nodes:
        return Topology({0: tuple(range(os.cpu_count() or 1))})
    if len(nodes) == 1:
        return Topology(nodes)
    pci: dict[str, int] = {}
    devices = os.path.join(root, "bus/pci/devices")
    for addr in _listdir(devices):
        node = _read_node(os.path.join(devices, addr, "numa_node"))
        if _PCI.fullmatch(addr) and node in nodes:
            pci[addr] = node
    rdma: dict[str, int] = {}
    ib = os.path.join(root, "class/infiniband")
    for name in _listdir(ib):
        node = _read_node(os.path.join(ib, name, "device/numa_node"))
        if node in nodes:
            rdma[name] = node
    return Topology(nodes, pci, rdma)


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def choose_node(topo: Topology, gpu: str | None = None) -> int | None:
    """The node a volume's slots go on (module docstring), or None: one node, or nothing
    on the machine says. ``gpu``: the PCI address (``0000:3b:00.0``) of the GPU that
    copies the slots, if known."""
    if len(topo.nodes) <= 1:
        return None
    if gpu is not None:
        node = topo.pci.get(gpu.lower())
        if node is not None:
            return node
    if topo.rdma:
        counts = collections.Counter(topo.rdma.values())
        return min(counts, key=lambda n: (-counts[n], n))
    return None


def cuda_pci_address() -> str | None:
    """The PCI address of this process's current CUDA device if CUDA is already in use here
    (never initialized for this), else None."""
    try:
        import torch

        if not torch.cuda.is_initialized():
            return None
        p: Any = torch.cuda.get_device_properties(torch.cuda.current_device())  # pci_* unstubbed
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except (ImportError, AttributeError, RuntimeError):
        return None


def volume_node(setting: int | str | None, root: str = "/sys") -> int | None:
    """The node a volume binds its files to: ``"auto"`` chooses (:func:`choose_node`, with
    this process's GPU when it uses one), an int is that node (ValueError if the machine has
    no such node), None or ``"off"`` binds nothing."""
    if setting is None or setting == "off":
        return None
    topo = read_topology(root)
    if setting == "auto":
        return choose_node(topo, cuda_pci_address())
    if isinstance(setting, bool) or not isinstance(setting, int):
        raise ValueError(f"numa must be 'auto', 'off' or a node number, got {setting!r}")
    if setting not in topo.nodes:
        raise ValueError(f"numa node {setting} does not exist here (nodes {sorted(topo.nodes)})")
    return None if len(topo.nodes) == 1 else setting


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_warned = False


def mbind(addr: int, nbytes: int, node: int) -> int:
    """``mbind(addr, nbytes, MPOL_PREFERRED, {node})``: 0, or the errno."""
    nr = _SYS_MBIND.get(platform.machine())
    if nr is None:
        return 38  # ENOSYS
    if not 0 <= node < _MAX_NODES:
        raise ValueError(f"numa node {node} is out of range")
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask = (ctypes.c_ulong * (_MAX_NODES // bits))()
    mask[node // bits] = 1 << (node % bits)
    rc = _libc.syscall(
        ctypes.c_long(nr),
        ctypes.c_void_p(addr),
        ctypes.c_size_t(nbytes),
        ctypes.c_int(_MPOL_PREFERRED),
        mask,
        ctypes.c_ulong(_MAX_NODES + 1),
        ctypes.c_uint(0),
    )
    return 0 if rc == 0 else ctypes.get_errno()


def bind_file(fd: int, nbytes: int, node: int | None) -> bool:
    """Prefer ``node`` for every page of the shared-memory file ``fd`` (``nbytes`` long)
    allocated from now on, by whichever process; pages it already has stay where they are.
    Nothing for ``node`` None; False (logged once) where the kernel refuses."""
    global _warned
    if node is None or nbytes <= 0:
        return node is None
    addr = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
    else:
        try:
            err = mbind(addr, nbytes, node)
        finally:
            _libc.munmap(addr, nbytes)
    if err and not _warned:
        _warned = True
        log.warning("cannot bind shared memory to NUMA node %d: %s", node, os.strerror(err))
    return not err
