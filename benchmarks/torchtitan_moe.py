"""torchtitan 0.2.2's own Qwen 3 MoE model at the shape of a tidal MoE flavor, for
train_throughput.py (MoE flavors with `--torchtitan DIR`).

`titan_args` builds torchtitan's `Qwen3ModelArgs` (with its `MoEArgs`) from a tidal flavor,
field for field; `compare` prints both configurations side by side, the behaviours that differ
and cannot be made equal (`DIFFERENCES`), and both parameter counts and FLOPs per token
(models built on the meta device). `run` installs the torchtitan wheels of DIR (as
shared/anchors/torchtitan_baseline.sh does), writes the c4_test-style text torchtitan trains
on, and runs torchtitan's trainer once per mode through this file, which as a script is the
launcher: it registers every tidal MoE flavor as torchtitan Qwen 3 flavor `tidal_<name>` and
runs `torchtitan.train`:

    torchrun --nproc_per_node=1 benchmarks/torchtitan_moe.py --job.config_file \\
        .anchors/torchtitan_1b.toml --model.name qwen3 --model.flavor tidal_qwen3_moe_1b ...

(PYTHONPATH must reach torchtitan and tidal; TIDAL_MOE_LOAD_BALANCE, bias by default, is the
balancing the registered flavors take, `run` sets it).

Load balancing: torchtitan 0.2.2 has no auxiliary loss, only the aux-loss-free expert bias
(`load_balance_coeff`) or none; the comparison therefore runs both with the bias (tidal's
`model.moe_load_balance=bias`, rate 1e-3 = torchtitan's coefficient 1e-3).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PREFIX = "tidal_"
"""torchtitan flavor name of tidal flavor F: tidal_F."""
TORCHTITAN_VERSION = "0.2.2"
SITE = Path("/tmp/titan_site")
"""Where `install` puts the wheels of DIR/wheels (the path torchtitan_baseline.sh uses)."""

DIFFERENCES = [
    "load balancing: torchtitan has no auxiliary loss; both run the aux-loss-free expert bias "
    "(rate 1e-3). torchtitan updates it before the optimizer step from the counts it "
    "accumulated and centers the update (delta - mean(delta)); tidal after the step, "
    "uncentered. tidal also computes the auxiliary loss as a metric (a few small kernels).",
    "routing: both softmax in fp32, top-k, renormalize the k weights; torchtitan's top-k is "
    "unsorted and its renormalization adds 1e-20 to the denominator.",
    "combine: torchtitan weights and sums the k expert outputs in fp32 (bmm), tidal in the "
    "activations' dtype (bf16), as transformers does.",
    "grouped GEMM: both torch._grouped_mm in bf16 with each expert's rows padded to 8; "
    "torchtitan builds the padded order with a Triton index kernel (generate_permute_indices), "
    "tidal with index_copy into a buffer of static size. No capacity, no dropped tokens in "
    "either.",
    "torch.compile: tidal compiles each whole block; torchtitan compiles the attention, "
    "norms, router and the grouped-GEMM function, but leaves the dispatch and combine of "
    "MoE.forward eager (its issue #1940), and compiles the loss.",
    "data: tidal trains on uniform random token ids over the vocabulary, torchtitan on text "
    "of 5000 random words through the Llama 3 tokenizer of DIR (fewer distinct ids): the "
    "routing, hence each expert's load, differs (tidal's moe_load_max is printed).",
    "weights: each its own initialization (only the routing balance depends on it).",
]
"""Behaviours of the two MoE models that differ and cannot be set equal (printed)."""


def moe_flavors() -> dict[str, Any]:
    """tidal's MoE flavors by name."""
    from tidal.models.flavors import FLAVORS

    return {name: a for name, a in FLAVORS.items() if a.moe is not None}


