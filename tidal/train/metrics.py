"""Throughput, FLOPs, MFU and memory, and where metrics go (console, JSONL, TensorBoard).

FLOPs per token follow the convention of torchtitan and the PaLM paper so numbers are
comparable: 6 x (parameters excluding the embedding table) for the matmuls of forward and
backward, plus 12 x layers x heads x head_dim x seq_len for attention scores and values
(counting the full T x T square, not the causal half).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

from tidal.models.transformer import Transformer

# Dense bf16 peak of common accelerators, FLOP/s (vendor datasheets, no sparsity).
PEAK_BF16_FLOPS = {
    "H200": 989.5e12,
    "H100": 989.5e12,  # SXM; the PCIe part is lower (756 TFLOP/s), matched below
    "H100 PCIe": 756e12,
    "H800": 989.5e12,
    "GH200": 989.5e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A10G": 70e12,
    "L40S": 362e12,
    "L4": 121e12,
}


def peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of `device`, or None when unknown (CPU, unlisted GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):  # longest match first
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def flops_per_token(model: Transformer, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) for `model` at `seq_len`."""
    a = model.args
    n_params = sum(p.numel() for p in model.parameters())
    n_embedding = a.vocab_size * a.dim
    if a.tie_embeddings:  # the shared table still does the output matmul
        n_embedding = 0
    return 6 * (n_params - n_embedding) + 12 * a.n_layers * a.n_heads * a.k * seq_len


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory (CUDA) or peak resident set size of the process (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kib / 2**20


class MetricsLogger:
    """Appends one JSON object per line to <output_dir>/metrics.jsonl, prints a line per
    record, and optionally mirrors scalars to TensorBoard. Only the process that owns output
    (rank 0) should create one, and only one run at a time (tidal/train/run_folder.py).

    `resume_step`: this run resumes an earlier one after that step; a `{"event": "resume",
    "step": N}` record goes first, and records after it supersede earlier ones of the same
    steps."""

    def __init__(
        self,
        output_dir: str | Path,
        *,
        tensorboard: bool = False,
        stream=None,
        resume_step: int | None = None,
    ):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "metrics.jsonl"
        self.file = open(path, "a")  # noqa: SIM115 - closed in close()
        if resume_step is not None:
            if self.file.tell() > 0:
                with open(path, "rb") as f:  # a killed run may have cut its last line short
                    f.seek(-1, 2)
                    if f.read(1) != b"\n":
                        self.file.write("\n")
            self.file.write(json.dumps({"event": "resume", "step": resume_step}) + "\n")
            self.file.flush()
        self.stream = stream or sys.stdout
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "metrics.tensorboard=true needs the tensorboard package "
                    "(pip install tidal[tensorboard])"
                ) from e
            self.tb = SummaryWriter(str(self.dir / "tb"))

    def log(self, record: dict, line: str | None = None) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if line:
            print(line, file=self.stream, flush=True)
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float) and v is not None:
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


class Stopwatch:
    """Accumulates named durations between log steps."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.start = time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    def reset(self) -> float:
        """Seconds since the last reset; clears the named totals."""
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        self.totals.clear()
        return elapsed
