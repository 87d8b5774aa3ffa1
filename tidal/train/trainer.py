"""The training loop: build data, model and optimizer from a Config, then step.

Lifecycle (one process per device, launched by torchrun for several): `Trainer(cfg, dist)`
resolves the device and runs `check_job` (the parallel layout against the world size and the
model, the output directory, flex attention on CPU, the tokenizer's vocabulary against the
model's), all before any comms, data or model work. It then settles the run folder: rank 0
locks `job.output_dir`, and every rank decides which checkpoint to start from (tidal/train/
run_folder.py, tidal/train/checkpoint/), so a busy folder or a bad checkpoint fails at once.
Then it joins the process group, builds the mesh and the data pipeline, builds the model (or
this rank's pipeline stages) on the meta device, parallelizes it (tidal/parallel),
materializes and initializes it, and builds AdamW; the checkpoint is loaded once the
optimizer exists. `train()` runs the remaining optimizer steps up to `training.steps`, each
over `grad_accum_steps` micro-batches, logging every `metrics.log_every` steps (rank 0 only),
validating every `metrics.val_every` and saving checkpoints every `checkpoint.interval`;
Ctrl-C ends the loop after the current step on every rank, saves a checkpoint (when enabled)
and still logs the step. The debugging tools (`profiler.*`, `debug.*`: tidal/train/profiling.py,
docs/debugging.md) start before the process group (the Flight Recorder's environment) and the
model (the CUDA allocator's history), and the trace follows the loop's steps.

Loss normalization: each step's loss is the sum of token losses over every micro-batch,
data-parallel rank and context-parallel shard, divided by the global number of valid labels.
FSDP averages gradients over its ranks, so the backward loss is scaled by that count.

As a library (RL): `Trainer(cfg, data=DataBundle(tokenizer=tok, train=None, val=None))`
builds no data pipeline; the caller steps it with its own batches, `train_step(batches,
n_tokens, loss=...)` with an injected `TokenLoss` (tidal/train/loss.py) and extra per-row or
per-token inputs in `Batch.extras`, and scores sequences with `logprobs(batch)`. Every rank
calls both with its own data-parallel share (the same number of batches of the same shape).
The step path, on every layout, is in tidal/train/step.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tidal.models.moe import update_expert_bias
from tidal.models.transformer import Transformer
from tidal.parallel.context import ContextParallel
from tidal.parallel.grad_norm import clip_grad_norm
from tidal.parallel.launch import DistInfo, destroy_process_group, init_process_group
from tidal.parallel.parallelize import parallelize
from tidal.parallel.pipeline import build_stages
from tidal.train.checkpoint import Checkpointer, checkpoint_folder, model_info, plan_load
from tidal.train.config import Config
from tidal.train.config_parse import to_dict
from tidal.train.data import Batch, DataBundle, build_data
from tidal.train.float8 import Float8
from tidal.train.float8 import convert as convert_float8
from tidal.train.job import check_job, model_args_for, resolve_device, seed_everything
from tidal.train.loss import IGNORE_INDEX, TokenLoss
from tidal.train.metrics import (
    MetricsLogger,
    Stopwatch,
    flops_per_token,
    peak_flops,
    peak_memory_gib,
)
from tidal.train.optim import build_optimizer, set_lr, wsd_multiplier
from tidal.train.pipeline_step import PipelineStep
from tidal.train.profiling import RunProfiler, setup_flight_recorder
from tidal.train.run_folder import RunLock, StopOnInterrupt, check_fresh
from tidal.train.step import StepPath, StepResult

__all__ = [
    "StepResult",
    "Trainer",
    "check_job",
    "model_args_for",
    "resolve_device",
    "seed_everything",
]


class Trainer:
    def __init__(
        self,
        cfg: Config,
        *,
        data: DataBundle | Callable[[int, int], DataBundle] | None = None,
        dist_info: DistInfo | None = None,
        log=print,
    ):
        """Build everything for `cfg`.

        Args:
            cfg: the job.
            data: replaces the configured data pipeline (`cfg.data`): a DataBundle, or a
                function of (dp_rank, dp_world) returning one for this rank's share of the
                data. A DataBundle whose `train` is None makes a trainer without training data
                (RL, or any caller with batches of its own): `train_step` takes batches
                passed in; `next_batches` and `train` refuse. Its tokenizer sizes the
                vocabulary check (and `tidal train`'s end-of-run sample encodes its prompt).
            dist_info: this rank (torchrun's environment, read by the CLI); without it the
                trainer runs as one process.
            log: receives rank 0's progress lines.

        Example (a trainer for RL: no data pipeline)::

            trainer = Trainer(cfg, data=DataBundle(tokenizer=tok, train=None, val=None))
            result = trainer.train_step(batches, n_tokens, loss=my_loss)
        """
        self.cfg = cfg
        self.interrupt_after_loop = False
        """Set by `train`: a Ctrl-C came after the loop's last check (every step ran)."""
        self.dist = dist_info or DistInfo()
        self.log = log if self.dist.is_main else (lambda *a, **k: None)
        self.args = model_args_for(cfg)
        self.device = resolve_device(cfg.job.device, self.dist.local_rank)
        # Every check a user can fail, before any comms, data encoding or model building.
        self.dims = check_job(
            cfg, self.args, world_size=self.dist.world_size, device=self.device, data=data is None
        )
        self._open_run_folder()
        try:
            self._build(data)
        except BaseException:
            self._release_locks()  # a run that never started leaves the folder free
            if getattr(self, "profiler", None) is not None:
                self.profiler.close()
            raise

    def _build(self, data) -> None:
        cfg, t = self.cfg, self.cfg.training
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = True
        # Before the model exists: the allocator's history then covers its memory too.
        self.profiler = RunProfiler(
            cfg.profiler,
            cfg.job.output_dir,
            rank=self.dist.rank,
            device=self.device,
            total_steps=t.steps,
            log=self.log,
        )
        fr_folder = setup_flight_recorder(
            cfg.debug, cfg.job.output_dir, device=self.device, world_size=self.dist.world_size
        )
        if fr_folder is not None:
            self.log(f"flight recorder: on; NCCL timeouts dump to {fr_folder}/rank_<R>")
        init_process_group(self.dist, self.device)
        seed_everything(t.seed, t.deterministic)
        self.mesh = self.dims.build_mesh(self.device.type) if self.dist.world_size > 1 else None
        dp_rank = self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

        if callable(data):
            data = data(dp_rank, self.dims.dp)
        self.data = data or build_data(
            cfg.data,
            seq_len=t.seq_len,
            batch_size=t.batch_size,
            seed=t.seed,
            dp_rank=dp_rank,
            dp_world=self.dims.dp,
            log=self.log,
        )
        vocab = self.data.tokenizer.vocab_size
        if vocab > self.args.vocab_size:  # only a DataBundle passed in gets here
            raise ValueError(
                f"the tokenizer has {vocab} tokens but model.flavor {cfg.model.flavor!r} embeds "
                f"only {self.args.vocab_size}; set --model.vocab_size {vocab}"
            )

        precision = t.mixed_precision
        if precision == "auto":
            precision = "bf16" if self.device.type == "cuda" else "fp32"
        bf16 = precision == "bf16"
        fsdp = self.dims.fsdp_enabled
        # FSDP casts parameters itself (MixedPrecisionPolicy); without it, autocast does.
        self.autocast_dtype = torch.bfloat16 if bf16 and not fsdp else None
        self.grad_scale = self.dims.dp * self.dims.cp if fsdp else 1  # undo FSDP's averaging
        self.loss_parallel = self.dims.tp > 1 and cfg.parallelism.loss_parallel
        self.cp = (
            ContextParallel(self.mesh["cp"], load_balance=cfg.parallelism.cp_load_balance)
            if self.dims.cp > 1 and self.mesh is not None
            else None
        )

        with torch.device("meta"):
            full = Transformer(self.args)
        self.n_params = sum(p.numel() for p in full.parameters())
        self.flops_per_token = flops_per_token(full, t.seq_len)
        self.pipeline: PipelineStep | None = None
        if self.dims.pp > 1:
            stages = build_stages(self.args, cfg.parallelism, self._dim("pp").get_local_rank())
            self.modules: list[Transformer] = stages.modules
        else:
            self.modules = [full]
        # Float8 swaps plain linear layers for torchao's, so it comes before TP plans, compile
        # and FSDP wrap them (tidal/train/float8.py).
        self.float8: Float8 | None = None
        for module in self.modules:
            self.float8 = convert_float8(
                module,
                cfg.quantize,
                device=self.device,
                fsdp=fsdp,
                state=self.float8,
                log=self.log,
            )
            if t.fuse_projections:  # refused with TP by check_job
                n = module.fuse_projections()
                self.log(f"fused projections in {n} of {2 * len(module.layers)} modules")
        for module in self.modules:
            parallelize(
                module,
                self.mesh,
                self.dims,
                cfg.parallelism,
                cfg.activation_checkpoint,
                compile=t.compile,
                compile_mode=t.compile_mode,
                compile_dynamic=t.compile_dynamic,
                param_dtype=torch.bfloat16 if bf16 else None,
                float8_tp=self.float8 is not None and self.float8.tp_styles,
            )
            module.to_empty(device=self.device)
            module.init_weights(seed=t.seed)
            module.train()
        self.model = self.modules[0]
        if self.dims.pp > 1:
            self.pipeline = PipelineStep(
                stages,
                self._dim("pp").get_group(),
                self.device,
                cfg.parallelism.pp_schedule,
                cfg.parallelism.microbatches,  # validated by check_layout
            )
        self.path = StepPath(
            model=self.model,
            args=self.args,
            mesh=self.mesh,
            cp=self.cp,
            device=self.device,
            autocast_dtype=self.autocast_dtype,
            loss_parallel=self.loss_parallel,
            grad_scale=self.grad_scale,
            batch_invariant=t.batch_invariant,
            document_mask=cfg.data.format == "chat",
            # The fused loss multiplies by the output weight itself: a plain matrix on this
            # rank (no TP sharding, no float8 layer), and no pipeline stage boundary.
            fused_loss=t.fused_loss
            and self.dims.tp == 1
            and self.dims.pp == 1
            and (self.model.output is None or type(self.model.output) is nn.Linear),
            pipeline=self.pipeline,
            moe_aux_coef=(
                t.moe_aux_loss_coef
                if self.args.moe is not None and self.args.moe.load_balance == "aux_loss"
                else 0.0
            ),
        )
        self.params = [p for m in self.modules for p in m.parameters()]
        self.optimizer = build_optimizer(self.modules, cfg.optimizer, self.device)
        self.peak_flops = peak_flops(self.device)
        self.step = 0
        self._first_step = 0
        self.train_iter = iter(self.data.train) if self.data.train is not None else None
        layout = ", ".join(f"{k}={v}" for k, v in self.dims.degrees.items() if v > 1) or "single"
        layout += f", ep={self.dims.ep}" if self.dims.ep > 1 else ""
        hf = cfg.checkpoint.initial_load_hf
        name = f"hf:{hf}" if hf else cfg.model.flavor  # the flavor is ignored for an HF model
        self.log(
            f"model {name}: {self.n_params / 1e6:.1f}M parameters, "
            f"vocab {self.args.vocab_size}, device {self.device}, precision {precision}, "
            f"compile {t.compile}, world {self.dist.world_size} ({layout})"
            + (", batch-invariant" if t.batch_invariant else "")
            + (f", {self.float8.describe()}" if self.float8 is not None else "")
        )
        self.checkpoint = Checkpointer(
            cfg.checkpoint,
            folder=checkpoint_folder(cfg.checkpoint, cfg.job.output_dir),
            modules=self.modules,
            optimizer=self.optimizer,
            loader=self.data.train,
            device=self.device,
            args=self.args,
            info={
                "model": model_info(self.args, name),
                "parallelism": {"world_size": self.dist.world_size, "degrees": self.dims.degrees},
            },
            lr_settings={**dataclasses.asdict(cfg.lr_scheduler), "total_steps": t.steps},
            tokenizer=cfg.data.tokenizer if cfg.data.tokenizer != "bpe" else self.data.tokenizer,
            log=self.log,
        )
        if self.plan is not None:
            self.step = self.checkpoint.load(self.plan)
        # Every rank agrees on a Ctrl-C stop through a host-side all-reduce (no device sync).
        self._stop_group = dist.new_group(backend="gloo") if self.dist.world_size > 1 else None

    # -- helpers -------------------------------------------------------------------------

    def _open_run_folder(self) -> None:
        """Lock the run folder (rank 0), pick the checkpoint to start from (every rank), and
        refuse a folder holding another run's metrics: all before any expensive work."""
        cfg, ckpt = self.cfg, self.cfg.checkpoint
        if ckpt.create_seed_checkpoint and self.dist.world_size > 1:
            raise ValueError(
                "checkpoint.create_seed_checkpoint runs in one process (it saves the unsharded "
                f"seed model); this run has {self.dist.world_size} ranks"
            )
        self._locks: list[RunLock] = []
        if self.dist.is_main:
            self._locks.append(RunLock(cfg.job.output_dir))
            folder = checkpoint_folder(ckpt, cfg.job.output_dir).resolve()
            if ckpt.enable and not folder.is_relative_to(Path(cfg.job.output_dir).resolve()):
                self._locks.append(RunLock(folder))  # a folder elsewhere is locked too
        try:
            self.plan = plan_load(
                ckpt,
                cfg.job.output_dir,
                self.args,
                cfg.model.flavor,
                total_steps=cfg.training.steps,
                log=self.log,
            )
            if self.dist.is_main:
                resuming = self.plan is not None and self.plan.resume
                check_fresh(cfg.job.output_dir, resuming=resuming, checkpointing=ckpt.enable)
        except BaseException:
            self._release_locks()
            raise

    def release_run_folder(self) -> None:
        """Wait for a background checkpoint save, then release the run folder (and the lock of
        a checkpoint folder outside it), keeping the model, the mesh and the process group:
        another Trainer of this process may then open the folder, as when several runs follow
        each other on the same ranks. `close` does this too but also leaves the process group,
        after which no trainer of the process can run."""
        self.checkpoint.finish()
        self._release_locks()

    def _release_locks(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks = []

    def _dim(self, name: str) -> DeviceMesh:
        assert self.mesh is not None, f"mesh dimension {name!r} needs a multi-rank run"
        return self.mesh[name]

    def _reduce(self, x: torch.Tensor, dim: str = "dp_cp") -> torch.Tensor:
        return self.path.reduce(x, dim)

    def autocast(self):
        return self.path.autocast()

    # -- one step ------------------------------------------------------------------------

    def next_batches(self) -> tuple[list[Batch], int, float]:
        """The micro-batches of one optimizer step on device, their count of valid labels
        (counted on the host, so the step needs no device sync), and the seconds spent."""
        if self.train_iter is None:
            raise ValueError(
                "this Trainer has no training data (its DataBundle.train is None): pass "
                "batches to train_step"
            )
        start = time.perf_counter()
        host = [next(self.train_iter) for _ in range(self.cfg.training.grad_accum_steps)]
        n_tokens = sum(int((b.labels != IGNORE_INDEX).sum()) for b in host)
        if self.device.type == "cuda":
            # Pinned: a non_blocking copy from pageable memory is staged by the driver, which
            # may wait for the stream, so the host could not run ahead of the device. From
            # pinned memory the copy is queued and the call returns. The pinned blocks come
            # from torch's caching host allocator, which reuses a block only after the copies
            # reading it have finished, so `host` may be dropped at once. Measured on an H200
            # (benchmarks/trainer.md, llama3_1b 4 x 4096): no throughput difference either way
            # there, where the GPU is the bound; kept for hosts that run ahead.
            batches = [b.pin_memory().to(self.device, non_blocking=True) for b in host]
        else:
            # On CPU the loader's tensors are used as they are (no copy; pinning needs CUDA).
            batches = [b.to(self.device) for b in host]
        return batches, n_tokens, time.perf_counter() - start

    def forward_loss(self, batch: Batch) -> torch.Tensor:
        """Summed token loss of one micro-batch (of this rank's slice under CP; no pipeline)."""
        return self.path.forward_loss(batch)

    def train_step(
        self, batches: list[Batch], n_tokens: int, loss: TokenLoss | None = None
    ) -> StepResult:
        """One optimizer step over `batches` (this rank's micro-batches, on the device).

        Args:
            batches: the micro-batches; every data-parallel rank passes as many, and under
                pipeline parallel all have one shape with rows divisible by
                `parallelism.pp_microbatches`.
            n_tokens: their valid labels (label != IGNORE_INDEX), counted on the host.
            loss: None for the cross entropy, the sum of token losses over all micro-batches
                and ranks / their number of valid tokens; or a `TokenLoss` called per
                micro-batch with its per-token log-probs (chunked, never fp32 logits of the
                whole vocabulary), its Batch (with `extras`) and the step's `StepNorms`. An
                injected loss is refused under context parallelism.

        Returns:
            StepResult: the loss (0-dim, not synced), the gradient norm before clipping, the
            tokens processed, and an injected loss's metrics reduced over micro-batches and
            data-parallel ranks (see StepResult.metrics).

        Raises:
            ValueError: an injected loss under context parallelism, or batches the pipeline
                cannot split.
        """
        with self.profiler.oom_guard():  # an allocator snapshot on OOM (profiler section)
            total, metrics = self.path.backward(batches, n_tokens, loss)
            max_norm = self.cfg.training.max_norm
            pp_group = self._dim("pp").get_group() if self.dims.pp > 1 else None
            grad_norm = clip_grad_norm(
                self.params, max_norm if max_norm > 0 else math.inf, pp_group=pp_group
            )
            self.checkpoint.wait_before_update()  # a staged save must have copied the weights
            self.optimizer.step()
            if self.path.moe_counts is not None:  # aux-loss-free balancing, if configured
                update_expert_bias(self.model, self.path.moe_counts)
            if self.float8 is not None:
                self.float8.after_optimizer_step(self.modules)  # FSDP float8 weight scales
            self.optimizer.zero_grad(set_to_none=True)
        tokens = sum(b.input_ids.numel() for b in batches) * self.dims.dp
        return StepResult(total, grad_norm, tokens, metrics)

    @contextlib.contextmanager
    def _eval_mode(self):
        modes = [m.training for m in self.modules]
        for m in self.modules:
            m.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for m, mode in zip(self.modules, modes, strict=True):
                m.train(mode)

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """Per-token log-probs of the labels under the current weights: fp32 [B, T],
        log p(labels[b, t] | input_ids[b, :t+1]), 0 where the label is IGNORE_INDEX. No grad,
        eval mode, the training step's precision and batch-invariant setting (so
        `training.batch_invariant` gives the RL generator's values bit for bit).

        Every rank calls it with its own batch (its data-parallel share) and gets that
        batch's values: under TP and PP on every rank of the group (PP: from the last stage,
        over the pipeline group), under CP for the whole sequences. Under PP the batch rows
        must divide into `parallelism.pp_microbatches`.

        Example (the old log-probs of an RL step, in the batches' own layout)::

            for b in batches:
                b.extras["old_logprobs"] = trainer.logprobs(b)
        """
        with self._eval_mode():
            return self.path.logprobs(batch)

    @torch.no_grad()
    def validate(self) -> float | None:
        """Mean token loss over the first `metrics.val_batches` validation batches of every
        data-parallel rank (None without a validation split, or under pipeline parallel on a
        torch without forward-only schedules)."""
        if self.data.val is None or (self.pipeline is not None and not self.pipeline.can_eval):
            return None
        loss_sum = torch.zeros((), device=self.device)
        n = 0
        with self._eval_mode():
            for batch in self.data.val.iter_epoch(0, max_batches=self.cfg.metrics.val_batches):
                n += int((batch.labels != IGNORE_INDEX).sum())
                loss_sum += self.path.validation_loss_sum(batch.to(self.device))
        loss_sum = self._reduce(self._reduce(loss_sum, "pp"))  # under PP only the last stage has it
        return float(loss_sum) / max(float(self.path.global_count(n)), 1.0)

    def train(self) -> dict:
        """Run the remaining steps up to `training.steps`; returns the last logged record (with
        "interrupted": True after a Ctrl-C in the loop; {} when nothing was trained). A Ctrl-C
        after the loop's last check sets `interrupt_after_loop` (the run is complete: what a
        caller runs next, such as `tidal train`'s end-of-run sample, should end at once)."""
        cfg = self.cfg
        total_steps, m = cfg.training.steps, cfg.metrics
        if self.train_iter is None and not cfg.checkpoint.create_seed_checkpoint:
            raise ValueError(
                "Trainer.train needs training data; this Trainer has none (DataBundle.train is "
                "None): call train_step with batches instead"
            )
        if cfg.checkpoint.create_seed_checkpoint:
            self.checkpoint.save(0, seed=True)
            self.log(f"checkpoint: seed checkpoint saved in {self.checkpoint.folder / 'step-0'}")
            return {}
        if self.step >= total_steps:
            self.log(
                f"nothing to train: the run is at step {self.step} of training.steps="
                f"{total_steps} (raise --training.steps to continue it)"
            )
            return {}
        resumed = self.plan is not None and self.plan.resume
        logger = (
            MetricsLogger(
                cfg.job.output_dir,
                tensorboard=m.tensorboard,
                resume_step=self.step if resumed else None,
                wandb=self._wandb_init(),
            )
            if self.dist.is_main
            else None
        )
        watch, last = Stopwatch(), {}
        window_tokens, window_steps, start = 0, 0, time.perf_counter()
        self._first_step = self.step  # a resumed run's ETA counts its own steps
        self.model.train()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        interrupted = False
        lr_start = self.checkpoint.lr_start  # the step the LR schedule (re)started at
        stop = StopOnInterrupt(self._stop_group, announce=self.dist.is_main)
        try:
            stop.install()
            self.profiler.start(self.step + 1)
            while self.step < total_steps:
                self.step += 1
                lr = cfg.optimizer.lr * wsd_multiplier(
                    self.step - lr_start, total_steps - lr_start, cfg.lr_scheduler
                )
                set_lr(self.optimizer, lr)
                self.profiler.step_begin(self.step)
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
                self.checkpoint.maybe_save(self.step, total_steps)
                self.profiler.step_done(self.step)
                if stop.requested():
                    interrupted = True
                    break
            if interrupted:
                if window_steps:  # the stopping step is logged even off the log interval
                    last = self._log_step(
                        logger, result, lr, window_tokens, window_steps, watch, start
                    )
                if self.checkpoint.saves_enabled and self.checkpoint.last_saved_step != self.step:
                    self.checkpoint.save(self.step)
            self.checkpoint.finish()
        except torch.OutOfMemoryError:  # in validation or a save (train_step has its own)
            self.profiler.on_oom()
            raise
        finally:
            self.profiler.stop()
            stop.uninstall()
            if logger is not None:
                logger.close()
        if interrupted:
            saved = ""
            if self.checkpoint.saves_enabled:
                saved = f"; checkpoint {self.checkpoint.folder / f'step-{self.step}'}"
            self.log(f"interrupted: stopped after step {self.step}/{total_steps}{saved}")
            last["interrupted"] = True
        self.interrupt_after_loop = stop.flag and not interrupted
        return last

    def _wandb_init(self) -> dict | None:
        """`wandb.init`'s arguments for `metrics.wandb`, or None when it is off."""
        m = self.cfg.metrics
        if not m.wandb:
            return None
        config = to_dict(self.cfg)
        config["run"] = {"world_size": self.dist.world_size, "n_params": self.n_params}
        return {
            "project": m.wandb_project,
            "entity": m.wandb_entity,
            "name": m.wandb_name or self.cfg.job.name,
            "config": config,
        }

    def _log_step(self, logger, result: StepResult, lr, tokens, steps, watch, start) -> dict:
        loss = float(result.loss)  # syncs the device: timing below covers all queued work
        grad_norm = float(result.grad_norm)
        elapsed = watch.reset()
        tps = tokens / elapsed
        tps_device = tps / self.dist.world_size
        tflops = tps_device * self.flops_per_token / 1e12
        record = {
            "step": self.step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": tps,
            "tokens_per_s_per_device": tps_device,
            "tflops": tflops,
            "mfu": tflops * 1e12 / self.peak_flops if self.peak_flops else None,
            "peak_memory_gib": peak_memory_gib(self.device),
            "data_wait_s": watch.totals.get("data_wait", 0.0) / steps,
            "elapsed_s": time.perf_counter() - start,
        }
        # A mixture of experts: the last step's routing (load balance, auxiliary loss).
        record |= {k: float(v) for k, v in result.metrics.items() if k.startswith("moe_")}
        if logger is None:
            return record
        first = self._first_step
        done = (self.step - first) / max(1, self.cfg.training.steps - first)
        eta = record["elapsed_s"] * (1 - done) / max(done, 1e-9)
        mfu = f" mfu {100 * record['mfu']:.1f}%" if record["mfu"] is not None else ""
        per_device = f" ({tps_device:,.0f}/device)" if self.dist.world_size > 1 else ""
        line = (
            f"step {self.step:>6}/{self.cfg.training.steps} loss {loss:7.4f} "
            f"gnorm {grad_norm:6.3f} lr {lr:.2e} tok/s {tps:,.0f}{per_device} "
            f"tflops {tflops:.1f}{mfu} mem {record['peak_memory_gib']:.2f}GiB "
            f"data {1000 * record['data_wait_s']:.1f}ms eta {eta:.0f}s"
        )
        if "moe_aux_loss" in record:
            line += f" moe load {record['moe_load_max']:.2f} aux {record['moe_aux_loss']:.3f}"
        logger.log(record, line)
        return record

    def _log_validation(self, logger) -> None:
        val = self.validate()
        if val is None or logger is None:
            return
        record = {"step": self.step, "val_loss": val, "val_ppl": math.exp(min(val, 50))}
        logger.log(record, f"step {self.step:>6} val_loss {val:.4f} ppl {record['val_ppl']:.1f}")

    def close(self) -> None:
        """Wait for a background checkpoint save, release the run folder, drop the model,
        optimizer and mesh, and leave the process group (multi-rank runs). The trainer is
        not usable afterwards: its communicators are gone with it, freed here rather than
        at interpreter exit (see tidal.parallel.launch.destroy_process_group)."""
        try:
            self.checkpoint.close()
        finally:
            self._release_locks()
            if getattr(self, "profiler", None) is not None:
                self.profiler.close()
            for name in (
                "model",
                "modules",
                "params",
                "optimizer",
                "pipeline",
                "path",
                "mesh",
                "cp",
                "checkpoint",
                "train_iter",
                "profiler",
            ):
                if hasattr(self, name):
                    setattr(self, name, None)
            destroy_process_group()
