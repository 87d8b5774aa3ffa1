"""Throughput, FLOPs, MFU and memory, and where metrics go (console, JSONL, TensorBoard,
Weights & Biases).

FLOPs per token follow the convention of torchtitan and the PaLM paper so numbers are
comparable: 6 x (parameters excluding the embedding table) for the matmuls of forward and
backward, plus 12 x layers x heads x head_dim x seq_len for attention scores and values
(counting the full T x T square, not the causal half).
"""

from __future__ import annotations

import importlib.util
import json
import resource
import secrets
import sys
import time
from pathlib import Path
from typing import Any

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
    """Training FLOPs per token (forward + backward) for `model` at `seq_len` (a mixture of
    experts: its active parameters, the k routed experts of each token)."""
    a = model.args
    n_params = sum(p.numel() for p in model.parameters())
    if a.moe is not None:
        n_params -= a.n_layers * a.moe.inactive_params(a.dim)
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


def has_module(name: str) -> bool:
    """Whether `name` can be imported (without importing it)."""
    if sys.modules.get(name) is not None:  # imported already, or a stand-in (tests)
        return True
    return importlib.util.find_spec(name) is not None


WANDB_MISSING = "metrics.wandb=true needs the wandb package (pip install 'tidal[wandb]')"


class WandbSink:
    """Mirrors each record's numbers to a Weights & Biases run, at the record's step.

    The wandb package is imported here, only when `metrics.wandb` is on. The run's id is kept
    in <output_dir>/wandb_id.txt: a resumed tidal run (`resume`) continues the same W&B run
    (W&B drops the re-logged steps at or before its last one, with a warning of its own).

    Args:
        output_dir: the run's folder (wandb writes its files under <output_dir>/wandb).
        init: keyword arguments of `wandb.init` (project, entity, name, config).
        resume: this tidal run resumes an earlier one in the same folder.
    """

    def __init__(self, output_dir: Path, init: dict[str, Any], *, resume: bool):
        try:
            import wandb
        except ImportError as e:
            raise ImportError(WANDB_MISSING) from e
        id_file = output_dir / "wandb_id.txt"
        if resume and id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(8)
            id_file.write_text(run_id + "\n")
        (output_dir / "wandb").mkdir(exist_ok=True)
        self.run = wandb.init(id=run_id, resume="allow", dir=str(output_dir / "wandb"), **init)

    def log(self, record: dict) -> None:
        numbers = {
            k: v
            for k, v in record.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
        }
        if numbers and "step" in record:
            self.run.log(numbers, step=record["step"])

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """Appends one JSON object per line to <output_dir>/metrics.jsonl, prints a line per
    record, and optionally mirrors scalars to TensorBoard and to Weights & Biases. Only the
    process that owns output (rank 0) should create one, and only one run at a time
    (tidal/train/run_folder.py).

    `resume_step`: this run resumes an earlier one after that step; a `{"event": "resume",
    "step": N}` record goes first, and records after it supersede earlier ones of the same
    steps. `wandb`: the keyword arguments of `wandb.init` (see WandbSink), None for no W&B."""

    def __init__(
        self,
        output_dir: str | Path,
        *,
        tensorboard: bool = False,
        stream=None,
        resume_step: int | None = None,
        wandb: dict[str, Any] | None = None,
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
        self.wandb = None
        if wandb is not None:
            self.wandb = WandbSink(self.dir, wandb, resume=resume_step is not None)

    def log(self, record: dict, line: str | None = None) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if line:
            print(line, file=self.stream, flush=True)
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float) and v is not None:
                    self.tb.add_scalar(k, v, record["step"])
        if self.wandb is not None:
            self.wandb.log(record)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()


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
