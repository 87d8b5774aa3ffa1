"""The Generator's bookkeeping of its KV-cache rows ("slots"): a request, the host view of an
occupied row, the device state of every row that decode steps update in place, and the decode
batch sizes (tidal/rl/generate.py uses them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tidal.rl.generator_types import MAX_STOP_IDS
from tidal.rl.sampling import SamplingParams


@dataclass(slots=True)
class Request:
    index: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: tuple[int, ...]


@dataclass(slots=True)
class Slot:
    """Host view of an occupied cache row."""

    request: Request
    sample_index: int
    count: int  # tokens generated if the row is still running (exact until it finishes)
    checked: int = 0  # tokens already searched for stop strings
    marks: list[tuple[int, int | None]] = field(default_factory=list)
    """(first token index, policy version) each time the weights changed under this row:
    tokens from that index on were produced by that version."""

    def versions(self, n: int) -> list[int] | None:
        """The policy version of each of the first `n` tokens (None: unversioned weights)."""
        if not self.marks or all(v is None for _, v in self.marks):
            return None
        out: list[int] = []
        for k, (_, v) in enumerate(self.marks):
            end = self.marks[k + 1][0] if k + 1 < len(self.marks) else n
            out += [-1 if v is None else v] * max(0, min(end, n) - len(out))
        return out[:n]


class Rows:
    """The device state of every slot (all [R] or [R, W]); decode steps update it in place."""

    FIELDS = ("last", "pos", "count", "done", "max_new", "temperature", "top_k", "top_p",
              "min_p", "key", "stop_ids", "out_tok", "out_lp", "out_slp")  # fmt: skip

    def __init__(self, rows: int, width: int, device: torch.device):
        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        f32 = torch.float32
        self.last, self.pos, self.count = zeros(rows), zeros(rows), zeros(rows)
        self.done = torch.ones(rows, dtype=torch.bool, device=device)
        self.max_new = zeros(rows) + 1
        self.temperature, self.top_k = zeros(rows, dtype=f32), zeros(rows)
        self.top_p, self.min_p = zeros(rows, dtype=f32) + 1, zeros(rows, dtype=f32)
        self.key = zeros(rows)
        self.stop_ids = zeros(rows, MAX_STOP_IDS) - 1
        self.out_tok = zeros(rows, width)
        self.out_lp, self.out_slp = zeros(rows, width, dtype=f32), zeros(rows, width, dtype=f32)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f) for f in self.FIELDS]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in self.tensors():
            t[dst] = t[src]


def buckets(max_batch: int) -> list[int]:
    """Decode batch sizes: powers of two below max_batch and max_batch itself, the largest 8
    (one compiled graph each, within dynamo's default recompile limit)."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if (1 << i) < max_batch]
    return [*sizes, max_batch][-8:]


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m
