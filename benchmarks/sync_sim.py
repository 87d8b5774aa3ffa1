"""Predict a weight sync through tidal's store at cluster scale, from measured single-host figures.

No GPU and no store needed: a few lines of arithmetic per phase, calibrated on the H200
figures of benchmarks/store.md and the design notes' hardware anchors.

    python benchmarks/sync_sim.py                     # 1T FP8, 256 trainer GPUs -> 8 x TP 16
    python benchmarks/sync_sim.py --calibrate         # replay the measured single-host cases
    python benchmarks/sync_sim.py --params 235e9 --dtype-bytes 2 --trainer-gpus 64 \
        --replicas 4 --tp 8 --json out.json

The model: one steady-state sync (put plans and read plans cached, slots reused), the
trainer an FSDP job over all its GPUs (every rank holds 1/N of every tensor), each generator
replica a TP group whose GPUs want disjoint windows of the TP-sharded tensors plus all of the
replicated ones (norms, routers: `--replicated-frac`). A sync goes through five phases:

1. publish: each trainer GPU copies its shard into its store slot: a device copy into GPU
   slots (GPU-direct) or a DMA into pinned host slots over PCIe (host-staged, as built).
2. controller: `put_begin`/`put_commit` and a progress report a chunk per writer,
   `acquire`/`release` and a wait a chunk per reader, served one after another by the single
   controller process while the bytes move; nothing else, since every plan is cached (a
   steady reader receives no layout). Its busy time must fit in the sync; only a chain of
   four ops (begin, report, wait, commit) adds to it.
3. network: each generator node pulls the bytes its GPUs need across its NICs. With a
   host relay a node pulls each byte once (a window is pulled by the GPU that owns it; the
   replicated tensors, and whole replicas on one node, once per node); as built, each process
   pulls its own window over TCP.
4. relay: the bytes a GPU needs but its own NIC did not pull come from its node's peers, over
   NVLink (GPU-direct) or from the node's shared pinned memory (host-staged: part of step 5).
5. final copy: from the staging slot into the model's parameters (device copy, or H2D DMA).

Bytes stream through phases 1, 3, 4 and 5 in chunks (a reader waiting on a version copies
each slot as its writer reports it: at most 8 reports a put, tidal/store/progress.py), so
their time is that of a pipeline: (sum of stages + (chunks - 1) x the slowest) / chunks.
Per-tensor costs do not stream and add up: the measured streamed `memory="cuda"` sync
(7.9 ms against 8.64 ms unstreamed) saves little because its per-slot costs dominate, and its
replay below lands at 0.93x only when they are added after the pipeline.

The NIC figure is per GPU by default: HGX H100/H200 nodes carry one 400 Gb/s (50 GB/s) NIC per
GPU, and Perplexity's ~1.25 s bound for 1 TB into 8 replicas of 16 GPUs only holds per GPU
(1 TB / (16 x 50 GB/s)); with 50 GB/s per node it would be 10 s. `--nic-scope node` models that.

The lower bound is the bytes that must cross the slowest link over its bandwidth: every
generator node must receive the distinct bytes its GPUs need through its NICs, and the
trainer's NICs must send every generator node's copy. Assumptions, beside the calibration:
NICs deliver their rated bandwidth (not measurable on one host: Perplexity's 1.3 s against its
1.25 s bound suggests ~96%), the links of a node do not contend (NIC, PCIe and NVLink are
separate paths), the trainer publishes the dtype the generators run (FP8 quantization with
block scales is not in the store, and not modeled), and the number of tensors is a guess.
The as-built TCP figures are loopback ones (reader and volume on one host, 4 connections):
a volume process serving hundreds of remote connections may do a few times better.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from typing import Any, Literal

GB = 1e9
Path = Literal["design, GPU-direct", "design, host-staged", "as built (TCP)", "as built (NIXL)"]
PATHS: tuple[Path, ...] = (
    "design, GPU-direct",
    "design, host-staged",
    "as built (TCP)",
    "as built (NIXL)",
)

# -- calibration: tidal's own single-host figures ---------------------------------------------
# H200 host, torch 2.11.0+cu130, 2026-12-01, store v2; a Llama-3-1.5B-shaped bf16 state dict
# of 3.0 GB in 114 tensors, writer and reader in two processes (benchmarks/store.md;
# hardware rows: the design notes, ../shared/DESIGN.md "Measured anchors").
CAL_BYTES, CAL_TENSORS = 3.0e9, 114
MEMCPY_GBPS = 35.9  # store_sync.py baseline: host copy_ of the 3.0 GB into warm memory
PCIE_GBPS = 55.0  # DESIGN.md anchors: pinned host<->GPU copy, 55 GB/s each way
DEVICE_COPY_GBPS = CAL_BYTES / 1.48e-3 / GB  # store_sync.py --memory cuda: device copy 1.48 ms
CUDA_PUT_US = (4.44e-3 - 1.48e-3) / CAL_TENSORS * 1e6  # memory="cuda" put 4.44 ms: 26 us/slot
CUDA_GET_US = (4.2e-3 - 1.48e-3) / CAL_TENSORS * 1e6  # memory="cuda" get 4.2 ms: 24 us/slot
# Host slots, per tensor per put or get: the steady CPU put + copying get, 0.181 s, less two
# memcpys of the bytes, over 2 x 114 tensor copies (61 us each).
HOST_OP_US = (0.181 - 2 * CAL_BYTES / (MEMCPY_GBPS * GB)) / (2 * CAL_TENSORS) * 1e6
TCP_STREAM_GBPS = 1.07e9 / 0.364 / GB  # store_tcp.py: plain socket, 1.07 GB in 0.364 s
TCP_PROCESS_GBPS = 1.07e9 / 0.119 / GB  # store_tcp.py: the store, 4 connections, 0.119 s
# Not measured by tidal on the H200 (no multi-host run yet); used only at cluster scale.
NVLINK_GBPS = 450.0  # H200 NVLink 4, per direction (NVIDIA's figure)
# One controller op, served in turn: on the shared 2-core dev machine (2026-12-01, nice'd) an
# `exists` round trip took 21 us and a get of one 16-byte tensor (acquire, copy, release)
# 91 us; 45 us an op, half that get, is what an acquire or a commit is taken to cost.
CONTROLLER_OP_US = 45.0
NET_RTT_US = 20.0  # one round trip across the cluster network: assumed
STREAM_CHUNKS = 8  # a writer reports progress at most 8 times a put (tidal/store/progress.py)
MIN_CHUNK = 64e6  # ... and only every 64 MB
TCP_PIECE = 16 << 20  # bytes per vol_read request (tidal/store/transports/tcp.py)
TCP_CONNECTIONS = 2  # connect(connections=2): requests in flight per volume
# NIXL one-sided reads, one reader process (two lanes) from one volume process: the only
# NIXL figure measured (benchmarks/store_transports.py, 2-core VM, quiet, 2026-12-07: 0.54 GB
# in 16 tensors, 0.070 and 0.075 s in two runs, UCX over CMA on one host; no RDMA NIC there).
# Across hosts over RDMA a link is assumed to run at least this fast, up to the NIC
# (--nixl-gbps plugs in a measured figure).
NIXL_LINK_GBPS = 0.537 / 0.0727


@dataclass(frozen=True, kw_only=True)
class Case:
    """One sync: the model, the two layouts and the network."""

    params: float = 1e12
    dtype_bytes: float = 1.0
    trainer_gpus: int = 256
    replicas: int = 8
    tp: int = 16
    gpus_per_node: int = 8
    nic_gbps: float = 50.0
    nic_scope: Literal["gpu", "node"] = "gpu"
    tensors: int = 2000  # Kimi-K2-like: 61 layers x ~17 weights (fused experts) + FP8 scales
    replicated_frac: float = 0.001
    nixl_gbps: float = NIXL_LINK_GBPS  # one reader's NIXL read rate (as built (NIXL))

    def __post_init__(self) -> None:
        for name in ("params", "dtype_bytes", "nic_gbps", "nixl_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("trainer_gpus", "replicas", "tp", "gpus_per_node", "tensors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        g, tp = self.gpus_per_node, self.tp
        if tp % g and g % tp:
            raise ValueError(
                f"tp={tp} and gpus_per_node={g}: one must divide the other "
                "(a TP group fills whole nodes, or a node holds whole groups)"
            )
        if self.trainer_gpus % g and self.trainer_gpus > g:
            raise ValueError(
                f"trainer_gpus={self.trainer_gpus} is not a multiple of gpus_per_node={g}"
            )
        if not 0 <= self.replicated_frac < 1:
            raise ValueError(f"replicated_frac must be in [0, 1), got {self.replicated_frac}")
        if self.nic_scope not in ("gpu", "node"):
            raise ValueError(f"nic_scope must be 'gpu' or 'node', got {self.nic_scope!r}")

    # derived sizes, in bytes and GB/s
    @property
    def model_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def nic(self) -> float:
        """Bytes/s of one GPU's share of its node's NICs."""
        per_gpu = self.nic_gbps if self.nic_scope == "gpu" else self.nic_gbps / self.gpus_per_node
        return per_gpu * GB

    @property
    def shard(self) -> float:
        """Bytes one trainer GPU holds and publishes."""
        return self.model_bytes / self.trainer_gpus

    @property
    def window(self) -> float:
        """Bytes one generator GPU needs: its TP slice and every replicated tensor."""
        r = self.replicated_frac
        return self.model_bytes * ((1 - r) / self.tp + r)

    @property
    def gen_gpus(self) -> int:
        return self.replicas * self.tp

    @property
    def gen_nodes(self) -> int:
        return math.ceil(self.gen_gpus / self.gpus_per_node)

    @property
    def trainer_nodes(self) -> int:
        return math.ceil(self.trainer_gpus / self.gpus_per_node)

    @property
    def gen_nics(self) -> int:
        """NICs of one generator node the sync can use (a node may be only partly used)."""
        return min(self.gpus_per_node, self.gen_gpus)

    @property
    def node_distinct(self) -> float:
        """Distinct bytes the GPUs of one generator node need (what a relay pulls once)."""
        r, ranks = self.replicated_frac, min(self.gpus_per_node, self.gen_gpus, self.tp)
        return self.model_bytes * ((1 - r) * ranks / self.tp + r)


@dataclass(frozen=True)
class Prediction:
    path: str
    phases: dict[str, float]  # seconds; "total" is the sum with the byte phases pipelined
    total: float
    bound: float
    bottleneck: str

    @property
    def ratio(self) -> float:
        return self.total / self.bound


def pipeline(stages: list[float], chunks: int) -> float:
    """Seconds for bytes streamed through `stages` (each the time of all the bytes alone) in
    `chunks` equal pieces: the first piece fills the pipe, the slowest stage paces the rest."""
    stages = [s for s in stages if s > 0]
    if not stages:
        return 0.0
    return (sum(stages) + (chunks - 1) * max(stages)) / chunks


def chunks_of(nbytes: float) -> int:
    return max(1, min(STREAM_CHUNKS, int(nbytes // MIN_CHUNK)))


def tcp_gbps(connections: int) -> float:
    """One process's TCP read rate with `connections` requests in flight (loopback, H200)."""
    return min(connections * TCP_STREAM_GBPS, TCP_PROCESS_GBPS)