def titan_args(flavor: str, load_balance: str = "bias", **overrides: Any) -> Any:
    """torchtitan's Qwen3ModelArgs at the shape of tidal flavor `flavor`, the load balancing
    `load_balance` ("bias": torchtitan's expert bias at tidal's rate; "aux_loss": none, as
    torchtitan has no auxiliary loss). `overrides` are tidal ModelArgs fields (vocab_size)."""
    from torchtitan.models.moe import MoEArgs as TitanMoEArgs
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    from tidal.models.flavors import get_flavor

    a = get_flavor(flavor, **overrides)
    if a.moe is None:
        raise ValueError(f"flavor {flavor!r} is dense: torchtitan's MoE comparison needs MoE")
    if a.rope_scaling is not None or a.qkv_bias or a.family != "qwen3_moe":
        raise ValueError(
            f"flavor {flavor!r} has RoPE scaling, q/k/v biases or family {a.family!r}: "
            "torchtitan's Qwen 3 model has neither"
        )
    m = a.moe
    return Qwen3ModelArgs(
        dim=a.dim,
        n_layers=a.n_layers,
        n_heads=a.n_heads,
        n_kv_heads=a.n_kv_heads,
        vocab_size=a.vocab_size,
        head_dim=a.k,
        hidden_dim=a.ffn_dim,
        norm_eps=a.norm_eps,
        rope_theta=a.rope_theta,
        qk_norm=a.qk_norm,
        max_seq_len=a.max_seq_len,
        enable_weight_tying=a.tie_embeddings,
        moe_enabled=True,
        moe_inter_dim=m.ffn_dim,
        moe_args=TitanMoEArgs(
            num_experts=m.n_experts,
            num_shared_experts=m.n_shared_experts,
            score_func="softmax",
            route_norm=m.norm_topk_prob,
            route_scale=1.0,
            gate_bias=False,
            score_before_experts=False,
            top_k=m.top_k,
            use_grouped_mm=True,
            load_balance_coeff=m.bias_update_rate if load_balance == "bias" else None,
        ),
    )


def field_rows(flavor: str, load_balance: str = "bias") -> list[tuple[str, Any, Any, bool]]:
    """(field, tidal's value, torchtitan's value, equal) for every shape and routing field."""
    from tidal.models.flavors import get_flavor

    a, t = get_flavor(flavor), titan_args(flavor, load_balance)
    m, tm = a.moe, t.moe_args
    assert m is not None
    tidal_rate = m.bias_update_rate if load_balance == "bias" else None
    rows: list[tuple[str, Any, Any]] = [
        ("dim", a.dim, t.dim),
        ("layers (every one MoE)", a.n_layers, t.n_layers),
        ("attention heads", a.n_heads, t.n_heads),
        ("kv heads", a.n_kv_heads, t.n_kv_heads),
        ("head dim", a.k, t.head_dim),
        ("vocab", a.vocab_size, t.vocab_size),
        ("tied embeddings", a.tie_embeddings, t.enable_weight_tying),
        ("rope theta", a.rope_theta, float(t.rope_theta)),
        ("qk norm", a.qk_norm, t.qk_norm),
        ("norm eps", a.norm_eps, t.norm_eps),
        ("routed experts", m.n_experts, tm.num_experts),
        ("experts per token (top-k)", m.top_k, tm.top_k),
        ("expert hidden size", m.ffn_dim, t.moe_inter_dim),
        ("shared experts", m.n_shared_experts, tm.num_shared_experts),
        ("score function", "softmax", tm.score_func),
        ("renormalize top-k weights", m.norm_topk_prob, tm.route_norm),
        ("route scale", 1.0, tm.route_scale),
        ("router bias", False, tm.gate_bias),
        ("weights applied before experts", False, tm.score_before_experts),
        ("node-limited groups", None, tm.num_expert_groups),
        ("capacity (dropped tokens)", None, None),
        ("expert-bias rate (None: off)", tidal_rate, tm.load_balance_coeff),
        ("auxiliary loss", load_balance == "aux_loss", False),
    ]
    return [(name, x, y, x == y) for name, x, y in rows]


