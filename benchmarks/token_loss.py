"""Per-token log-probs (the RL loss path) against the cross entropy and the plain form.

Times forward + backward of, on the same logits:

- baseline: `F.log_softmax(logits.float())` and a gather, the per-token log-probs written
  plainly (fp32 copies of the logits and the log-softmax live until backward);
- `cross_entropy_sum` (tidal/train/loss.py, today's training loss);
- `token_logprobs` without and with per-token entropy (the RL loss path).

Each backward gets a per-token weight (an RL loss's gradient), the CE a scalar. Prints the
median time of each, its ratio to the baseline and to the cross entropy, and the largest fp32
tensor any op of each created (counted by a dispatch mode, independent of the allocator).

    python benchmarks/token_loss.py                     # CPU: 1024 rows x 128256, bf16
    python benchmarks/token_loss.py --device cuda --rows 16384
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from tidal.train.loss import CHUNK_ROWS, cross_entropy_sum, token_logprobs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--chunk-rows", type=int, default=None, help="default: tidal's CHUNK_ROWS")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args()
    chunk = a.chunk_rows or CHUNK_ROWS
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(1, a.rows, a.vocab, device=dev, dtype=dtype, generator=g)
    labels = torch.randint(0, a.vocab, (1, a.rows), device=dev, generator=g)
    weights = torch.randn(1, a.rows, device=dev, generator=g)

    def plain(x):
        logp = F.log_softmax(x.float(), -1).gather(2, labels[..., None])[..., 0]
        (logp * weights).sum().backward()

    def ce(x):
        cross_entropy_sum(x, labels, chunk).backward()

    def per_token(x, entropy=False):
        logp, _ = token_logprobs(x, labels, entropy=entropy, chunk_rows=chunk)
        (logp * weights).sum().backward()

    cases = {
        "plain log_softmax (baseline)": plain,
        "cross_entropy_sum": ce,
        "token_logprobs": per_token,
        "token_logprobs + entropy": lambda x: per_token(x, True),
    }

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fp32 = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.fp32 = max(self.fp32, t.untyped_storage().nbytes())
            return out

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    results = {}
    for name, fn in cases.items():
        x = logits.clone().requires_grad_()
        fn(x)  # warm-up (compiles on CUDA)
        times = []
        for _ in range(a.repeats):
            x.grad = None
            sync()
            t0 = time.perf_counter()
            fn(x)
            sync()
            times.append(time.perf_counter() - t0)
        largest = Largest()
        x.grad = None
        with largest:
            fn(x)
        results[name] = {"seconds": statistics.median(times), "largest_fp32_bytes": largest.fp32}
    base = results["plain log_softmax (baseline)"]["seconds"]
    ce_s = results["cross_entropy_sum"]["seconds"]
    print(
        f"{a.rows} rows x {a.vocab} vocabulary, {a.dtype} logits, {dev}, chunks of {chunk} rows "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    print(f"{'':30s} {'ms':>9s} {'/ baseline':>11s} {'/ CE':>7s} {'largest fp32':>13s}")
    for name, r in results.items():
        r["vs_baseline"], r["vs_ce"] = r["seconds"] / base, r["seconds"] / ce_s
        print(
            f"{name:30s} {1e3 * r['seconds']:9.1f} {r['vs_baseline']:10.2f}x "
            f"{r['vs_ce']:6.2f}x {r['largest_fp32_bytes'] / 2**20:10.1f} MiB"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
