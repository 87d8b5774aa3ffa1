"""The training loop: build data, model and optimizer from a Config, then step.

Lifecycle (one process per device): `Trainer(cfg)` resolves the device, seeds, builds the data
pipeline (tokenizer first, so the model's vocabulary can be checked before anything is
allocated), builds the model on the meta device, materializes and initializes it, and builds
AdamW. `train()` runs `training.steps` optimizer steps, each over `grad_accum_steps`
micro-batches, logging every `metrics.log_every` steps and validating every
`metrics.val_every`; Ctrl-C ends the loop after the current step and still logs it.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from dataclasses import dataclass

import torch

from tidal.models.flavors import get_flavor
from tidal.models.transformer import ModelArgs, Transformer
from tidal.train.config import Config
from tidal.train.data import IGNORE_INDEX, Batch, DataBundle, build_data
from tidal.train.loss import cross_entropy_sum
from tidal.train.metrics import (
    MetricsLogger,
    Stopwatch,
    flops_per_token,
    peak_flops,
    peak_memory_gib,
)
from tidal.train.optim import build_optimizer, set_lr, wsd_multiplier
from tidal.train.sample import generate


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("job.device=cuda but no CUDA device is available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; it is read at CUDA init.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def model_args_for(cfg: Config) -> ModelArgs:
    overrides = {"attention": cfg.model.attention}
    if cfg.model.vocab_size is not None:
        overrides["vocab_size"] = cfg.model.vocab_size
    return get_flavor(cfg.model.flavor, **overrides)


def build_model(args: ModelArgs, device: torch.device, seed: int) -> Transformer:
    """Meta-device build, then allocate on `device` and initialize once."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights(seed=seed)
    return model


@dataclass
class StepResult:
    loss: torch.Tensor  # mean token loss of the step (a 0-dim tensor, not synced)
    grad_norm: torch.Tensor
    tokens: int