def lower_bound(c: Case) -> tuple[float, str]:
    """Seconds for the fewest bytes over the slowest link, and which link that is."""
    g = c.gen_nics
    receive = c.node_distinct / (g * c.nic)  # each generator node's distinct bytes, its NICs
    send = c.gen_nodes * c.node_distinct / (c.trainer_gpus * c.nic)  # every copy, trainer NICs
    if receive >= send:
        return receive, (
            f"generator NICs: each node receives {c.node_distinct / GB:.1f} GB "
            f"over {g} x {c.nic / GB:.1f} GB/s"
        )
    return send, (
        f"trainer NICs: {c.gen_nodes * c.node_distinct / GB:.0f} GB sent over "
        f"{c.trainer_gpus} x {c.nic / GB:.1f} GB/s"
    )


def predict(c: Case, path: Path) -> Prediction:
    """The predicted time of one sync of `c` along `path`, phase by phase (seconds)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    dev, pcie = DEVICE_COPY_GBPS * GB, PCIE_GBPS * GB
    bound, bottleneck = lower_bound(c)
    chunks = chunks_of(c.shard)
    # Each writer: put_begin, put_commit and a progress report a chunk; each reader: acquire,
    # release and a wait a chunk. One process serves them all, in turn, while bytes move.
    ops = (c.trainer_gpus + c.gen_gpus) * (2 + chunks)
    controller = ops * CONTROLLER_OP_US * 1e-6
    critical = 4 * (CONTROLLER_OP_US + NET_RTT_US) * 1e-6  # begin, report, wait, commit
    if path == "as built (TCP)":
        # Every process pulls its own window over TCP (no relay), from the one volume process
        # of each trainer host, which serves every reader's share of that host's shards.
        publish = c.shard / pcie
        per_conn = 1 / (1 / (TCP_STREAM_GBPS * GB) + 1 / (MEMCPY_GBPS * GB) + 1 / pcie)
        reader = min(c.nic, TCP_CONNECTIONS * per_conn, TCP_PROCESS_GBPS * GB)  # + the H2D
        receive = c.window / reader
        served = c.gen_gpus * c.window / c.trainer_nodes  # bytes each trainer host sends
        send = served / min(min(c.gpus_per_node, c.trainer_gpus) * c.nic, TCP_PROCESS_GBPS * GB)
        requests = c.window / TCP_PIECE / TCP_CONNECTIONS * NET_RTT_US * 1e-6
        network, relay, final = max(receive, send) + requests, 0.0, 0.0  # copy_ is in recv
        per_tensor = c.tensors * HOST_OP_US * 1e-6 * 2
    elif path == "as built (NIXL)":
        # Every process pulls its own window by one-sided READs from the trainer hosts' host
        # slots straight into its GPU tensors (registered VRAM: GPUDirect RDMA assumed), one
        # posted request a get (descriptors cached); the volume processes' CPUs do not serve
        # the bytes, their NICs do.
        publish = c.shard / pcie
        reader = min(c.nic, c.nixl_gbps * GB)
        receive = c.window / reader
        served = c.gen_gpus * c.window / c.trainer_nodes
        send = served / (min(c.gpus_per_node, c.trainer_gpus) * c.nic)
        network, relay, final = max(receive, send) + NET_RTT_US * 1e-6, 0.0, 0.0
        per_tensor = c.tensors * HOST_OP_US * 1e-6 * 2
    else:
        gpu = path == "design, GPU-direct"
        publish = c.shard / (dev if gpu else pcie)
        receive = c.node_distinct / (c.gen_nics * c.nic)
        send = c.gen_nodes * c.node_distinct / (c.trainer_gpus * c.nic)
        network = max(receive, send)
        from_peers = max(0.0, c.window - c.node_distinct / c.gen_nics)
        relay = from_peers / (NVLINK_GBPS * GB) if gpu else 0.0  # host: the H2D below reads it
        final = c.window / (dev if gpu else pcie)
        per_tensor = c.tensors * ((CUDA_PUT_US + CUDA_GET_US) if gpu else 2 * HOST_OP_US) * 1e-6
    streamed = pipeline([publish, network, relay, final], chunks)
    phases = {
        "publish": publish,
        "controller": controller,
        "network": network,
        "relay": relay,
        "final copy": final,
        "per-tensor": per_tensor,
    }
    total = max(streamed, controller) + critical + per_tensor
    return Prediction(path, phases, total, bound, bottleneck)


# -- the calibration replays ----------------------------------------------------------------


@dataclass(frozen=True)
class Replay:
    name: str
    predicted: float
    measured: float
    role: Literal["fit", "check"]  # fit: a parameter was derived from it; check: held out

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured


def calibrate() -> list[Replay]:
    """The measured single-host cases replayed through the same phase arithmetic."""
    b, n = CAL_BYTES, CAL_TENSORS
    memcpy, pcie, dev = b / (MEMCPY_GBPS * GB), b / (PCIE_GBPS * GB), b / (DEVICE_COPY_GBPS * GB)
    host_ops, cuda_put, cuda_get = (n * us * 1e-6 for us in (HOST_OP_US, CUDA_PUT_US, CUDA_GET_US))
    chunks = chunks_of(b)
    return [
        Replay("CPU put + copying get (0.181 s)", 2 * memcpy + 2 * host_ops, 0.181, "fit"),
        Replay("CPU put + zero-copy get (85.8 ms)", memcpy + host_ops, 85.8e-3, "check"),
        Replay("memory=cuda put (4.44 ms)", dev + cuda_put, 4.44e-3, "fit"),
        Replay("memory=cuda get (4.2 ms)", dev + cuda_get, 4.2e-3, "fit"),
        Replay(
            "memory=cuda streamed (7.9 ms)",
            pipeline([dev, dev], chunks) + cuda_put + cuda_get,
            7.9e-3,
            "check",
        ),
        Replay("GPU via host slots, put + get (114 ms)", 2 * pcie + 2 * host_ops, 114e-3, "check"),
        Replay(
            "GPU via host slots, streamed (71 ms)",
            pipeline([pcie, pcie], chunks) + 2 * host_ops,
            71e-3,
            "check",
        ),
        Replay(
            "TCP loopback, 4 connections, 1.07 GB (0.119 s)",
            1.07e9 / (tcp_gbps(4) * GB),
            0.119,
            "fit",
        ),
        Replay("resharded get FSDP 4 -> TP 2 / same layout (0.98x)", 1.0, 0.98, "check"),
    ]


# Published figures, each in its own system's setup (not this simulator's case).
ANCHORS = [
    (
        "Perplexity, Kimi-K2 1T, 256 BF16 training GPUs -> 128 FP8 inference GPUs, RDMA WRITE",
        1.3,
        "research.perplexity.ai 'Weight Transfer for RL Post-Training in under 2 seconds' "
        "(2025-09); its network bound ~1.25 s (DESIGN.md)",
    ),
    (
        "checkpoint-engine, Kimi-K2-Instruct FP8, 256 x H20, TP 16, broadcast (P2P: 16.75 s)",
        16.04,
        "github.com/MoonshotAI/checkpoint-engine releases v0.2.0",
    ),
    (
        "verl, Qwen3-235B-A22B, full NCCL broadcast (its delta sync: 11-15 s)",
        246.0,
        "246-266 s, from ../shared/DESIGN.md 'Published RL anchors'; the verl thread it came "
        "from was not found again (verl issue #7060 has the delta_sharded perf matrix)",
    ),
    (
        "verl, 72B dense, nccl engine, 8 H100 nodes, FSDP 32 -> TP 8 (delta: 12-13 s)",
        28.5,
        "28.5-29.1 s, verl-project/verl issue #7060, perf matrix of 2026-07-20",
    ),
]


# -- output -----------------------------------------------------------------------------------


def describe(c: Case) -> str:
    scope = "per GPU" if c.nic_scope == "gpu" else f"per node of {c.gpus_per_node} GPUs"
    size = f"{c.params / 1e12:g}T" if c.params >= 1e12 else f"{c.params / 1e9:g}B"
    return (
        f"{size} parameters x {c.dtype_bytes:g} B = {c.model_bytes / GB:,.0f} "
        f"GB; trainer {c.trainer_gpus} GPUs ({c.trainer_nodes} nodes, FSDP over all: "
        f"{c.shard / GB:.2f} GB each); generators {c.replicas} x TP {c.tp} = {c.gen_gpus} "
        f"GPUs ({c.gen_nodes} nodes, window {c.window / GB:.2f} GB each); NIC "
        f"{c.nic_gbps:g} GB/s {scope}; {c.tensors} tensors, {c.replicated_frac:.2%} "
        "replicated"
    )


def report(c: Case) -> dict[str, Any]:
    preds = [predict(c, p) for p in PATHS]
    bound, bottleneck = lower_bound(c)
    print(f"sync_sim: {describe(c)}")
    print(f"lower bound {bound:.3f} s: {bottleneck}")
    cols = ["publish", "controller", "network", "relay", "final copy", "per-tensor"]
    print(
        f"{'path (a prediction, s)':<22}"
        + "".join(f"{k:>11}" for k in cols)
        + f"{'total':>9}{'/ bound':>9}"
    )
    for p in preds:
        print(
            f"{p.path:<22}"
            + "".join(f"{p.phases[k]:>11.3f}" for k in cols)
            + f"{p.total:>9.3f}{p.ratio:>8.2f}x"
        )
    print("(byte phases stream through a pipeline, the controller's busy time overlaps them:")
    print(" a total is not the sum of its row)")
    for p in (preds[0], preds[2], preds[3]):
        print(
            f"{p.path}: {p.total:.2f} s = {p.total / 1.3:.2f}x Perplexity's 1.3 s, "
            f"{p.total / 16.04:.2f}x checkpoint-engine's 16.0 s"
        )
    print("published anchors, each in its own setup:")
    for name, seconds, source in ANCHORS:
        print(f"  {seconds:>7.2f} s  {name}\n             [{source}]")
    return {
        "case": dataclasses.asdict(c),
        "bound_s": bound,
        "bottleneck": bottleneck,
        "paths": [dataclasses.asdict(p) | {"ratio": p.ratio} for p in preds],
        "anchors": [{"what": a, "s": s, "source": src} for a, s, src in ANCHORS],
    }


def report_calibration() -> list[dict[str, Any]]:
    rows = calibrate()
    print("calibration: measured single-host H200 cases (docs/store.md) replayed by the model")
    print(f"{'case':<52}{'predicted':>11}{'measured':>11}{'ratio':>8}  role")
    for r in rows:
        print(f"{r.name:<52}{r.predicted:>11.4g}{r.measured:>11.4g}{r.ratio:>8.2f}  {r.role}")
    print(
        f"derived: memcpy {MEMCPY_GBPS} GB/s, PCIe {PCIE_GBPS} GB/s, device copy "
        f"{DEVICE_COPY_GBPS:,.0f} GB/s, per tensor: host op {HOST_OP_US:.0f} us, cuda put "
        f"{CUDA_PUT_US:.0f} us / get {CUDA_GET_US:.0f} us, TCP {TCP_STREAM_GBPS:.2f} GB/s a "
        f"stream, {TCP_PROCESS_GBPS:.2f} GB/s a process"
    )
    return [dataclasses.asdict(r) | {"ratio": r.ratio} for r in rows]


HELP = {
    "params": "parameter count",
    "dtype_bytes": "bytes per published parameter (1: FP8, 2: bf16)",
    "trainer_gpus": "trainer GPUs (one FSDP group over all of them)",
    "replicas": "generator replicas",
    "tp": "tensor-parallel degree of each replica",
    "gpus_per_node": "GPUs per node, on both sides",
    "nic_gbps": "NIC GB/s, per GPU or per node (--nic-scope)",
    "nic_scope": "gpu: one NIC per GPU (HGX H100/H200: 8 x 400 Gb/s a node); node: shared",
    "tensors": "tensors in the state dict (a guess for MoE models: fused expert stacks)",
    "replicated_frac": "share of the bytes every TP rank needs whole (norms, routers)",
    "nixl_gbps": "one reader's NIXL read rate, GB/s (default: measured over CMA on one host)",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in dataclasses.fields(Case):
        flag, default = "--" + f.name.replace("_", "-"), f.default
        if f.name == "nic_scope":
            ap.add_argument(flag, choices=["gpu", "node"], default=default, help=HELP[f.name])
        else:
            ap.add_argument(flag, type=type(default), default=default, help=HELP[f.name])
    ap.add_argument("--calibrate", action="store_true", help="only the calibration replays")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    out: dict[str, Any] = {}
    if not args.calibrate:
        try:
            case = Case(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Case)})
        except ValueError as e:
            print(f"sync_sim: error: {e}", file=sys.stderr)
            return 2
        out = report(case)
        print()
    out["calibration"] = report_calibration()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
