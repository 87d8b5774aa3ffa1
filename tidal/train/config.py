"""Typed configuration of a training job: one dataclass per component.

A job's config is a `Config`; named configs are functions in tidal/train/configs.py, and the
command line overrides any field with `--section.field value` (tidal/train/config_parse.py).
Every field carries its documentation as the string under it; `tidal train --help` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tidal.models.flavors import FLAVORS
from tidal.parallel.config import ActivationCheckpointConfig, ParallelismConfig, require
from tidal.train.data.config import DataConfig


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """Where the job writes and what it runs on."""

    name: str = "debug"
    """Name of the run, printed in logs."""
    output_dir: str = "outputs/debug"
    """Directory of the run (metrics.jsonl, checkpoints, TensorBoard events, samples); created
    if missing. One run at a time holds it (a lock); a fresh run refuses a folder that holds
    an earlier run's metrics (resume that run with checkpoint.enable, or pick another)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to train on; auto picks cuda when available, else cpu."""
    cpu_kernels: Literal["auto", "portable"] = "auto"
    """CPU arithmetic. auto: the fastest kernels this CPU has (AVX-512 where there is), so a
    run's numbers differ between CPU models. portable: torch's and MKL's AVX2 kernels, the
    same bits on every x86-64 CPU with AVX2 for one torch version, so a CPU run repeats on
    another machine (tidal/train/cpu_kernels.py; `make demo` uses it)."""

    def __post_init__(self) -> None:
        require(
            self.device in ("auto", "cpu", "cuda"),
            f"job.device must be one of auto, cpu, cuda; got {self.device!r}",
        )
        require(
            self.cpu_kernels in ("auto", "portable"),
            f"job.cpu_kernels must be one of auto, portable; got {self.cpu_kernels!r}",
        )
        require(bool(self.output_dir), "job.output_dir must be a non-empty path")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which architecture to build."""

    flavor: str = "debug"
    """Named model shape from tidal/models/flavors.py (see `tidal models`)."""
    attention: Literal["sdpa", "flex"] = "sdpa"
    """sdpa: causal scaled_dot_product_attention (flash on GPU). flex: flex attention with
    document-causal masking, so packed documents do not attend to each other."""
    vocab_size: int | None = None
    """Override the flavor's vocabulary size (e.g. to match a small tokenizer); None keeps it."""
    moe_load_balance: Literal["aux_loss", "bias"] | None = None
    """Load balancing of a mixture-of-experts model (tidal/models/moe.py): aux_loss adds the
    router's auxiliary loss x training.moe_aux_loss_coef to the training loss (Switch/Qwen);
    bias moves a per-expert selection bias toward balance after each step (aux-loss-free,
    DeepSeek V3). None keeps the model's (aux_loss for every MoE flavor and Hugging Face
    Qwen 3 MoE). Refused for a dense model."""

    def __post_init__(self) -> None:
        require(
            self.flavor in FLAVORS,
            f"model.flavor {self.flavor!r} is unknown; choose one of {sorted(FLAVORS)}",
        )
        require(
            self.attention in ("sdpa", "flex"),
            f"model.attention must be one of sdpa, flex; got {self.attention!r}",
        )
        require(
            self.vocab_size is None or self.vocab_size > 0,
            f"model.vocab_size must be positive or none, got {self.vocab_size}",
        )
        require(
            self.moe_load_balance in (None, "aux_loss", "bias"),
            f"model.moe_load_balance must be one of aux_loss, bias or none; "
            f"got {self.moe_load_balance!r}",
        )


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """The optimisation loop."""

    steps: int = 1000
    """Optimizer steps to run."""
    batch_size: int = 8
    """Sequences per micro-batch on each device."""
    seq_len: int = 256
    """Tokens per sequence; must not exceed the model's max_seq_len."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step (loss normalised by all their tokens)."""
    max_norm: float = 1.0
    """Gradient clipping threshold on the global L2 norm; 0 disables clipping."""
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute precision: bf16 autocast with fp32 master weights, or plain fp32. auto is bf16
    on CUDA and fp32 on CPU."""
    compile: bool = False
    """torch.compile each transformer block. The loss is not affected: its per-chunk kernels
    are always compiled on CUDA and run eagerly on CPU (tidal/train/loss.py)."""
    compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = "default"
    """torch.compile mode for the blocks. max-autotune-no-cudagraphs benchmarks Triton
    templates against cuBLAS for each product at the first step (minutes longer to start)."""
    compile_dynamic: bool | None = None
    """torch.compile's `dynamic` for the blocks. None: the first shape is compiled static and
    a second one recompiles with dynamic sizes (torch's default); True: dynamic from the
    first call, for batches whose sequence length changes every step (the RL trainer)."""
    fuse_projections: bool = False
    """Compute Q, K and V as one product and W1 and W3 as another, with weights concatenated
    on each forward (`Transformer.fuse_projections`). Parameter names and checkpoints do not
    change. Applies to plain (not float8) linear layers; refused with tensor parallelism and
    batch-invariant mode. Under FSDP (bf16 parameters) or in fp32 it holds one more copy of
    each layer's projection weights until backward."""
    fused_loss: bool = True
    """Compute the default cross entropy together with the output projection, a chunk of
    rows at a time (`linear_cross_entropy_sum`), so the [tokens, vocabulary] logits and
    their gradient never exist whole. Applies without tensor or pipeline parallelism,
    batch-invariant mode or a converted (float8) output layer; elsewhere, and for injected
    (RL) losses, the logits are computed whole as before."""
    moe_aux_loss_coef: float = 1e-3
    """Weight of the router's auxiliary load-balancing loss (its mean over the MoE layers, 1.0
    when balanced) in the training loss of a mixture-of-experts model balanced by aux_loss;
    0 leaves it out (it is still logged as moe_aux_loss). Unused by dense models."""
    seed: int = 0
    """Seed for weight init, data order and sampling."""
    deterministic: bool = False
    """Use deterministic algorithms (slower); with a fixed seed, two runs match bitwise."""
    batch_invariant: bool = False
    """Run the model's forward passes (training step, `Trainer.logprobs`) with the fixed
    reduction orders of tidal/models/batch_invariant.py: the trainer's log-probs then equal
    the RL generator's (GeneratorConfig(batch_invariant=True)) bit for bit at the same
    weights and dtype, so on-policy importance ratios are exactly 1. Slower; needs sdpa
    attention, no context parallelism and no compile; tensor parallelism with
    `parallelism.loss_parallel=false` (FSDP, TP 2 and pipeline parallel keep the bits)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum_steps"):
            require(
                getattr(self, name) > 0,
                f"training.{name} must be positive, got {getattr(self, name)}",
            )
        require(self.max_norm >= 0, f"training.max_norm must be >= 0, got {self.max_norm}")
        require(
            self.moe_aux_loss_coef >= 0,
            f"training.moe_aux_loss_coef must be >= 0, got {self.moe_aux_loss_coef}",
        )
        require(
            self.compile_mode in ("default", "max-autotune-no-cudagraphs"),
            f"training.compile_mode must be default or max-autotune-no-cudagraphs, "
            f"got {self.compile_mode!r}",
        )
        require(
            self.mixed_precision in ("auto", "bf16", "fp32"),
            f"training.mixed_precision must be one of auto, bf16, fp32; "
            f"got {self.mixed_precision!r}",
        )


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """AdamW with decoupled weight decay."""

    lr: float = 3e-4
    """Peak learning rate (reached after warmup)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices; embeddings, norms and 1-D parameters get none."""
    implementation: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    """AdamW kernel: auto picks fused where the device supports it, else foreach."""
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype of AdamW's moment estimates (exp_avg, exp_avg_sq). bf16 halves optimizer-state
    memory (4 instead of 8 bytes per parameter) while parameters and gradients stay fp32: the
    moments are updated in fp32 and rounded to bf16 when stored. It runs tidal's per-tensor
    AdamW step on any device (optimizer.implementation is then ignored)."""

    def __post_init__(self) -> None:
        require(self.lr > 0, f"optimizer.lr must be positive, got {self.lr}")
        for name in ("beta1", "beta2"):
            require(
                0 <= getattr(self, name) < 1,
                f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}",
            )
        require(self.eps > 0, f"optimizer.eps must be positive, got {self.eps}")
        require(
            self.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {self.weight_decay}"
        )
        choices = ("auto", "fused", "foreach", "for_loop")
        require(
            self.implementation in choices,
            f"optimizer.implementation must be one of {', '.join(choices)}; "
            f"got {self.implementation!r}",
        )
        require(
            self.state_dtype in ("fp32", "bf16"),
            f"optimizer.state_dtype must be one of fp32, bf16; got {self.state_dtype!r}",
        )


@dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    """Warmup-stable-decay learning-rate schedule."""

    warmup_steps: int = 100
    """Steps of linear warmup from 0 to the peak learning rate."""
    decay_fraction: float = 0.2
    """Fraction of all steps spent decaying at the end (0: constant after warmup)."""
    decay_type: Literal["linear", "cosine", "sqrt"] = "linear"
    """Shape of the final decay."""
    min_lr_ratio: float = 0.0
    """Learning rate at the end, as a fraction of the peak."""

    def __post_init__(self) -> None:
        require(
            self.warmup_steps >= 0,
            f"lr_scheduler.warmup_steps must be >= 0, got {self.warmup_steps}",
        )
        require(
            0 <= self.decay_fraction <= 1,
            f"lr_scheduler.decay_fraction must be in [0, 1], got {self.decay_fraction}",
        )
        require(
            self.decay_type in ("linear", "cosine", "sqrt"),
            f"lr_scheduler.decay_type must be one of linear, cosine, sqrt; got {self.decay_type!r}",
        )
        require(
            0 <= self.min_lr_ratio <= 1,
            f"lr_scheduler.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}",
        )


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """What is measured and where it goes."""

    log_every: int = 10
    """Log loss, throughput and memory every this many steps (and at the last step)."""
    val_every: int = 100
    """Run validation every this many steps (and at the end); 0 disables it."""
    val_batches: int = 8
    """Validation micro-batches per evaluation."""
    tensorboard: bool = False
    """Also write TensorBoard events to <output_dir>/tb (needs the tensorboard package)."""
    wandb: bool = False
    """Also log every record to Weights & Biases (needs the wandb package: pip install
    tidal[wandb]); rank 0 only. The run's files go to <output_dir>/wandb, its id to
    <output_dir>/wandb_id.txt so a resumed run continues the same W&B run; offline clusters
    set WANDB_MODE=offline as usual."""
    wandb_project: str = "tidal"
    """W&B project of the run."""
    wandb_entity: str | None = None
    """W&B entity (user or team); None takes wandb's default."""
    wandb_name: str | None = None
    """W&B run name; None takes job.name."""

    def __post_init__(self) -> None:
        require(self.log_every > 0, f"metrics.log_every must be positive, got {self.log_every}")
        require(self.val_every >= 0, f"metrics.val_every must be >= 0, got {self.val_every}")
        require(
            self.val_batches > 0, f"metrics.val_batches must be positive, got {self.val_batches}"
        )


