"""`tidal serve` under many concurrent clients against the same requests through the Python API,
in one run.

The model: `--flavor` (default debug, ~7M parameters), seed init, fp32 on CPU or bf16 on CUDA,
no tokenizer (prompts and completions as token ids: every sample runs its full `--max-tokens`,
so both sides do the same work). The requests: `--clients` (64) clients, each sending
`--requests` (2) `/v1/completions` requests one after the other, each a random
`--prompt-len`-token prompt (64) with `--max-tokens` (64) new tokens, temperature 1, its own
seed, and `return_token_ids` (the token ids, log-probs and policy versions an RL trainer reads).

- Server: a `tidal serve` app (tidal.serve.app, the Engine batching every client's requests
  into the Generator's stream) with uvicorn, in a subprocess of this script (`--worker`), so
  that the clients do not share its interpreter; the clients are asyncio tasks over one httpx
  connection pool. Timed from the first request sent to the last response read.
- Python API: the same prompts and SamplingParams through one `Generator.generate` call on a
  Generator of the same `--max-batch`, in this process (the same weights: the same seed init).

Each side is warmed up first (a short request on every row), then timed `--rounds` times
(alternating); printed: completion tokens/s of each side's best round, and server / Python
API (target >= 0.8). `--threads` sets torch's threads in both processes.

    python benchmarks/serve.py                                  # CPU, the debug model
    python benchmarks/serve.py --device cuda --flavor llama3_1b --max-tokens 256 --max-batch 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tidal.generate import Generator, GeneratorConfig, SamplingParams  # noqa: E402
from tidal.models import Transformer, get_flavor  # noqa: E402

MODEL = "bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="debug")
    p.add_argument("--device", default="cpu")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=2, help="requests per client, in turn")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=64, help="GeneratorConfig.max_batch")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # the server subprocess: a port
    return p.parse_args(argv)


def build_generator(args: argparse.Namespace) -> Generator:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    max_seq_len = args.prompt_len + args.max_tokens
    with torch.device("meta"):
        model = Transformer(get_flavor(args.flavor, max_seq_len=max_seq_len))
    model.to_empty(device=device)
    model.init_weights(seed=0)
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    return Generator(model, config=GeneratorConfig(max_batch=args.max_batch))


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt ids, seed) of every request, client by client."""
    rng = random.Random(0)
    n = args.clients * args.requests
    return [([rng.randrange(vocab) for _ in range(args.prompt_len)], 1000 + i) for i in range(n)]


def params(args: argparse.Namespace, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=args.max_tokens, seed=seed)


def run_worker(args: argparse.Namespace) -> None:
    """The server subprocess: the app on 127.0.0.1:`--worker` until killed."""
    import uvicorn

    from tidal.serve.api import Served
    from tidal.serve.app import create_app
    from tidal.serve.engine import Engine

    served = Served(MODEL, Engine(build_generator(args)), encode=lambda text: [])
    uvicorn.run(create_app(served), host="127.0.0.1", port=args.worker, log_level="warning")


def python_api(gen: Generator, args: argparse.Namespace, work) -> tuple[float, int]:
    start = time.perf_counter()
    groups = gen.generate([p for p, _ in work], [params(args, s) for _, s in work])
    seconds = time.perf_counter() - start
    return seconds, sum(len(g[0].completion_ids) for g in groups)


async def clients(url: str, args: argparse.Namespace, work) -> tuple[float, int]:
    import httpx

    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as http:

        async def client(k: int) -> int:
            tokens = 0
            for prompt, seed in work[k * args.requests : (k + 1) * args.requests]:
                body = {
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                    "temperature": 1.0,
                    "seed": seed,
                    "return_token_ids": True,
                }
                r = await http.post("/completions", json=body)
                r.raise_for_status()
                tokens += len(r.json()["choices"][0]["token_ids"])
            return tokens

        start = time.perf_counter()
        counts = await asyncio.gather(*(client(k) for k in range(args.clients)))
        return time.perf_counter() - start, sum(counts)


def start_server(argv: list[str]) -> tuple[subprocess.Popen, str]:
    """This script as the server subprocess (the same arguments, `--worker PORT`)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, __file__, "--worker", str(port), *argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    import httpx

    deadline = time.monotonic() + 120
    while True:
        try:
            httpx.get(url + "/models", timeout=2).raise_for_status()
            return proc, url
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the server subprocess did not start") from None
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args)
        return 0
    gen = build_generator(args)
    work = workload(args, gen.vocab_size)
    warm = work[: args.max_batch]
    proc, url = start_server(argv)
    try:
        python_api(gen, args, warm)
        asyncio.run(clients(url, argparse.Namespace(**{**vars(args), "requests": 1}), warm))
        api, served = [], []
        for _ in range(args.rounds):
            api.append(python_api(gen, args, work))
            served.append(asyncio.run(clients(url, args, work)))
    finally:
        proc.terminate()
        proc.wait(30)
    api_tps = max(n / s for s, n in api)
    served_tps = max(n / s for s, n in served)
    n_req = args.clients * args.requests
    print(
        f"{args.flavor} on {args.device}, {args.clients} clients x {args.requests} requests, "
        f"prompt {args.prompt_len}, {args.max_tokens} new tokens, max_batch {args.max_batch}, "
        f"{args.threads} thread(s)"
    )
    for name, runs in (("python API", api), ("server", served)):
        rounds = ", ".join(f"{n / s:,.0f}" for s, n in runs)
        print(f"  {name:10s} best {max(n / s for s, n in runs):,.0f} tok/s (rounds: {rounds})")
    ratio = served_tps / api_tps
    print(f"  server / python API: {ratio:.3f} (target >= 0.8) over {n_req} requests")
    if args.json:
        out = {"python_api_tok_s": api_tps, "server_tok_s": served_tps, "ratio": ratio}
        Path(args.json).write_text(json.dumps(out | {"args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
