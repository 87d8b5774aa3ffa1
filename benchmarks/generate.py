"""Generation throughput of tidal.generate.Generator against transformers `generate`, in one run.

Runs `--flavor` (default llama3_1b: dim 2048, 16 layers, vocab 128256, 1.5B parameters; seed
init, bf16 weights) on one GPU with random `--prompt-len`-token prompts (128) and
`--new-tokens` (256) new tokens per row, no stop tokens, at each `--batches` size (1 64 256),
greedy and sampled (temperature 1, `--top-p`), in the normal mode and in batch-invariant
mode. `--ragged` spreads the rows' prompt lengths (half to all of `--prompt-len`) and new
tokens (1/batch to all of `--new-tokens`), so that continuous batching moves the rows down
through every batch bucket, as in an RL step. Each configuration is warmed up by
`Generator.warm_up` (every bucket of its sampler variant; see `warm_up`), run once untimed,
then timed; a compile or capture in either call after the warm-up is reported
(`compiles_after_warmup`, and a warning): the warm-up missed it. Printed per configuration:
new tokens/s over the whole `generate` call (prefill included), the decode step time, the
warm-up's seconds and dynamo graphs (its compiles, whose cost `--compile-scope
step|blocks` sets: GeneratorConfig.compile_scope), and for CUDA
the HBM bound of a decode step (the weights read once per step, the embedding table
excepted, plus the KV cache read at the mean length) with the ratio to it. If
`transformers` is importable, its `generate` runs on a Llama model of the same shape, batch
and dtype (as shared/anchors/hf_generate.py does), and the ratio tidal / transformers is
printed. Finally the trainer-side cost of batch-invariant mode: forward + backward of
`tidal.generate.logprobs` on `--score-batch` x `--score-len` tokens, normal against
batch-invariant.

`--fuse-projections` also times each normal-mode configuration with
`GeneratorConfig.fuse_projections` (Q|K|V and W1|W3 as one product each), in the same run.
`--plain-sampler` also times each normal-mode configuration with benchmarks/sampler.py's
baseline sampler (the plain formulation tidal used before `row_stats`) patched into the
Generator, in the same run; `--profile` prints each configuration's decode-step kernels
(torch.profiler, the longest first); `--check-every` sets `GeneratorConfig.check_every`.

A configuration that raises prints its error (and traceback, on stderr) in its place and the
run goes on with the others; the JSON holds {"error": ...} there, and the exit status is 1.

    python benchmarks/generate.py --json results.json                  # one GPU
    python benchmarks/generate.py --device cpu --flavor debug --batches 1 8 \
        --prompt-len 32 --new-tokens 32 --score-len 128                # smoke test on CPU

Targets on one H200 (llama3_1b, bf16): batch 1 >= 800 new tokens/s (a step <= 1.25 ms),
batch 64 >= 25,000 new tokens/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(args, device: torch.device):
    from tidal.models import Transformer, get_flavor

    margs = get_flavor(args.flavor)
    with torch.device("meta"):
        model = Transformer(margs)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    return model.to(torch.bfloat16 if args.dtype == "bf16" else torch.float32)


def hbm_bound_ms(model, batch: int, length: float, bandwidth: float) -> tuple[float, float]:
    """(weights-only, weights + KV) milliseconds per decode step at `bandwidth` bytes/s."""
    a = model.args
    elem = next(model.parameters()).element_size()
    weights = sum(p.numel() for n, p in model.named_parameters() if n != "tok_embeddings.weight")
    if a.tie_embeddings:  # the output projection reads the (shared) table every step
        weights += a.vocab_size * a.dim
    kv = 2 * a.n_layers * batch * length * a.n_kv_heads * a.k
    return 1e3 * weights * elem / bandwidth, 1e3 * (weights + kv) * elem / bandwidth


def compiles() -> int:
    """Graphs torch.compile (dynamo) has made so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def warm_up(gen, params, prompts, call_params) -> dict:
    """`gen.warm_up` for `params`' sampler variant, then one untimed `generate(prompts,
    call_params)`. Returns the warm-up's seconds and dynamo graphs, and the compiles and CUDA
    graph captures of the call after it (0 unless the warm-up missed something: they would
    have fallen inside the timed call, or in an RL step).

    A Generator compiles and captures at the first call that needs each piece; warming up
    by calling `generate` instead needs a call per first use (its first prefill runs
    eagerly, to allocate the KV cache, so the compiled prefill is traced by the second call),
    and a call meets only the buckets its rows move through. With one warm-up call, the
    prefill's compile (tens of seconds for llama3_1b with dynamic shapes) fell inside the
    timed call: batch 1 greedy read 5 new tokens/s on an H200 while its decode steps took
    1.46 ms each."""
    device = gen.device
    graphs0, start = compiles(), time.perf_counter()
    gen.warm_up([params])
    sync(device)
    out = {"warmup_s": time.perf_counter() - start, "warmup_graphs": compiles() - graphs0}
    before = compiles() + gen.stats.graphs_captured
    gen.generate(prompts, call_params)
    sync(device)
    out["compiles_after_warmup"] = compiles() + gen.stats.graphs_captured - before
    return out


