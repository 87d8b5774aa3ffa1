"""Causal attention forward + backward through each SDPA backend, at the training benchmark's
shape (llama3_1b: batch 4 x 4096, 32 query heads, 8 KV heads, head dim 64, bf16).

Each backend runs the model's call (``enable_gqa=True``, K/V with 8 heads) and the form
torchtitan's Llama uses (K/V repeated to 32 heads first, ``repeat_interleave``, which the
timing includes). Prints ms per forward + backward, the share of forward, and TFLOP/s
(causal: half of 4 * B * S^2 * H * D per forward, 2.5x that for backward).

    python benchmarks/attention_backends.py [--batch 4 --seq 4096 --iters 20]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sampler import time_us  # noqa: E402  (a benchmark beside this one)

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def run(q, k, v, gqa: str) -> torch.Tensor:
    if gqa == "repeat":
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=16, help="to print the time per training step")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_backends.py needs a CUDA GPU")
    B, S, H, G, D = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(h: int) -> torch.Tensor:
        t = torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        return t.requires_grad_()

    q, k, v = rand(H), rand(G), rand(G)
    grad = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    fwd_flop = 4 * B * S * S * H * D / 2
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}; B={B} S={S} H={H} G={G} D={D}"
    )
    print(
        f"{'backend':<10} {'K/V':<7} {'fwd+bwd ms':>10} {'fwd ms':>7} {'TFLOP/s':>8} "
        f"{'per step (x layers)':>20}"
    )
    for name, backend in BACKENDS.items():
        for gqa in ("gqa", "repeat"):
            try:
                with sdpa_kernel([backend]):
                    fwd = time_us(lambda gqa=gqa: run(q, k, v, gqa), args.iters, dev) / 1e3
                    both = (
                        time_us(lambda gqa=gqa: run(q, k, v, gqa).backward(grad), args.iters, dev)
                        / 1e3
                    )
            except RuntimeError as e:
                print(f"{name:<10} {gqa:<7} not available: {str(e).splitlines()[0][:80]}")
                continue
            q.grad = k.grad = v.grad = None
            tflops = 3.5 * fwd_flop / (both * 1e-3) / 1e12
            print(
                f"{name:<10} {gqa:<7} {both:10.2f} {fwd:7.2f} {tflops:8.0f} "
                f"{both * args.layers:17.1f} ms"
            )


if __name__ == "__main__":
    main()
