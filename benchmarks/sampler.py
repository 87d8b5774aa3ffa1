"""The decode step's sampler alone: `tidal.generate.sample` against the plain formulation.

The baseline, `plain_sample`, is how tidal sampled before: an fp32 log-softmax over the whole
vocabulary, gathered at the token, and `argmax` over each full row (once for the greedy token,
once more for the drawn one). `tidal.generate.sample` reduces each row in chunks (`row_stats`):
the token's log-prob is its logit minus the row's logsumexp. At batch 1 a compiled argmax
over a whole row is one thread block (inductor splits no arg-reduction), which the chunks
spread over the GPU.

For each `--batches` size (1 64 256), greedy and sampled (temperature 1), both samplers run
on the same bf16 logits [B, `--vocab`] (128256: llama3_1b's): on CUDA compiled as the
Generator compiles its decode step (`--tune-kernels`: with coordinate-descent tuning, and
`--tune-kernels both` runs each way) and captured in a CUDA graph, timed over `--iters`
replays; on CPU eager. Printed per configuration: microseconds per call of each, the ratio,
whether the tokens are equal and the largest log-prob difference (they must be equal, and
the difference at fp32 rounding).

    python benchmarks/sampler.py --tune-kernels both          # one GPU: the figures
    python benchmarks/sampler.py --device cpu --batches 1 8 --vocab 32000 --iters 5
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable

import torch

from tidal.generate.sampler import gumbel_noise, log_softmax, sample, truncate_logits


def plain_sample(
    logits_BV: torch.Tensor,
    *,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    min_p_B: torch.Tensor,
    keys_B: torch.Tensor,
    steps_B: torch.Tensor,
    sampled: bool = True,
    truncate: bool = True,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The baseline: `tidal.generate.sample`'s arguments and results, computed the plain way (a
    [B, V] log-softmax gathered at the token; argmax over whole rows)."""
    logits_BV = logits_BV.float()
    logp_BV = log_softmax(logits_BV, batch_invariant)
    greedy_B = logits_BV.argmax(dim=-1)
    if not sampled:
        lp_B = logp_BV.gather(1, greedy_B[:, None])[:, 0]
        return greedy_B, lp_B, torch.zeros_like(lp_B)
    is_greedy_B = temperature_B <= 0
    scaled_BV = logits_BV / torch.where(is_greedy_B, 1.0, temperature_B)[:, None]
    if truncate:
        scaled_BV = truncate_logits(scaled_BV, top_k_B, top_p_B)
    top_B1 = scaled_BV.amax(dim=-1, keepdim=True)
    scaled_BV = scaled_BV.masked_fill((scaled_BV - top_B1) < torch.log(min_p_B)[:, None], -math.inf)
    noise_BV = gumbel_noise(keys_B, steps_B, logits_BV.shape[-1])
    drawn_B = (scaled_BV + noise_BV).argmax(dim=-1)
    tokens_B = torch.where(is_greedy_B, greedy_B, drawn_B)
    sample_lp_B = log_softmax(scaled_BV, batch_invariant).gather(1, tokens_B[:, None])[:, 0]
    sample_lp_B = torch.where(is_greedy_B, 0.0, sample_lp_B)
    return tokens_B, logp_BV.gather(1, tokens_B[:, None])[:, 0], sample_lp_B


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def runner(fn: Callable, inputs: dict, sampled: bool, device: torch.device, tune: bool):
    """A no-argument call of `fn` on `inputs` writing into fixed outputs: compiled and
    replayed from a CUDA graph on CUDA, eager on CPU. Returns (call, outputs)."""
    outs = [
        torch.zeros(inputs["keys_B"].shape[0], dtype=t, device=device)
        for t in (torch.long, torch.float32, torch.float32)
    ]

    def step() -> None:
        for o, r in zip(outs, fn(**inputs, sampled=sampled, truncate=False), strict=True):
            o.copy_(r)

    if device.type != "cuda":
        return step, outs
    torch._dynamo.reset()  # every configuration compiles `step` afresh (no recompile limit)
    options = {"coordinate_descent_tuning": True} if tune else None
    compiled = torch.compile(step, dynamic=False, options=options)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            compiled()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled()
    return graph.replay, outs


def time_us(call: Callable[[], None], iters: int, device: torch.device) -> float:
    for _ in range(3):
        call()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        call()
    sync(device)
    return 1e6 * (time.perf_counter() - start) / iters


def run(batch: int, mode: str, tune: bool, args, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(batch)
    logits = torch.randn(batch, args.vocab, generator=g).to(device, torch.bfloat16)
    temperature = 0.0 if mode == "greedy" else 1.0
    inputs = dict(
        logits_BV=logits,
        temperature_B=torch.full((batch,), temperature, device=device),
        top_k_B=torch.zeros(batch, dtype=torch.long, device=device),
        top_p_B=torch.ones(batch, device=device),
        min_p_B=torch.zeros(batch, device=device),
        keys_B=torch.arange(batch, device=device) * 7919 + 1,
        steps_B=torch.full((batch,), 5, dtype=torch.long, device=device),
    )
    out: dict = {"batch": batch, "mode": mode, "tune_kernels": tune}
    results = {}
    for name, fn in [("plain", plain_sample), ("tidal", sample)]:
        call, outs = runner(fn, inputs, mode == "sampled", device, tune)
        out[f"{name}_us"] = time_us(call, args.iters, device)
        results[name] = [o.clone() for o in outs]
    (tok_p, lp_p, slp_p), (tok_t, lp_t, slp_t) = results["plain"], results["tidal"]
    out["ratio"] = out["plain_us"] / out["tidal_us"]
    out["tokens_equal"] = bool(torch.equal(tok_p, tok_t))
    out["max_logprob_diff"] = float(
        torch.maximum((lp_p - lp_t).abs().max(), (slp_p - slp_t).abs().max())
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--modes", nargs="+", default=["greedy", "sampled"])
    p.add_argument(
        "--tune-kernels",
        nargs="?",
        const="on",
        default="off",
        choices=["off", "on", "both"],
        help="coordinate-descent tuning of the compiled sampler (both: each way)",
    )
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    device = torch.device(args.device)
    tunes = {"off": [False], "on": [True], "both": [False, True]}[args.tune_kernels]
    if device.type != "cuda":
        tunes = [False]  # eager
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"sampler: vocab {args.vocab}, {where}, torch {torch.__version__}")
    rows = []
    for tune in tunes:
        for batch in args.batches:
            for mode in args.modes:
                r = run(batch, mode, tune, args, device)
                rows.append(r)
                how = "eager" if device.type != "cuda" else "tuned" if tune else "compiled"
                print(
                    f"batch {batch:>4} {mode:8s} {how:8s} plain {r['plain_us']:8.1f} us, "
                    f"tidal {r['tidal_us']:8.1f} us ({r['ratio']:.2f}x); tokens equal "
                    f"{r['tokens_equal']}, max |log-prob diff| {r['max_logprob_diff']:.2g}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