def ragged(params, prompts: list[list[int]], new_tokens: int):
    """Per row: a prompt cut to between half and all of its length, and between
    new_tokens / rows and new_tokens new tokens (continuous batching then walks down every
    bucket)."""
    import dataclasses

    n = len(prompts)
    cut = [
        p[: max(1, len(p) // 2 + (len(p) - len(p) // 2) * i // max(n - 1, 1))]
        for i, p in enumerate(prompts)
    ]
    return cut, [
        dataclasses.replace(params, max_new_tokens=max(1, new_tokens * (i + 1) // n))
        for i in range(n)
    ]


@contextlib.contextmanager
def sampler_in_generator(name: str):
    """The Generator's sampler for a run: tidal's, or ("plain") benchmarks/sampler.py's
    baseline, the formulation before `row_stats` (a [B, V] log-softmax, whole-row argmax)."""
    import tidal.generate.steps as engine  # where the decode step looks `sample` up

    if name == "tidal":
        yield
        return
    from sampler import plain_sample  # benchmarks/sampler.py, beside this file

    own = engine.sample
    engine.sample = plain_sample
    try:
        yield
    finally:
        engine.sample = own


@dataclass(frozen=True)
class Variant:
    """One tidal configuration timed at each batch size and mode."""

    name: str
    """Its key in a result row ("tidal", "plain_sampler", "fused", "batch_invariant")."""
    batch_invariant: bool = False
    """GeneratorConfig.batch_invariant."""
    sampler: str = "tidal"
    """The Generator's sampler: "tidal" (its own) or "plain" (`sampler_in_generator`)."""
    fuse: bool = False
    """GeneratorConfig.fuse_projections."""


def variants(args) -> list[Variant]:
    """The tidal configurations that `args` asks for, in the order they run."""
    runs = [Variant("tidal")]
    runs += [Variant("plain_sampler", sampler="plain")] if args.plain_sampler else []
    # After the unfused runs: fusing lays the model's weights out anew (same values).
    runs += [Variant("fused", fuse=True)] if args.fuse_projections else []
    runs += [] if args.no_batch_invariant else [Variant("batch_invariant", batch_invariant=True)]
    return runs


def run_tidal(model, args, batch: int, mode: str, variant: Variant) -> dict:
    with sampler_in_generator(variant.sampler):
        return _run_tidal(model, args, batch, mode, variant.batch_invariant, variant.fuse)


def _run_tidal(model, args, batch: int, mode: str, batch_invariant: bool, fuse: bool) -> dict:
    from tidal.generate import Generator, GeneratorConfig, SamplingParams

    device = model.rope.device
    cap = -(-(args.prompt_len + args.new_tokens) // 16) * 16
    gen = Generator(
        model,
        config=GeneratorConfig(
            max_batch=batch,
            max_seq_len=cap,
            batch_invariant=batch_invariant,
            tune_kernels=args.tune_kernels and not batch_invariant,
            # Batch-invariant mode compiles nothing: the scope would be ignored (a warning).
            compile_scope="step" if batch_invariant else args.compile_scope,
            check_every=args.check_every,
            fuse_projections=fuse,
        ),
    )
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, model.args.vocab_size, (batch, args.prompt_len), generator=g)
    params = SamplingParams(
        temperature=0.0 if mode == "greedy" else 1.0,
        top_p=1.0 if mode == "greedy" else args.top_p,
        max_new_tokens=args.new_tokens,
        stop_token_ids=(),
        seed=1,
    )
    call_prompts, call_params = prompts.tolist(), params
    if args.ragged:
        call_prompts, call_params = ragged(params, call_prompts, args.new_tokens)
    warm = warm_up(gen, params, call_prompts, call_params)
    steps0, decode0 = gen.stats.decode_steps, gen.stats.decode_seconds
    compiled0 = compiles() + gen.stats.graphs_captured
    sync(device)
    start = time.perf_counter()
    groups = gen.generate(call_prompts, call_params)
    sync(device)
    seconds = time.perf_counter() - start
    new = sum(len(s.completion_ids) for grp in groups for s in grp)
    want = [p.max_new_tokens for p in call_params] if args.ragged else [args.new_tokens] * batch
    assert new == sum(want), (new, sum(want))
    # Compiles and captures after the warm-up: in the untimed call and in the timed one.
    missed = warm["compiles_after_warmup"] + compiles() + gen.stats.graphs_captured - compiled0
    steps = gen.stats.decode_steps - steps0
    decode_s = gen.stats.decode_seconds - decode0
    step_ms = 1e3 * decode_s / max(steps, 1)
    kernels = None
    if args.profile and device.type == "cuda":
        kernels = profile_step(gen, batch, "greedy" if mode == "greedy" else "sampled")
    return {
        "seconds": seconds,
        "new_tokens_per_s": new / seconds,
        "decode_ms_per_step": step_ms,
        "decode_steps": steps,
        # Everything of the timed call but its decode steps and host checks: the prefill, its
        # row copies and the Python around them.
        "prefill_and_setup_s": seconds - decode_s,
        # Generator.warm_up: compiles (dynamo graphs made, inductor's kernels) and captures.
        "warmup_s": warm["warmup_s"],
        "warmup_graphs": warm["warmup_graphs"],
        "graphs_captured": gen.stats.graphs_captured,
        "compiles_after_warmup": missed,
        "kernels": kernels,
    }


def _beside(label: str, t: dict | None, other: dict | None, ratio: Callable[[float], str]) -> str:
    """Another configuration's figures beside tidal's on one line, with ratio(tidal / it)."""
    if other is None:
        return f" | {label} FAILED"
    out = (
        f" | {label} {other['new_tokens_per_s']:,.0f} tok/s, "
        f"{other['decode_ms_per_step']:.2f} ms/step"
    )
    if t is not None:
        out += f" ({ratio(t['new_tokens_per_s'] / other['new_tokens_per_s'])})"
    return out


def profile_step(gen, batch: int, variant: str, steps: int = 20) -> dict:
    """The CUDA kernels of one decode step: the compiled step (not its graph, whose kernels
    are the same) run `steps` times under torch.profiler after the timed call (its rows are
    finished: frozen, they compute as running rows do). Uses the Generator's
    `steps.function` (the compiled step of a sampler variant, not captured). Profiling is an
    extra: an error is reported in its place ({"error": ...}) and the timing kept."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step = gen.steps.function(variant)
    try:
        with torch.no_grad():  # as in generate: another grad mode would recompile the step
            step(batch)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    step(batch)
                torch.cuda.synchronize()
        found = [
            (e.key, e.count / steps, e.self_device_time_total / steps)
            for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA
        ]
    except Exception as e:  # the documented fallback above
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}
    found.sort(key=lambda k: -k[2])
    return {
        "us_per_step": sum(us for _, _, us in found),
        "launches_per_step": sum(n for _, n, _ in found),
        "top": [{"kernel": k, "per_step": n, "us": us} for k, n, us in found[:15]],
    }


def run_hf(args, batch: int, mode: str, device: torch.device) -> dict | None:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    from tidal.models import get_flavor

    a = get_flavor(args.flavor)
    cfg = LlamaConfig(
        hidden_size=a.dim,
        intermediate_size=a.ffn_dim,
        num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads,
        vocab_size=a.vocab_size,
        rope_theta=a.rope_theta,
        max_position_embeddings=a.max_seq_len,
        rms_norm_eps=a.norm_eps,
        tie_word_embeddings=a.tie_embeddings,
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    ids = torch.randint(0, a.vocab_size, (batch, args.prompt_len), device=device)
    kw = dict(
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=mode == "sampled",
        pad_token_id=0,
    )
    if mode == "sampled":
        kw.update(temperature=1.0, top_p=args.top_p, top_k=0)
    with torch.no_grad():
        model.generate(ids[:, :16], max_new_tokens=8, do_sample=False, pad_token_id=0)
        sync(device)
        start = time.perf_counter()
        out = model.generate(ids, **kw)
        sync(device)
    seconds = time.perf_counter() - start
    new = out.shape[0] * (out.shape[1] - ids.shape[1])
    del model
    return {"seconds": seconds, "new_tokens_per_s": new / seconds}


def run_score(model, args) -> dict:
    """Trainer side: forward + backward of logprobs, normal vs batch-invariant."""
    from tidal.generate import logprobs

    device = model.rope.device
    ids = torch.randint(0, model.args.vocab_size, (args.score_batch, args.score_len), device=device)
    out = {}
    for name, flag in [("normal", False), ("batch_invariant", True)]:
        times = []
        for _ in range(3):
            sync(device)
            start = time.perf_counter()
            logprobs(model, ids, batch_invariant=flag).sum().backward()
            sync(device)
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
        out[name] = min(times[1:])
    out["ratio"] = out["batch_invariant"] / out["normal"]
    return out


def attempt(failures: list[str], label: str, fn: Callable[..., dict | None], *args) -> dict | None:
    """fn(*args), or {"error": ...} when it raises: one failing configuration must not cost
    the rest of the table (the documented fallback; main exits 1 when any failed)."""
    try:
        return fn(*args)
    except Exception as e:  # reported here and in the exit status; the next one runs
        traceback.print_exc()
        print(f"{label}: FAILED: {type(e).__name__}: {e}", flush=True)
        failures.append(label)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="llama3_1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="bf16 on CUDA")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--modes", nargs="+", default=["greedy", "sampled"])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--top-p", type=float, default=1.0, help="for the sampled mode")
    p.add_argument("--no-batch-invariant", action="store_true", help="skip the mode's runs")
    p.add_argument("--no-hf", action="store_true", help="skip transformers even if importable")
    p.add_argument(
        "--tune-kernels",
        action="store_true",
        help="GeneratorConfig.tune_kernels (coordinate-descent tuning of the compiled decode step)",
    )
    p.add_argument(
        "--compile-scope",
        default="step",
        choices=["step", "blocks"],
        help="GeneratorConfig.compile_scope: the whole decode step per bucket and "
        "sampler, or one block shared by every layer (docs/generate.md)",
    )
    p.add_argument(
        "--plain-sampler",
        action="store_true",
        help="also time each normal-mode configuration with the baseline sampler "
        "of benchmarks/sampler.py (the one before row_stats)",
    )
    p.add_argument("--check-every", type=int, default=8, help="GeneratorConfig.check_every")
    p.add_argument(
        "--fuse-projections",
        action="store_true",
        help="also time each normal-mode configuration with GeneratorConfig.fuse_projections "
        "(Q|K|V and W1|W3 as one product each), in the same run",
    )
    p.add_argument(
        "--ragged",
        action="store_true",
        help="rows of spread prompt lengths and new tokens: continuous batching "
        "moves them through every batch bucket",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="print the CUDA kernels of each configuration's decode step",
    )
    p.add_argument("--hbm-gbps", type=float, default=4800.0, help="HBM bandwidth (H200: 4800)")
    p.add_argument("--score-batch", type=int, default=4)
    p.add_argument("--score-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    model = build_model(args, device)
    n_params = sum(p.numel() for p in model.parameters())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"{args.flavor}: {n_params / 1e9:.2f}B parameters, {args.dtype}, {where}, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, prompts "
        f"{args.prompt_len} + {args.new_tokens} new tokens"
        f"{' (ragged: down to half and 1/batch)' if args.ragged else ''}, compile scope "
        f"{args.compile_scope}"
    )
    results: dict = {
        "flavor": args.flavor,
        "device": where,
        "dtype": args.dtype,
        "compile_scope": args.compile_scope,
        "ragged": args.ragged,
        "runs": [],
    }
    failures: list[str] = []
    for batch in args.batches:
        for mode in args.modes:
            row: dict = {"batch": batch, "mode": mode}
            for variant in variants(args):
                label = f"batch {batch} {mode} {variant.name}"
                row[variant.name] = attempt(
                    failures, label, run_tidal, model, args, batch, mode, variant
                )
            if device.type == "cuda":
                length = args.prompt_len + args.new_tokens / 2
                w, wkv = hbm_bound_ms(model, batch, length, args.hbm_gbps * 1e9)
                row["hbm_bound_ms"] = {"weights": w, "weights_and_kv": wkv}
            if not args.no_hf:
                label = f"batch {batch} {mode} transformers"
                hf = attempt(failures, label, run_hf, args, batch, mode, device)
                if hf is not None:
                    row["transformers"] = hf
            results["runs"].append(row)
            print_row(row)
    if not args.no_batch_invariant:
        score = attempt(failures, "trainer logprobs", run_score, model, args)
        results["score"] = score
        if score is not None and "error" not in score:
            print(
                f"trainer logprobs fwd+bwd {args.score_batch}x{args.score_len}: normal "
                f"{1e3 * score['normal']:.1f} ms, batch-invariant "
                f"{1e3 * score['batch_invariant']:.1f} ms ({score['ratio']:.2f}x)"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if failures:
        print(f"{len(failures)} configuration(s) failed: {', '.join(failures)}", flush=True)
        sys.exit(1)


def print_row(row: dict) -> None:
    """One line per configuration; a run that failed reads FAILED and the ratios to it are
    left out."""

    def ok(name: str) -> dict | None:
        r = row.get(name)
        return r if r is not None and "error" not in r else None

    t, h, b = ok("tidal"), ok("transformers"), ok("batch_invariant")
    ps = ok("plain_sampler")
    line = f"batch {row['batch']:>4} {row['mode']:8s} tidal "
    if t is None:
        line += "FAILED"
    else:
        line += (
            f"{t['new_tokens_per_s']:>10,.0f} new tok/s, decode "
            f"{t['decode_ms_per_step']:7.2f} ms/step, prefill+setup "
            f"{1e3 * t['prefill_and_setup_s']:.1f} ms, warm-up {t['warmup_s']:.1f} s "
            f"({t['warmup_graphs']} graphs, {t['graphs_captured']} CUDA graphs)"
        )
        if t["compiles_after_warmup"]:
            line += (
                f" (WARNING: {t['compiles_after_warmup']} compile(s)/capture(s) after the warm-up)"
            )
        if "hbm_bound_ms" in row:
            bound = row["hbm_bound_ms"]
            line += (
                f" (HBM bound {bound['weights']:.2f} ms weights, "
                f"{bound['weights_and_kv']:.2f} ms with KV: "
                f"{t['decode_ms_per_step'] / bound['weights_and_kv']:.2f}x)"
            )
    if "transformers" in row:
        line += " | transformers " + (
            "FAILED" if h is None else f"{h['new_tokens_per_s']:,.0f} tok/s"
        )
        if t is not None and h is not None:
            line += f", tidal/transformers {t['new_tokens_per_s'] / h['new_tokens_per_s']:.1f}x"
    if "batch_invariant" in row:
        line += _beside("batch-invariant", t, b, lambda r: f"{r:.2f}x slower")
    if "plain_sampler" in row:
        line += _beside("plain sampler", t, ps, lambda r: f"tidal {r:.3f}x")
    if "fused" in row:
        line += _beside("fused projections", t, ok("fused"), lambda r: f"fused {1 / r:.3f}x")
    print(line, flush=True)
    for name in ("tidal", "plain_sampler", "fused"):
        r = ok(name)
        if r is None or not r.get("kernels"):
            continue
        k = r["kernels"]
        if "error" in k:
            print(f"  {name} decode step kernels: profiling FAILED: {k['error']}")
            continue
        print(
            f"  {name} decode step kernels: {k['us_per_step']:.1f} us in "
            f"{k['launches_per_step']:.0f} launches per step; the longest:"
        )
        for e in k["top"]:
            print(f"    {e['us']:8.1f} us {e['per_step']:5.1f}x  {e['kernel'][:110]}")


if __name__ == "__main__":
    main()