class Trainer:
    def __init__(self, cfg: Config, *, data: DataBundle | None = None, log=print):
        """Build everything for `cfg`; `data` replaces the configured data pipeline (tests,
        benchmarks on synthetic tokens)."""
        self.cfg, self.log = cfg, log
        t = cfg.training
        self.device = resolve_device(cfg.job.device)
        seed_everything(t.seed, t.deterministic)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = True
        precision = t.mixed_precision
        if precision == "auto":
            precision = "bf16" if self.device.type == "cuda" else "fp32"
        self.autocast_dtype = torch.bfloat16 if precision == "bf16" else None

        self.data = data or build_data(
            cfg.data, seq_len=t.seq_len, batch_size=t.batch_size, seed=t.seed, log=log
        )
        self.args = model_args_for(cfg)
        vocab = self.data.tokenizer.vocab_size
        if vocab > self.args.vocab_size:
            raise ValueError(
                f"the tokenizer has {vocab} tokens but model.flavor {cfg.model.flavor!r} embeds "
                f"only {self.args.vocab_size}; set --model.vocab_size {vocab} or a smaller "
                f"--data.vocab_size"
            )
        if t.seq_len > self.args.max_seq_len:
            raise ValueError(
                f"training.seq_len={t.seq_len} exceeds model max_seq_len={self.args.max_seq_len}"
            )

        self.model = build_model(self.args, self.device, seed=t.seed)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        if t.compile:
            # Per-block compile: one graph reused by every layer, quick to build. The loss
            # is already a memory-lean custom kernel sequence (tidal/train/loss.py).
            for block in self.model.layers.values():
                block.compile()
        self.optimizer = build_optimizer(self.model, cfg.optimizer, self.device)
        self.flops_per_token = flops_per_token(self.model, t.seq_len)
        self.peak_flops = peak_flops(self.device)
        self.step = 0
        self.train_iter = iter(self.data.train)
        log(
            f"model {cfg.model.flavor}: {self.n_params / 1e6:.1f}M parameters, "
            f"vocab {self.args.vocab_size}, device {self.device}, precision {precision}, "
            f"compile {t.compile}"
        )

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def next_batches(self) -> tuple[list[Batch], int, float]:
        """The micro-batches of one optimizer step on device, their count of valid labels
        (counted on the host, so the step needs no device sync), and the seconds spent."""
        start = time.perf_counter()
        host = [next(self.train_iter) for _ in range(self.cfg.training.grad_accum_steps)]
        n_tokens = sum(int((b.labels != IGNORE_INDEX).sum()) for b in host)
        batches = [b.to(self.device, non_blocking=True) for b in host]
        return batches, n_tokens, time.perf_counter() - start

    def forward_loss(self, batch: Batch) -> torch.Tensor:
        """Summed token loss of one micro-batch."""
        doc_ids = batch.document_ids if self.args.attention == "flex" else None
        with self.autocast():
            logits = self.model(batch.input_ids, document_ids=doc_ids)
        return cross_entropy_sum(logits, batch.labels)

    def train_step(self, batches: list[Batch], n_tokens: int) -> StepResult:
        """One optimizer step: loss = sum of token losses / number of valid tokens in the step."""
        total = torch.zeros((), device=self.device)
        for batch in batches:
            loss = self.forward_loss(batch) / n_tokens
            loss.backward()
            total += loss.detach()
        max_norm = self.cfg.training.max_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), max_norm if max_norm > 0 else math.inf, foreach=True
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(total, grad_norm, n_tokens)

    @torch.no_grad()
    def validate(self) -> float | None:
        """Mean token loss over the first `metrics.val_batches` validation batches."""
        if self.data.val is None:
            return None
        self.model.eval()
        loss_sum, n = 0.0, 0
        for batch in self.data.val.iter_epoch(0, max_batches=self.cfg.metrics.val_batches):
            batch = batch.to(self.device)
            loss_sum += float(self.forward_loss(batch))
            n += int((batch.labels != -100).sum())
        self.model.train()
        return loss_sum / max(n, 1)

    def sample(self) -> str:
        s = self.cfg.sample
        tok = self.data.tokenizer
        prompt = [tok.bos_id] + tok.encode(s.prompt)
        self.model.eval()
        with self.autocast():
            new = generate(
                self.model,
                prompt,
                max_new_tokens=s.max_new_tokens,
                temperature=s.temperature,
                top_k=s.top_k,
                stop_id=tok.eos_id,
                seed=self.cfg.training.seed,
            )
        self.model.train()
        return s.prompt + tok.decode(new)

    def train(self) -> dict:
        """Run the configured number of steps; returns the last logged record."""
        cfg = self.cfg
        total_steps, m = cfg.training.steps, cfg.metrics
        logger = MetricsLogger(cfg.job.output_dir, tensorboard=m.tensorboard)
        watch, last = Stopwatch(), {}
        window_tokens, window_steps, start = 0, 0, time.perf_counter()
        self.model.train()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            while self.step < total_steps:
                self.step += 1
                lr = cfg.optimizer.lr * wsd_multiplier(self.step, total_steps, cfg.lr_scheduler)
                set_lr(self.optimizer, lr)
                batches, n_tokens, wait = self.next_batches()
                watch.add("data_wait", wait)
                result = self.train_step(batches, n_tokens)
                window_tokens += result.tokens
                window_steps += 1
                if self.step % m.log_every == 0 or self.step == total_steps:
                    last = self._log_step(
                        logger, result, lr, window_tokens, window_steps, watch, start
                    )
                    window_tokens, window_steps = 0, 0
                if m.val_every and (self.step % m.val_every == 0 or self.step == total_steps):
                    self._log_validation(logger)
        except KeyboardInterrupt:
            self.log(f"interrupted at step {self.step}/{total_steps}; stopping cleanly")
            last["interrupted"] = True
        finally:
            logger.close()
        if cfg.sample.max_new_tokens and not last.get("interrupted"):
            text = self.sample()
            self.log("sample:\n" + text)
            (logger.dir / "sample.txt").write_text(text + "\n")
        return last

    def _log_step(self, logger, result: StepResult, lr, tokens, steps, watch, start) -> dict:
        loss = float(result.loss)  # syncs the device: timing below covers all queued work
        elapsed = watch.reset()
        tps = tokens / elapsed
        tflops = tps * self.flops_per_token / 1e12
        record = {
            "step": self.step,
            "loss": loss,
            "grad_norm": float(result.grad_norm),
            "lr": lr,
            "tokens_per_s": tps,
            "tflops": tflops,
            "mfu": tflops * 1e12 / self.peak_flops if self.peak_flops else None,
            "peak_memory_gib": peak_memory_gib(self.device),
            "data_wait_s": watch.totals.get("data_wait", 0.0) / steps,
            "elapsed_s": time.perf_counter() - start,
        }
        done = self.step / self.cfg.training.steps
        eta = record["elapsed_s"] * (1 - done) / done
        mfu = f" mfu {100 * record['mfu']:.1f}%" if record["mfu"] is not None else ""
        line = (
            f"step {self.step:>6}/{self.cfg.training.steps} loss {loss:7.4f} "
            f"gnorm {record['grad_norm']:6.3f} lr {lr:.2e} tok/s {tps:,.0f} "
            f"tflops {tflops:.1f}{mfu} mem {record['peak_memory_gib']:.2f}GiB "
            f"data {1000 * record['data_wait_s']:.1f}ms eta {eta:.0f}s"
        )
        logger.log(record, line)
        return record

    def _log_validation(self, logger) -> None:
        val = self.validate()
        if val is None:
            return
        record = {"step": self.step, "val_loss": val, "val_ppl": math.exp(min(val, 50))}
        logger.log(record, f"step {self.step:>6} val_loss {val:.4f} ppl {record['val_ppl']:.1f}")
