"""One AdamW step over a model's parameters: torch's fused AdamW (fp32 moments, the
trainer's default on CUDA) against tidal's AdamWBF16States (bf16 moments), eager and compiled,
in the same run.

The parameters are the flavor's (fp32, seed init) with random gradients, split into the
trainer's two groups (matrices decay, the rest does not). Prints ms per step, the bytes of
optimizer state, and each row's ratio to the fused fp32 step.

    python benchmarks/optimizer_step.py                         # llama3_1b on the GPU
    python benchmarks/optimizer_step.py --flavor debug --device cpu --iters 3
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # the benchmarks beside it, and tidal
from sampler import time_us  # noqa: E402  (a benchmark beside this one)

from tidal.models import Transformer, get_flavor  # noqa: E402
from tidal.train.config import OptimizerConfig  # noqa: E402
from tidal.train.optim import build_optimizer, optimizer_state_bytes  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="llama3_1b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    device = torch.device(args.device)
    with torch.device("meta"):
        model = Transformer(get_flavor(args.flavor))
    model.to_empty(device=device)
    model.init_weights(seed=0)
    g = torch.Generator(device).manual_seed(1)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, device=device, generator=g) * 1e-3
    n = sum(param.numel() for param in model.parameters())
    print(f"{args.flavor}: {n / 1e9:.3f}B parameters on {device}, {args.iters} steps timed")
    rows = [
        ("torch AdamW, fp32 moments", OptimizerConfig(), {}),
        ("tidal bf16 moments, eager", OptimizerConfig(state_dtype="bf16"), {"compiled": False}),
        ("tidal bf16 moments, compiled", OptimizerConfig(state_dtype="bf16"), {"compiled": True}),
    ]
    base = None
    for name, cfg, attrs in rows:
        opt = build_optimizer(model, cfg, device)
        for key, value in attrs.items():
            setattr(opt, key, value)
        ms = time_us(opt.step, args.iters, device) / 1e3
        base = base or ms
        state = optimizer_state_bytes(opt) / 2**30
        print(f"{name:<30} {ms:8.2f} ms/step  state {state:6.2f} GiB  {ms / base:5.2f}x")
        del opt
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