def counts(flavor: str, seq_len: int, load_balance: str = "bias") -> dict[str, int]:
    """Parameters (all, active per token) and training FLOPs per token of both models at
    `seq_len`, built on the meta device; FLOPs by each system's own formula (both count the
    k routed experts, not all E: torchtitan's get_moe_model_nparams_and_flops, tidal's
    flops_per_token)."""
    import torch
    from torchtitan.models.qwen3 import Qwen3Model

    from tidal.models.flavors import get_flavor
    from tidal.models.transformer import Transformer
    from tidal.train.metrics import flops_per_token

    a, t = get_flavor(flavor), titan_args(flavor, load_balance)
    assert a.moe is not None
    with torch.device("meta"):
        tidal_model, titan_model = Transformer(a), Qwen3Model(t)
    tidal_all = sum(p.numel() for p in tidal_model.parameters())
    titan_all = sum(p.numel() for p in titan_model.parameters())
    titan_params, titan_flops = t.get_nparams_and_flops(titan_model, seq_len)
    experts = sum(p.numel() for n, p in titan_model.named_parameters() if "moe.experts" in n)
    return {
        "tidal_params": tidal_all,
        "torchtitan_params": titan_all,
        "tidal_active": tidal_all - a.n_layers * a.moe.inactive_params(a.dim),
        "torchtitan_active": titan_all
        - experts
        + experts * t.moe_args.top_k // t.moe_args.num_experts,
        "tidal_flops_per_token": int(flops_per_token(tidal_model, seq_len)),
        "torchtitan_flops_per_token": int(titan_flops),
        "torchtitan_params_reported": titan_params,
    }


def compare(flavor: str, seq_len: int, load_balance: str = "bias") -> str:
    """The printed comparison: fields side by side (`!=` marks a difference), parameter
    counts and FLOPs per token, and `DIFFERENCES`."""
    rows = field_rows(flavor, load_balance)
    lines = [f"tidal {flavor} against torchtitan 0.2.2 qwen3 flavor {PREFIX}{flavor}:"]
    for name, x, y, same in rows:
        mark = "  " if same else "!="
        lines.append(f"  {name:28s} {x!s:>20s} {mark} {y!s:<20s}")
    c = counts(flavor, seq_len, load_balance)
    lines.append(
        f"  {'parameters':28s} {c['tidal_params']:>20,d} "
        f"{'  ' if c['tidal_params'] == c['torchtitan_params'] else '!='} "
        f"{c['torchtitan_params']:,d}"
    )
    lines.append(
        f"  {'active per token':28s} {c['tidal_active']:>20,d} "
        f"{'  ' if c['tidal_active'] == c['torchtitan_active'] else '!='} "
        f"{c['torchtitan_active']:,d}"
    )
    lines.append(
        f"  {f'train FLOPs/token (seq {seq_len})':28s} {c['tidal_flops_per_token']:>20,d} "
        f"{'  ' if c['tidal_flops_per_token'] == c['torchtitan_flops_per_token'] else '!='} "
        f"{c['torchtitan_flops_per_token']:,d}"
    )
    lines.append("behaviours that differ:")
    lines += [f"  - {d}" for d in DIFFERENCES]
    return "\n".join(lines)


# -- running torchtitan's trainer -----------------------------------------------------------


def install(anchors: Path) -> None:
    """pip-install the wheels of `anchors`/wheels into SITE (once, no network: --no-index) and
    make them importable here, unless torchtitan 0.2.2 is importable already."""
    try:  # already there (a development environment): use it
        if importlib.metadata.version("torchtitan") == TORCHTITAN_VERSION:
            return
    except importlib.metadata.PackageNotFoundError:
        pass
    if not (SITE / "torchtitan").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
            + ["--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE)]
            + [str(w) for w in sorted((anchors / "wheels").glob("*.whl"))],
            check=True,
        )
    if str(SITE) not in sys.path:
        sys.path.insert(0, str(SITE))