@dataclass(kw_only=True, slots=True)
class SampleConfig:
    """Text generated with the trained model at the end of the run."""

    prompt: str = "ROMEO:"
    """Prompt for the final sample."""
    max_new_tokens: int = 0
    """Tokens to generate after training; 0 skips sampling."""
    temperature: float = 0.8
    """Sampling temperature; 0 is greedy."""
    top_k: int = 50
    """Sample among the k most likely tokens; 0 disables the cut."""

    def __post_init__(self) -> None:
        require(
            self.max_new_tokens >= 0,
            f"sample.max_new_tokens must be >= 0, got {self.max_new_tokens}",
        )
        require(self.temperature >= 0, f"sample.temperature must be >= 0, got {self.temperature}")
        require(self.top_k >= 0, f"sample.top_k must be >= 0, got {self.top_k}")


CHECKPOINT_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Distributed checkpoints (DCP): save, resume, reshard. Field names follow torchtitan's;
    docs/checkpoint.md describes the folder layout, resume and crash safety."""

    enable: bool = False
    """Save checkpoints every `interval` steps, at the last step and on Ctrl-C, and resume from
    the newest complete one in `folder` at start."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.output_dir (or absolute); holds one step-N folder per
    checkpoint."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 10
    """Keep the newest k complete checkpoints, deleting older ones after each save; 0 keeps all."""
    load_step: int = -1
    """Resume from the checkpoint of this step; -1 takes the newest complete one."""
    load_only: bool = False
    """Load checkpoints but never save any (evaluation, debugging)."""
    exclude_from_loading: str = ""
    """Comma list of states not to restore on resume, from optimizer, lr_scheduler (the
    schedule restarts over the remaining steps), dataloader, train_state (the step restarts
    at 0), rng. The model is always loaded."""
    last_save_model_only: bool = False
    """The save at the last step holds the model only (in export_dtype), not optimizer, data
    position and RNG; such a checkpoint cannot be resumed. torchtitan defaults to true; tidal
    keeps the last checkpoint resumable unless asked."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the model in a last_save_model_only checkpoint."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """disabled: the step waits for the whole save. async: the state is copied to host memory
    in the step, then written by a background thread. async_with_pinned_mem: the copy goes to
    pinned host buffers reused across saves, queued on a side CUDA stream; the step continues
    and only the next optimizer step waits for the copy."""
    checksums: bool = True
    """Write a CRC32 of every 64 MiB of each saved chunk into the COMPLETE marker and check the
    chunks a load reads against them, so that damaged bytes of the right size fail the load
    naming the file and key. Costs a read-back of the files at commit (the pinned mode's
    writer process hashes as it writes instead) and a pass over the bytes at load, on up to
    8 threads (benchmarks/checkpoint.md has the H200 figures)."""
    initial_load_path: str | None = None
    """A checkpoint folder (a step-N folder, e.g. of another run) to start from when `folder`
    holds no complete checkpoint: fine-tuning. Ignored when resuming. Needs `enable`."""
    initial_load_model_only: bool = True
    """From initial_load_path load the model only (optimizer and step start fresh); false
    restores everything in it."""
    initial_load_layout: Literal["auto", "tidal", "torchtitan"] = "auto"
    """The order of initial_load_path's weights: auto takes the one its tidal.json records
    (a DCP folder without one, e.g. torchtitan's, is refused: name it); torchtitan for a
    checkpoint torchtitan saved (its Llama's q/k rows are reordered as they load; only the
    model loads)."""
    create_seed_checkpoint: bool = False
    """Initialize the model in one process, save it as step-0 (model only) in `folder`, and exit
    without training; runs on any layout can then start from the same weights."""
    initial_load_hf: str | None = None
    """A Hugging Face folder (config.json and safetensors, one file or sharded) to start from:
    the architecture comes from its config.json (model.flavor is then ignored) and the
    weights replace the seed init, each rank reading only the slices its FSDP/TP/pipeline
    shards hold. data.tokenizer 'bpe' (the default) becomes the folder's tokenizer.json. Works
    without checkpoint.enable; with it, a run whose folder holds a checkpoint resumes from
    that instead (the architecture still comes from here)."""
    last_save_in_hf: bool = False
    """Also write the last save of the run as a Hugging Face folder, `<folder>/step-N-hf`
    (config.json, model.safetensors in export_dtype, and the tokenizer files), which
    transformers and tidal's load_hf read. Made by rank 0 from the checkpoint just saved, so
    any layout works; an earlier export of the same step is replaced."""

    def __post_init__(self) -> None:
        require(self.interval > 0, f"checkpoint.interval must be positive, got {self.interval}")
        require(
            self.keep_latest_k >= 0,
            f"checkpoint.keep_latest_k must be >= 0 (0 keeps all), got {self.keep_latest_k}",
        )
        require(
            self.load_step >= -1,
            f"checkpoint.load_step must be -1 (the newest) or a step >= 0, got {self.load_step}",
        )
        require(bool(self.folder), "checkpoint.folder must be a non-empty path")
        for name in self.excluded:
            require(
                name in CHECKPOINT_STATES,
                f"checkpoint.exclude_from_loading: {name!r} is not a state; choose from "
                f"{', '.join(CHECKPOINT_STATES)} (the model is always loaded)",
            )
        require(
            self.export_dtype in EXPORT_DTYPES,
            f"checkpoint.export_dtype must be one of {', '.join(EXPORT_DTYPES)}; "
            f"got {self.export_dtype!r}",
        )
        require(
            self.async_mode in ASYNC_MODES,
            f"checkpoint.async_mode must be one of {', '.join(ASYNC_MODES)}; "
            f"got {self.async_mode!r}",
        )
        require(
            self.enable or not self.create_seed_checkpoint,
            "checkpoint.create_seed_checkpoint needs --checkpoint.enable true",
        )
        require(
            self.initial_load_path is None or bool(self.initial_load_path),
            "checkpoint.initial_load_path must be a path or none",
        )
        require(
            self.initial_load_hf is None or bool(self.initial_load_hf),
            "checkpoint.initial_load_hf must be a path or none",
        )
        require(
            not (self.initial_load_hf and self.initial_load_path),
            "checkpoint.initial_load_hf and checkpoint.initial_load_path are both set; start "
            "from one of them",
        )
        require(
            self.enable or not self.initial_load_path,
            "checkpoint.initial_load_path needs --checkpoint.enable true (without it the run "
            "would start from the seed init); for Hugging Face weights use "
            "--checkpoint.initial_load_hf",
        )
        require(
            self.initial_load_layout in ("auto", "tidal", "torchtitan"),
            "checkpoint.initial_load_layout must be auto, tidal or torchtitan; got "
            f"{self.initial_load_layout!r}",
        )
        require(
            self.enable or not self.last_save_in_hf,
            "checkpoint.last_save_in_hf needs --checkpoint.enable true (it exports the last save)",
        )
        require(
            not (self.load_only and self.last_save_in_hf),
            "checkpoint.last_save_in_hf with checkpoint.load_only: a load-only run saves nothing",
        )
        require(
            not (self.create_seed_checkpoint and self.initial_load_hf),
            "checkpoint.create_seed_checkpoint saves the seed initialization; it cannot start "
            "from checkpoint.initial_load_hf (convert the folder with `tidal convert hf-to-dcp`)",
        )

    @property
    def excluded(self) -> list[str]:
        """exclude_from_loading as a list of state names."""
        return [s.strip() for s in self.exclude_from_loading.split(",") if s.strip()]


FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")


@dataclass(kw_only=True, slots=True)
class QuantizeConfig:
    """Float8 training of the linear layers with torchao (pip install torchao==0.18.0).
    Optional: torchao is imported only when float8 is on; docs/training.md#float8."""

    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    """none: every linear layer in the training precision. tensorwise: each selected linear
    layer casts its input, weight and output gradient to float8 with one dynamic scale per
    tensor (the fastest recipe on Hopper). rowwise: one scale per row (more accurate, slower).
    Master weights, gradients and optimizer states stay as they were. On CPU it runs torchao's
    emulated path (the same casts and scales, matmuls in high precision: for tests, not
    speed); on CUDA it needs compute capability 8.9 or newer (Ada, Hopper)."""
    float8_output: bool = False
    """Convert the output projection (the LM head) too. Left in the training precision by
    default: torchtitan on an H200 was faster and smaller that way (llama3 1B, tensorwise:
    68.1k tok/s at 43.0 GiB, against 57.8k at 61.2 GiB with the output in float8)."""
    float8_min_dim: int = 64
    """Leave a linear layer in high precision when its in_features or out_features is below
    this; layers whose dims are not multiples of 16 (what float8 GEMMs need) always stay."""
    float8_skip: str = ""
    """Comma list of module names kept in high precision, each matching that module and
    everything under it, e.g. "layers.0,layers.15.feed_forward"."""
    float8_fsdp_all_gather: bool | None = None
    """Under FSDP, all-gather the converted weights in float8 (half the bytes of bf16), with
    their scales computed in one all-reduce after each optimizer step. None: on for
    tensorwise, off for rowwise; true with rowwise is refused (torchao all-gathers tensorwise
    float8 only). Ignored without FSDP."""

    def __post_init__(self) -> None:
        require(
            self.float8 in FLOAT8_RECIPES,
            f"quantize.float8 must be one of {', '.join(FLOAT8_RECIPES)}; got {self.float8!r}",
        )
        require(
            self.float8_min_dim >= 0,
            f"quantize.float8_min_dim must be >= 0, got {self.float8_min_dim}",
        )
        require(
            not (self.float8 == "rowwise" and self.float8_fsdp_all_gather),
            "quantize.float8_fsdp_all_gather=true needs quantize.float8=tensorwise: torchao "
            "all-gathers float8 weights with one scale per tensor only (rowwise scales are "
            "per row); leave it unset or false with rowwise",
        )

    @property
    def enabled(self) -> bool:
        return self.float8 != "none"

    @property
    def skipped(self) -> list[str]:
        """float8_skip as a list of module names."""
        return [s.strip() for s in self.float8_skip.split(",") if s.strip()]


# -- debugging tools (tidal/train/profiling.py, tidal/parallel/launch.py; docs/debugging.md) --


@dataclass(kw_only=True, slots=True)
class ProfilerConfig:
    """The torch profiler trace of chosen steps and CUDA memory snapshots
    (tidal/train/profiling.py). Off by default. Under `tidal rl` every role traces the same
    window of RL steps into a folder of its own, <folder>/trainer and <folder>/generator<g>
    (tidal/rl/distributed/profile.py; benchmarks/rl_timeline.py merges them)."""

    enable: bool = False
    """Trace steps start_step..end_step with torch.profiler (CPU, and CUDA kernels on a GPU)
    and write, per rank, a Chrome/Perfetto trace <folder>/rank<R>_step<N>-<M>.json and the
    top operators by self time, rank<R>_step<N>-<M>.txt. The step before start_step runs as
    the profiler's warm-up, not recorded."""
    start_step: int = 5
    """First traced step (steps count from 1)."""
    end_step: int = 6
    """Last traced step, inclusive."""
    folder: str = "profile"
    """Folder of traces and memory snapshots, relative to job.output_dir (or absolute)."""
    record_shapes: bool = True
    """Record the input shapes of each operator in the trace."""
    with_stack: bool = False
    """Record the Python stack of each operator (larger traces)."""
    table: bool = True
    """Also write the top operators table (.txt) next to each trace. Building it parses every
    event in Python: about a minute for 100,000 events, where the trace itself takes a
    second or two; turn it off for long windows (the timeline of `tidal rl`'s roles needs
    only the traces)."""
    memory_snapshot: bool = False
    """Record the CUDA caching allocator's history from the model build on, and write
    snapshots <folder>/memory/rank<R>_step<N>.pickle after each of memory_snapshot_steps and
    rank<R>_oom.pickle when a CUDA out-of-memory error ends the step (the error is raised
    again). Open them at https://pytorch.org/memory_viz. CUDA only: on a CPU run it is
    ignored with a warning."""
    memory_snapshot_steps: str = "1,2"
    """Comma list of steps after which a memory snapshot is written (the first step holds the
    optimizer states' allocation, the second a steady step); empty: on OOM only."""
    memory_snapshot_entries: int = 100_000
    """Allocator events kept in the history (a ring buffer): more shows further back."""

    def __post_init__(self) -> None:
        require(self.start_step >= 1, f"profiler.start_step must be >= 1, got {self.start_step}")
        require(
            self.end_step >= self.start_step,
            f"profiler.end_step={self.end_step} must be >= profiler.start_step={self.start_step}",
        )
        require(bool(self.folder), "profiler.folder must be a non-empty path")
        require(
            self.memory_snapshot_entries > 0,
            f"profiler.memory_snapshot_entries must be positive, got "
            f"{self.memory_snapshot_entries}",
        )
        for item in self.memory_snapshot_steps.split(","):
            require(
                not item.strip() or (item.strip().isdigit() and int(item) >= 1),
                f"profiler.memory_snapshot_steps must be a comma list of steps >= 1, got "
                f"{self.memory_snapshot_steps!r}",
            )

    @property
    def snapshot_steps(self) -> frozenset[int]:
        """memory_snapshot_steps as a set of steps."""
        return frozenset(int(s) for s in self.memory_snapshot_steps.split(",") if s.strip())


@dataclass(kw_only=True, slots=True)
class DebugConfig:
    """Distributed debugging: PyTorch's NCCL Flight Recorder (tidal/parallel/launch.py)."""

    flight_recorder: bool = True
    """On NCCL jobs (CUDA, more than one rank) keep each rank's last collectives in a ring
    buffer and write it to flight_recorder_folder when the NCCL watchdog sees a timeout or an
    error: tidal sets TORCH_FR_BUFFER_SIZE (and its older name TORCH_NCCL_TRACE_BUFFER_SIZE),
    TORCH_NCCL_DUMP_ON_TIMEOUT=1 and TORCH_FR_DUMP_TEMP_FILE (and
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE) before the process group starts. A variable the user set
    is left alone. Read the dumps with `torchfrtrace <folder> --prefix rank_`."""
    flight_recorder_folder: str = "flight_recorder"
    """Folder of the Flight Recorder dumps (rank_<R>), relative to job.output_dir (or
    absolute)."""
    flight_recorder_entries: int = 2000
    """Collectives kept per rank in the ring buffer."""

    def __post_init__(self) -> None:
        require(bool(self.flight_recorder_folder), "debug.flight_recorder_folder must be a path")
        require(
            self.flight_recorder_entries > 0,
            f"debug.flight_recorder_entries must be positive, got {self.flight_recorder_entries}",
        )


@dataclass(kw_only=True, slots=True)
class Config:
    """A whole training job."""

    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig
    )
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def __post_init__(self) -> None:
        hf = self.checkpoint.initial_load_hf
        if hf:
            # The architecture and the tokenizer come from the Hugging Face folder: seq_len is
            # checked against its config.json when the model is built (checkpoint/hf.py).
            if self.data.tokenizer == "bpe":
                self.data.tokenizer = str(Path(hf).expanduser() / "tokenizer.json")
            return
        max_len = FLAVORS[self.model.flavor].max_seq_len
        require(
            self.training.seq_len <= max_len,
            f"training.seq_len={self.training.seq_len} exceeds the max_seq_len={max_len} of "
            f"model.flavor {self.model.flavor!r}",
        )
