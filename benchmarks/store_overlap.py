"""Publishing weights while training: the step time of a GPU job that puts its state dict
every step, against the same steps with no put, all in this run.

A "step" is a fixed chain of bf16 matmuls on the default stream (about `--step-ms` long, like
a trainer's forward and backward), and the state dict is Llama-3-1.5B shaped (3.0 GB bf16, on
the GPU). Each step either puts nothing (the baseline), puts with the blocking `put_state_dict`
after the compute, or calls `put_state_dict_async` at the start of the step and waits for it
at the end (an RL trainer publishing version v while it computes step v+1: the weights are not
modified until the optimizer step, after the wait). The async put runs its copies on a side
stream (tidal/store/streams.py); the script also times the same background thread copying on
the caller's stream, which queues the copies between the compute kernels.

    python benchmarks/store_overlap.py [--memory host|cuda] [--steps 10] [--step-ms 200]

Prints the mean step time of each mode and its overhead over compute alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import tidal.store


def make_sd() -> dict[str, torch.Tensor]:
    dim, ffn, vocab, layers = 2048, 8192, 128256, 16
    sd = {"tok_embeddings.weight": (vocab, dim), "output.weight": (vocab, dim)}
    for i in range(layers):
        for n, s in [
            ("attention.wq", (dim, dim)),
            ("attention.wk", (512, dim)),
            ("attention.wv", (512, dim)),
            ("attention.wo", (dim, dim)),
            ("feed_forward.w1", (ffn, dim)),
            ("feed_forward.w2", (dim, ffn)),
            ("feed_forward.w3", (ffn, dim)),
        ]:
            sd[f"layers.{i}.{n}.weight"] = s
    return {k: torch.randn(s, device="cuda", dtype=torch.bfloat16) for k, s in sd.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", default="host", choices=("host", "cuda"))
    ap.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    ap.add_argument("--step-ms", type=float, default=200.0, help="compute per step")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("store_overlap.py needs a CUDA device")

    sd = make_sd()
    gb = sum(t.numel() * t.element_size() for t in sd.values()) / 1e9
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) / 90.5

    def matmuls(n: int) -> None:
        y = x
        for _ in range(n):
            y = y @ w

    matmuls(20)  # warm-up (clocks, cuBLAS) before the calibration
    torch.cuda.synchronize()
    t = time.perf_counter()
    matmuls(50)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t) / 50
    n_mm = max(1, round(args.step_ms / 1000 / per))
    print(
        f"state dict {gb:.2f} GB bf16 on cuda, memory={args.memory}; step = {n_mm} matmuls "
        f"8192^3 (calibrated at {n_mm * per * 1000:.0f} ms)"
    )

    store = tidal.store.connect(keep=1)
    plain_thread = ThreadPoolExecutor(1)  # a background thread copying on the caller's stream
    version = 0

    def step(mode: str) -> float:
        nonlocal version
        torch.cuda.synchronize()
        t = time.perf_counter()
        fut = None
        if mode == "async put (side stream)":
            fut = store.put_state_dict_async(sd, "w", version=version, memory=args.memory)
        elif mode == "async put (caller's stream)":
            fut = plain_thread.submit(
                store.put_state_dict, sd, "w", version=version, memory=args.memory
            )
        matmuls(n_mm)
        if mode == "blocking put":
            store.put_state_dict(sd, "w", version=version, memory=args.memory)
        if fut is not None:
            fut.result()
        torch.cuda.synchronize()
        version += 1
        return time.perf_counter() - t

    modes = [
        "compute only",
        "blocking put",
        "async put (side stream)",
        "async put (caller's stream)",
    ]
    for mode in modes[1:]:  # warm: slots allocated, segments touched and registered
        step(mode)
        step(mode)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.steps):  # interleaved, so every mode sees the same machine state
        for mode in modes:
            times[mode].append(step(mode))
    store.close()
    base = statistics.mean(times["compute only"])
    print(f"\n{'mode':32s} {'step ms':>8s} {'overhead':>9s}")
    for mode in modes:
        m = statistics.mean(times[mode])
        print(f"{mode:32s} {m * 1000:8.1f} {(m - base) * 1000:7.1f} ms")
    side = statistics.mean(times["async put (side stream)"]) - base
    block = statistics.mean(times["blocking put"]) - base
    print(
        f"\nasync put hides {1 - side / block:.0%} of the blocking put's cost "
        f"({block * 1000:.1f} ms -> {side * 1000:.1f} ms per step)"
    )


if __name__ == "__main__":
    main()