def prepare_assets(anchors: Path, work: Path) -> None:
    """torchtitan's relative paths under `work`: the tokenizer of `anchors` in
    tests/assets/tokenizer, and tests/assets/c4_test/data.json, 20000 lines of 600 of 5000
    random words (torchtitan_baseline.sh's recipe)."""
    tok = work / "tests/assets/tokenizer"
    tok.mkdir(parents=True, exist_ok=True)
    for f in (anchors / "tokenizer").glob("*.json"):
        shutil.copyfile(f, tok / f.name)
    data = work / "tests/assets/c4_test/data.json"
    if data.exists() and data.stat().st_size:
        return
    data.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = [f"w{i}" for i in range(5000)]
    with open(data, "w") as f:
        for _ in range(20000):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(600))}) + "\n")


def command(args: Any, mode: str) -> list[str]:
    """The torchrun command line of one torchtitan run of `args` (train_throughput's) in
    `mode` (eager or compile)."""
    anchors = Path(args.torchtitan).resolve()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}"]
    cmd += [str(Path(__file__).resolve()), "--job.config_file", str(anchors / "torchtitan_1b.toml")]
    cmd += ["--model.name", "qwen3", "--model.flavor", PREFIX + args.flavor]
    cmd += ["--training.local_batch_size", str(args.batch), "--training.seq_len", str(args.seq)]
    cmd += ["--training.steps", str(args.steps), "--metrics.log_freq", str(args.log_every)]
    cmd += ["--lr_scheduler.warmup_steps", "5", "--job.dump_folder", "/tmp/torchtitan_moe_out"]
    if mode == "compile":
        cmd.append("--compile.enable")
    return cmd + args.torchtitan_args.split()


def run(args: Any, parse: Any, load_balance: str = "bias") -> list[dict]:
    """torchtitan's trainer on `args.flavor` in each of `args.modes` (bf16; float8 is not
    compared for MoE) with the balancing of `titan_args(.., load_balance)`, its step logs
    parsed by `parse(log, warmup)`."""
    anchors = Path(args.torchtitan).resolve()
    install(anchors)
    work = Path(os.environ.get("TIDAL_TITAN_WORK", "/tmp/tidal_titan_moe"))
    prepare_assets(anchors, work)
    env = dict(os.environ, TIDAL_MOE_LOAD_BALANCE=load_balance)
    paths = [str(SITE), str(REPO), *env.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    results = []
    for mode in args.modes:
        log_path = Path(f"/tmp/torchtitan_moe_{mode}.log")
        try:
            with open(log_path, "w") as log_file:
                subprocess.run(
                    command(args, mode),
                    cwd=work,
                    env=env,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    timeout=args.torchtitan_timeout,
                )
        except subprocess.TimeoutExpired:
            print(f"torchtitan {mode}: stopped after {args.torchtitan_timeout} s", flush=True)
        log = log_path.read_text()
        parsed = parse(log, args.warmup)
        if parsed is None:
            print(f"torchtitan {mode}: no step logs parsed; tail of {log_path}:\n{log[-3000:]}")
            results.append({"system": "torchtitan", "mode": mode, "error": "no step logs"})
        else:
            results.append({"system": "torchtitan", "mode": mode, **parsed})
    return results


def register(load_balance: str = "bias") -> list[str]:
    """Add every tidal MoE flavor F to torchtitan's Qwen 3 flavors as tidal_F; returns the
    names."""
    from torchtitan.models.qwen3 import qwen3_args

    names = []
    for name in moe_flavors():
        qwen3_args[PREFIX + name] = titan_args(name, load_balance)
        names.append(PREFIX + name)
    return names


if __name__ == "__main__":
    import runpy

    register(os.environ.get("TIDAL_MOE_LOAD_BALANCE", "bias"))
    runpy.run_module("torchtitan.train", run_name="__main__")
