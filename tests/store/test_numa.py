"""NUMA placement of a volume's host memory (tidal/store/numa.py): the node chosen from a
topology laid out like /sys in a tmp dir, the one-node case (this machine), and the binding
itself, seen in /proc/self/numa_maps."""

import mmap
import os

import pytest
import torch

from tidal.store import numa
from tidal.store.volume import Volume, new_store_id

GPU0, GPU1, NIC = "0000:17:00.0", "0000:b3:00.0", "0000:ca:00.0"


def fake_sys(
    root,
    nodes: dict[int, str],
    pci: dict[str, int] | None = None,
    rdma: dict[str, int] | None = None,
) -> str:
    """A tmp dir laid out like /sys: nodes with their cpulists, PCI devices with their
    ``numa_node``, RDMA devices whose ``device`` links to their PCI device."""
    for n, cpus in nodes.items():
        d = root / "devices/system/node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    (root / "devices/system/node/possible").write_text("0-7\n")  # not a node directory
    for addr, node in (pci or {}).items():
        d = root / "bus/pci/devices" / addr
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    for name, node in (rdma or {}).items():
        addr = f"0000:{0xC0 + len(name):02x}:00.{node % 8}"
        d = root / "bus/pci/devices" / addr
        d.mkdir(parents=True, exist_ok=True)
        (d / "numa_node").write_text(f"{node}\n")
        ib = root / "class/infiniband" / name
        ib.mkdir(parents=True)
        (ib / "device").symlink_to(d)
    return str(root)


def test_cpulists_parse():
    assert numa.parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert numa.parse_cpulist("\n") == ()


def test_two_nodes_follow_the_gpu_then_the_rdma_nics(tmp_path):
    root = fake_sys(
        tmp_path,
        {0: "0-15,32-47", 1: "16-31,48-63"},
        pci={GPU0: 0, GPU1: 1, NIC: -1},
        rdma={"mlx5_0": 1, "mlx5_1": 1, "mlx5_2": 0},
    )
    topo = numa.read_topology(root)
    assert topo.nodes[1] == (*range(16, 32), *range(48, 64))
    assert topo.pci[GPU0] == 0 and topo.pci[GPU1] == 1
    assert NIC not in topo.pci  # -1: the firmware does not say
    assert topo.rdma == {"mlx5_0": 1, "mlx5_1": 1, "mlx5_2": 0}
    assert numa.choose_node(topo, gpu=GPU0) == 0  # the GPU that copies the slots first
    assert numa.choose_node(topo, gpu=GPU1.upper()) == 1
    assert numa.choose_node(topo, gpu=NIC) == 1  # a node not known: the NICs' majority
    assert numa.choose_node(topo) == 1


def test_nics_tied_across_nodes_take_the_lowest_and_nothing_known_binds_nothing(tmp_path):
    tied = numa.read_topology(
        fake_sys(tmp_path / "a", {0: "0-1", 1: "2-3"}, rdma={"mlx5_0": 1, "mlx5_1": 0})
    )
    assert numa.choose_node(tied) == 0
    bare = numa.read_topology(fake_sys(tmp_path / "b", {0: "0-1", 1: "2-3"}, pci={GPU0: -1}))
    assert bare.pci == {} and bare.rdma == {}
    assert numa.choose_node(bare) is None and numa.choose_node(bare, gpu=GPU0) is None


def test_one_node_is_the_degenerate_case(tmp_path):
    root = fake_sys(tmp_path, {0: "0-1"}, pci={GPU0: 0}, rdma={"mlx5_0": 0})
    topo = numa.read_topology(root)
    assert topo.nodes == {0: (0, 1)} and topo.pci == {}  # devices are not even read
    assert numa.choose_node(topo, gpu=GPU0) is None
    assert numa.volume_node("auto", root) is None and numa.volume_node(0, root) is None
    assert numa.read_topology(str(tmp_path / "none")).nodes  # no node dir: one node
    assert numa.volume_node("auto", str(tmp_path / "none")) is None


def test_this_machine(tmp_path):
    topo = numa.read_topology()
    if len(topo.nodes) == 1:  # the 2-core VM: nothing is bound
        assert numa.volume_node("auto") is None
    assert numa.volume_node("off") is None and numa.volume_node(None) is None
    with pytest.raises(ValueError, match="numa node 4096 does not exist here"):
        numa.volume_node(4096)
    with pytest.raises(ValueError, match="numa must be 'auto', 'off' or a node number"):
        numa.volume_node("near")


def test_a_forced_node_outside_the_machine_is_refused(tmp_path):
    root = fake_sys(tmp_path, {0: "0-1", 1: "2-3"})
    assert numa.volume_node(1, root) == 1
    with pytest.raises(ValueError, match=r"numa node 2 does not exist here \(nodes \[0, 1\]\)"):
        numa.volume_node(2, root)


def _policy(path: str) -> str:
    """The memory policy /proc/self/numa_maps shows for a fresh mapping of ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        with open("/proc/self/numa_maps") as f:
            lines = [line.split() for line in f if line.rstrip().endswith(f"file={path}")]
        assert lines, f"{path} is not mapped"
        return lines[0][1]
    finally:
        m.close()


def test_binding_a_file_sets_its_shared_policy():
    path = f"/dev/shm/tidal-test-numa-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 1 << 20)
        assert _policy(path) == "default"
        assert numa.bind_file(fd, 1 << 20, 0)  # node 0 exists on every machine
        assert numa.bind_file(fd, 1 << 20, None)  # nothing asked: nothing done
        os.pwrite(fd, b"x" * 4096, 0)  # a page allocated after: the file's policy holds
        assert _policy(path) == "prefer:0"
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_volume_binds_its_slots_and_reserve_to_the_chosen_node(tmp_path, monkeypatch):
    two = numa.read_topology(fake_sys(tmp_path, {0: "0", 1: "1"}, rdma={"mlx5_0": 0}))
    monkeypatch.setattr(numa, "read_topology", lambda root="/sys": two)
    vol = Volume("v0", new_store_id(), reserve=[4096])
    try:
        assert vol.numa_node == 0
        assert _policy(vol.reserve.path(1)) == "prefer:0"
        vol.create(1, 4096)  # takes the reserve file
        vol.create(2, 3 * 4096)  # a fresh file
        vol.segment(2).copy_(torch.ones(3 * 4096, dtype=torch.uint8))
        assert _policy(vol.path(1)) == "prefer:0" and _policy(vol.path(2)) == "prefer:0"
    finally:
        vol.close()
    off = Volume("v1", new_store_id(), numa_node="off")
    try:
        off.create(1, 4096)
        assert off.numa_node is None and _policy(off.path(1)) == "default"
    finally:
        off.close()


def test_the_cli_takes_a_node_auto_or_off():
    from tidal.store.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve"]).numa_node == "auto"
    assert parse(["serve", "--numa-node", "1"]).numa_node == 1
    assert parse(["volume", "--controller", "tcp://h:1", "--id", "v", "--numa-node", "off"])
    with pytest.raises(SystemExit):
        parse(["serve", "--numa-node", "near"])
