"""The checks and settings of a training job that come before any process group, data or
model: the device, seeding, and every check a user can fail (`check_job`). Run by
`Trainer.__init__` on every rank and by `tidal train --nproc` before it launches them."""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Any

import torch

from tidal.models.flavors import get_flavor
from tidal.models.transformer import ModelArgs
from tidal.parallel.dims import ParallelDims, check_layout
from tidal.train.config import Config
from tidal.train.data import Tokenizer
from tidal.train.float8 import check_float8
from tidal.train.metrics import WANDB_MISSING, has_module
from tidal.train.run_folder import check_output_dir


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("job.device=cuda but no CUDA device is available")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device(name)


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; it is read at CUDA init.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # warn_only: ops without a deterministic kernel (some attention backwards) warn
        # instead of stopping the run.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def check_job(
    cfg: Config, args: ModelArgs, *, world_size: int, device: torch.device, data: bool = True
) -> ParallelDims:
    """The checks of a job a user can fail that need no data, model or process group: the
    parallel layout on `world_size` ranks, `job.output_dir` (created here), the wandb package
    for `metrics.wandb`, flex attention on a CPU, float8 (torchao installed, a GPU with float8
    matmuls), and (with `data`, the configured pipeline) the tokenizer's vocabulary against the
    model's. Run by `Trainer.__init__` on every rank and by `tidal train --nproc` before it
    launches them. Returns the layout's `ParallelDims`.

    Raises:
        ValueError: naming the field to change.
        ImportError: quantize.float8 without torchao installed.
        FileNotFoundError: the tokenizer file does not exist.
    """
    dims = check_layout(
        cfg.parallelism,
        args,
        world_size=world_size,
        seq_len=cfg.training.seq_len,
        batch_size=cfg.training.batch_size,
        model_name=f"model.flavor {cfg.model.flavor!r}",
    )
    check_output_dir(cfg.job.output_dir)
    t = cfg.training
    if t.batch_invariant:
        blockers = {
            "model.attention=flex": args.attention == "flex",
            # A vocabulary-sharded log-softmax sums its shards in another order than one
            # process; the rest of a TP forward is bitwise (tidal/models/batch_invariant_tp.py).
            f"parallelism.tp={dims.tp} with parallelism.loss_parallel=true": dims.tp > 1
            and cfg.parallelism.loss_parallel,
            f"parallelism.cp={dims.cp}": dims.cp > 1,
            "training.compile=true": t.compile,
            "training.fuse_projections=true": t.fuse_projections,
        }
        if any(blockers.values()):
            bad = ", ".join(k for k, v in blockers.items() if v)
            raise ValueError(
                f"training.batch_invariant=true does not work with {bad}: the mode's fixed "
                "orders cover causal sdpa attention on plain or tensor-parallel (not fused) "
                "weights with replicated logits, in eager mode"
            )
    if args.moe is not None and (dims.tp > 1 and dims.ep == 1 or dims.pp > 1):
        raise ValueError(
            f"model.flavor {cfg.model.flavor!r} is a mixture of experts: it runs on one process "
            f"or with FSDP and expert parallel (parallelism.ep, with TP for attention), not with "
            f"parallelism.tp={dims.tp} / parallelism.pp={dims.pp}"
            + (" without parallelism.ep" if dims.tp > 1 and dims.pp == 1 else "")
        )
    if t.fuse_projections and dims.tp > 1:
        raise ValueError(
            f"training.fuse_projections=true does not work with parallelism.tp={dims.tp}: "
            "tensor-parallel projections are sharded and keep their own products"
        )
    check_float8(cfg.quantize, device, batch_invariant=t.batch_invariant)
    if cfg.metrics.wandb and not has_module("wandb"):
        raise ValueError(WANDB_MISSING)
    if args.attention == "flex" and device.type == "cpu":
        raise ValueError(
            "model.attention=flex needs a CUDA device: flex attention has no backward on CPU; "
            "use --model.attention sdpa (or --job.device cuda on a GPU machine)"
        )
    if data:
        d = cfg.data
        if d.tokenizer == "bpe":
            vocab, fix = (
                d.vocab_size,
                f"--model.vocab_size {d.vocab_size} or a smaller --data.vocab_size",
            )
            what = f"data.vocab_size={vocab} (the BPE to train)"
        else:
            vocab = Tokenizer.from_file(d.tokenizer).vocab_size
            fix = f"--model.vocab_size {vocab} (the tokenizer file fixes the vocabulary)"
            what = f"the tokenizer {d.tokenizer} has {vocab} tokens and"
        if vocab > args.vocab_size:
            raise ValueError(
                f"{what} does not fit the {args.vocab_size}-token embedding of model.flavor "
                f"{cfg.model.flavor!r}; set {fix}"
            )
    return dims


def model_args_for(cfg: Config) -> ModelArgs:
    if cfg.checkpoint.initial_load_hf:  # the architecture of a Hugging Face folder
        from tidal.train.checkpoint.hf import hf_args_for

        args = hf_args_for(cfg)
    else:
        overrides: dict[str, Any] = {"attention": cfg.model.attention}
        if cfg.model.vocab_size is not None:
            overrides["vocab_size"] = cfg.model.vocab_size
        args = get_flavor(cfg.model.flavor, **overrides)
    balance = cfg.model.moe_load_balance
    if balance is not None:
        if args.moe is None:
            raise ValueError(
                f"model.moe_load_balance={balance} needs a mixture-of-experts model; "
                f"model.flavor {cfg.model.flavor!r} is dense"
            )
        args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, load_balance=balance))
    return args
