"""Typed configuration of an RL job: one dataclass per component, as for training.

An RL job's config is an `RLConfig`; named configs are functions in tidal/rl/configs.py, and
the command line overrides any field with `--section.field value` (tidal/train/config_parse.py,
the same parser as `tidal train`). Sections shared with training reuse its dataclasses
(`job`, `model`, `optimizer`, `lr_scheduler`, `parallelism`, `activation_checkpoint`,
`profiler`: every role's trace of a window of steps, tidal/rl/distributed/profile.py) and
`loss` is `tidal.rl.loss.LossConfig`; the rest are here. Every field carries its documentation
as the string under it; `tidal rl --help` prints it.

Checks that need no file, model or process live in `__post_init__`; those that do (the task
exists, the tokenizer covers its text, the store answers) run in
`tidal.rl.distributed.launch.check_rl_job` before any role starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tidal.parallel.config import ActivationCheckpointConfig, ParallelismConfig, require
from tidal.rl.loss import LossConfig
from tidal.train.config import (
    JobConfig,
    ModelConfig,
    OptimizerConfig,
    ProfilerConfig,
    SchedulerConfig,
)
from tidal.train.data.config import default_cache_dir

INIT_KINDS = ("sft", "checkpoint", "hf", "seed")


@dataclass(kw_only=True, slots=True)
class PolicyConfig:
    """Where the policy's first weights, tokenizer and chat template come from."""

    init: str = "sft:sft_addition"
    """"sft:NAME": the final checkpoint of `tidal train --config NAME`, trained the first time
    and cached under cache_dir (keyed by the resolved SFT config, less the settings that never
    change the weights: profiler, debug, W&B and TensorBoard, float8 when off) for every
    later run.
    "hf:PATH": a Hugging Face folder of a Llama or Qwen 3 model (e.g. `tidal fetch
    smollm2-135m`'s), its architecture from its config.json, with the folder's tokenizer.json
    and chat template. "checkpoint:PATH": a tidal checkpoint (a step-N folder, or a folder of
    them: the newest), its model a flavor named or matched by its tidal.json; set
    `tokenizer`. "seed": the seed initialization of model.flavor (throughput runs, tests)."""
    tokenizer: str = ""
    """For checkpoint: and seed: a tokenizer.json path, or "sft:NAME" for that config's
    tokenizer. sft: and hf: bring their own (leave it empty; for hf: it replaces the
    folder's)."""
    chat_template: str = ""
    """How prompts are rendered, as `data.chat_template` of training: empty takes the
    tokenizer's own (tokenizer_config.json beside it) or the built-in ChatML template that
    tidal's SFT uses; "builtin"; or a template file."""
    sft_overrides: str = ""
    """For sft:NAME, overrides of that training config as section.field=value words
    ("training.steps=200 optimizer.lr=2e-3"); they are part of the cache key."""
    cache_dir: str = field(default_factory=default_cache_dir)
    """tidal's cache: cached SFT warm starts (<cache_dir>/warmstart), BPE tokenizers, data
    (default: $TIDAL_CACHE_DIR, else ~/.cache/tidal)."""

    def __post_init__(self) -> None:
        kind = self.init.partition(":")[0]
        require(
            kind in INIT_KINDS and (kind == "seed") == (self.init == "seed"),
            f"policy.init must be sft:NAME, checkpoint:PATH, hf:PATH or seed; got {self.init!r}",
        )
        require(
            kind == "seed" or bool(self.init.partition(":")[2]),
            f"policy.init {self.init!r} needs a name or path after '{kind}:'",
        )
        require(
            kind not in ("checkpoint", "seed") or bool(self.tokenizer),
            f"policy.init={self.init!r} needs policy.tokenizer (a tokenizer.json, or sft:NAME)",
        )
        require(bool(self.cache_dir), "policy.cache_dir must be a non-empty path")

    @property
    def kind(self) -> str:
        return self.init.partition(":")[0]

    @property
    def source(self) -> str:
        return self.init.partition(":")[2]


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """The task rollouts are drawn from and graded by (tidal/rl/tasks)."""

    name: str = "addition"
    """A registered task (`tidal.rl.tasks.TASKS`: addition, countdown, gsm_symbolic, or one
    registered by a module that the config imports)."""
    params: dict[str, Any] = field(default_factory=dict)
    """The task's parameters, JSON on the command line: '{"digits": [1, 3]}'."""
    eval_problems: int = 200
    """Held-out problems scored greedily for eval_pass1 (a fixed set: task.eval_set)."""
    eval_seed: int = 0
    """Seed of the held-out set."""

    def __post_init__(self) -> None:
        require(bool(self.name), "task.name must be a registered task name")
        require(isinstance(self.params, dict), f"task.params must be a dict, got {self.params!r}")
        require(self.eval_problems > 0, f"task.eval_problems must be > 0, got {self.eval_problems}")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """What each step samples."""

    prompts_per_step: int = 16
    """Prompts per step, over all generators (each gets an equal share)."""
    group_size: int = 8
    """Samples per prompt (GRPO's group)."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling cut; 1 keeps all tokens."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    max_new_tokens: int = 128
    """Most tokens per completion; longer ones are cut (and count as truncated)."""
    max_prompt_tokens: int = 128
    """Longest rendered prompt (chat template included) a task may yield; a longer one is an
    error. Sizes the generator's KV cache and the trainer's sequences with max_new_tokens."""
    seed: int = 0
    """Seeds the training problems and the sampling noise; step s of generator g draws the
    same problems and tokens for the same seed whatever ran before (resumable)."""
    max_context: int = 0
    """Multi-turn environments (tidal/rl/envs): most tokens of a whole trajectory (opening,
    every turn and observation; max_new_tokens bounds each turn). Sizes the generator's KV
    cache and the trainer's sequences; a longer conversation ends truncated. 0: one turn's
    worth, max_prompt_tokens + max_new_tokens."""

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "group_size", "max_new_tokens", "max_prompt_tokens"):
            require(
                getattr(self, name) > 0, f"rollout.{name} must be > 0, got {getattr(self, name)}"
            )
        one_turn = self.max_prompt_tokens + self.max_new_tokens
        require(
            self.max_context == 0 or self.max_context >= one_turn,
            f"rollout.max_context must be 0 or at least max_prompt_tokens + max_new_tokens = "
            f"{one_turn}, got {self.max_context}",
        )
        require(self.temperature > 0, f"rollout.temperature must be > 0, got {self.temperature}")
        require(0 < self.top_p <= 1, f"rollout.top_p must be in (0, 1], got {self.top_p}")
        require(self.top_k >= 0, f"rollout.top_k must be >= 0, got {self.top_k}")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """The trainer role: the tidal Trainer's step over the rollouts."""

    micro_batch_size: int = 32
    """Sequences per forward/backward on each data-parallel rank; a step accumulates over
    all of its rollouts (one optimizer step per RL step)."""
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """As training.mixed_precision: auto is bf16 on CUDA and fp32 on CPU."""
    compile: bool = False
    """torch.compile each transformer block, with dynamic sizes (every step's rollouts have
    their own length: one compile serves them all)."""
    max_norm: float = 1.0
    """Gradient clipping on the global L2 norm; 0 disables it."""
    seed: int = 0
    """Seed of the trainer (weight init for policy.init=seed)."""
    deterministic: bool = False
    """Deterministic algorithms (slower)."""
    sm_percent: int = 100
    """Under CUDA MPS (rl.mps), the share of the GPU's SMs the trainer's kernels may use, in
    percent: `tidal rl` sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for its processes (roles
    started by hand set it themselves); 100 is all of them. On a GPU shared with the
    generators, a share below 100 keeps SMs free for their decode kernels, so the two roles'
    kernels run at the same time (docs/rl.md, "One GPU for every role")."""

    def __post_init__(self) -> None:
        require(
            1 <= self.sm_percent <= 100,
            f"trainer.sm_percent must be in 1..100, got {self.sm_percent}",
        )
        require(
            self.micro_batch_size > 0,
            f"trainer.micro_batch_size must be > 0, got {self.micro_batch_size}",
        )
        require(self.max_norm >= 0, f"trainer.max_norm must be >= 0, got {self.max_norm}")
        require(
            self.mixed_precision in ("auto", "bf16", "fp32"),
            "trainer.mixed_precision must be one of auto, bf16, fp32; got "
            f"{self.mixed_precision!r}",
        )


@dataclass(kw_only=True, slots=True)
class GeneratorRoleConfig:
    """The generator role: processes running tidal.generate.Generator and the task's grader."""

    count: int = 1
    """Generators `tidal rl` starts (on a cluster, one `tidal rl generator --index i` command
    each, under torchrun for a generator of several ranks), and how many the trainer waits for
    before its first step. Membership is dynamic after that: generators may join late (any
    unused --index) or leave, and the trainer goes on while rl.min_generators are live
    (docs/rl.md, "Faults and membership")."""
    tp: int | tuple[int, ...] = 1
    """Each generator's layout: its tensor-parallel degree, the ranks it runs on (heads, kv
    heads, MLP columns and vocabulary split over them; weights read shard by shard from the
    store). One int for every generator, or one per generator ("2,1": generator 0 on 2
    ranks, generator 1 on one). docs/rl.md, "Generator layouts"."""
    max_batch: int = 128
    """KV-cache rows of each generator: samples decoded at once."""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Weights' dtype in the generator: auto is bf16 on CUDA and fp32 on CPU. An fp32 trainer
    publishes bf16 weights when this is bf16."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the generators (auto: cuda when available)."""
    batch_invariant: bool = False
    """Fixed reduction orders: the generator's log-probs equal the trainer's bitwise (slower;
    docs/generate.md)."""
    compile: bool | None = None
    """torch.compile each decode step (one per batch bucket and sampler) and the prefill.
    None: on for CUDA outside batch-invariant mode and tensor parallelism. Each compile costs
    seconds to minutes at the first batch that needs it; false keeps the CUDA graphs of the
    eager kernels (captured in milliseconds)."""
    cuda_graphs: bool | None = None
    """Replay each decode step as a CUDA graph. None: on for CUDA without tensor parallelism."""
    compile_scope: Literal["step", "blocks"] = "step"
    """What generator.compile compiles: "step", each decode step whole per batch bucket and
    sampler (the fastest steps; every compile traces every layer: minutes of cold compiles
    for a 30-layer model); "blocks", one transformer block shared by every layer, plus the
    sampler, the rest eager, the step still replayed as a CUDA graph (a block's compile per
    shape instead of the model's per bucket and sampler; GeneratorConfig.compile_scope,
    docs/generate.md)."""
    sm_percent: int = 100
    """Under CUDA MPS (rl.mps), the share of the GPU's SMs each generator's kernels may use,
    in percent, as trainer.sm_percent; 100 is all of them."""

    def __post_init__(self) -> None:
        require(self.count >= 1, f"generator.count must be >= 1, got {self.count}")
        require(
            1 <= self.sm_percent <= 100,
            f"generator.sm_percent must be in 1..100, got {self.sm_percent}",
        )
        degrees = (self.tp,) if isinstance(self.tp, int) else tuple(self.tp)
        require(
            isinstance(self.tp, int) or len(degrees) == self.count,
            f"generator.tp lists {len(degrees)} degree(s) {','.join(map(str, degrees))} for "
            f"generator.count={self.count} generators: give one int for all, or one per generator",
        )
        require(
            all(isinstance(d, int) and d >= 1 for d in degrees),
            f"generator.tp degrees must be integers >= 1, got {self.tp!r}",
        )
        require(self.max_batch >= 1, f"generator.max_batch must be >= 1, got {self.max_batch}")
        require(
            self.dtype in ("auto", "fp32", "bf16"),
            f"generator.dtype must be one of auto, fp32, bf16; got {self.dtype!r}",
        )
        require(
            self.compile_scope in ("step", "blocks"),
            f"generator.compile_scope must be one of step, blocks; got {self.compile_scope!r}",
        )
        require(
            self.device in ("auto", "cpu", "cuda"),
            f"generator.device must be one of auto, cpu, cuda; got {self.device!r}",
        )

    def tp_of(self, index: int) -> int:
        """The tensor-parallel degree (ranks) of generator `index`; 1 for an index past a
        per-generator list (a generator joining late runs on one rank unless all do)."""
        if isinstance(self.tp, int):
            return self.tp
        return self.tp[index] if index < len(self.tp) else 1


@dataclass(kw_only=True, slots=True)
class LoopConfig:
    """The schedule of the roles and how long anyone waits for anyone."""

    mode: Literal["sync", "async"] = "sync"
    """sync: strictly on-policy; rollouts of step s come from policy version s - 1 and each
    role waits for the other. async: generators never wait for weights (they prefetch the
    newest version in the background and switch to it between decode steps, mid-sequence),
    the trainer takes rollouts from a bounded queue as they arrive, tokens older than
    max_staleness versions are dropped, and the rest are corrected per token by the loss's
    tis_cap or mask band (one of them is required). docs/rl.md, "Asynchronous mode"."""
    max_staleness: int = 2
    """async: versions a token may lag the policy it is trained at. The trainer at step s
    holds version s - 1; a sample with any token older than s - 1 - max_staleness is dropped
    (with its group), counted and reported. 0 keeps only tokens of the current version. The
    default covers one queue slot per generator plus a prefetch miss (see queue_depth)."""
    queue_depth: int | None = None
    """async: rollout batches that may wait in the store untaken, over all generators; each
    generator gets queue_depth // generator.count of them (at least 1) and idles, counted,
    when its share is full. None: one per generator. A generator with q slots runs q batches
    ahead of the trainer, so its tokens lag about q versions (q + 1 when the next version
    was not yet staged at a batch start): keep max_staleness >= q."""
    batches_in_flight: int = 1
    """async: rollout batches a generator decodes at once. With 2, the next batch's groups
    take the KV-cache rows the current batch's finished samples free (Generator.stream), so
    the decode batch stays full instead of shrinking to one batch's longest samples; tokens
    then lag one version more (keep max_staleness >= queue slots + 2). It pays where decoding
    is latency-bound on a GPU of its own; on one H200 shared with the trainer it was slower
    (more rows and prefills per batch: benchmarks/rl.md), hence 1."""
    steps: int = 20
    """Optimizer steps (policy versions 1..steps are published)."""
    eval_every: int = 5
    """eval_pass1 on the held-out set every this many versions (and at versions 0 and the
    last); 0 evaluates only at the start and the end."""
    wait_timeout_s: float = 600.0
    """Longest wait for another role's next output (a policy version, rollouts, an eval)
    before giving up with an error naming it."""
    heartbeat_s: float = 1.0
    """Each role announces itself in the store this often."""
    dead_after_s: float = 6.0
    """The trainer silent for this long is taken for dead: the generators stop with an error
    naming it (within about dead_after_s + 2 heartbeat_s of its death)."""
    lost_after_s: float = 3.0
    """A generator silent for this long is lost: the trainer drops it, says so, and goes on
    with the others (within about lost_after_s + 2 heartbeat_s of its death); one that beats
    again later is taken back."""
    min_generators: int = 1
    """The trainer stops with an error when fewer generators than this are live (a lost one
    counts until dead_after_s: it may come back; at the start the trainer waits up to
    wait_timeout_s for generator.count of them)."""
    mps: bool = False
    """`tidal rl` runs its roles under a CUDA MPS control daemon of their own (started before
    them, quit after them; needs nvidia-cuda-mps-control, from the NVIDIA driver). Roles
    sharing a GPU then run their kernels at the same time instead of taking turns;
    trainer.sm_percent and generator.sm_percent split its SMs between them. Roles started by
    hand use the daemon their environment names (CUDA_MPS_PIPE_DIRECTORY), if any."""

    def __post_init__(self) -> None:
        require(self.mode in ("sync", "async"), f"rl.mode must be sync or async, got {self.mode!r}")
        require(
            self.max_staleness >= 0,
            f"rl.max_staleness must be >= 0 (how many policy versions a token may lag the "
            f"trainer; 0 keeps only the current version), got {self.max_staleness}",
        )
        require(
            self.queue_depth is None or self.queue_depth >= 1,
            f"rl.queue_depth must be None or >= 1, got {self.queue_depth}",
        )
        require(
            self.batches_in_flight >= 1,
            f"rl.batches_in_flight must be >= 1, got {self.batches_in_flight}",
        )
        require(self.steps > 0, f"rl.steps must be > 0, got {self.steps}")
        require(self.eval_every >= 0, f"rl.eval_every must be >= 0, got {self.eval_every}")
        for name in ("wait_timeout_s", "heartbeat_s", "dead_after_s", "lost_after_s"):
            require(getattr(self, name) > 0, f"rl.{name} must be > 0, got {getattr(self, name)}")
        for name in ("dead_after_s", "lost_after_s"):
            require(
                getattr(self, name) > 2 * self.heartbeat_s,
                f"rl.{name}={getattr(self, name)} must exceed twice rl.heartbeat_s="
                f"{self.heartbeat_s}",
            )
        require(
            self.min_generators >= 1, f"rl.min_generators must be >= 1, got {self.min_generators}"
        )


@dataclass(kw_only=True, slots=True)
class RLMetricsConfig:
    """What the user sees besides the per-step line and metrics.jsonl."""

    tensorboard: bool = False
    """Also write TensorBoard events to <output_dir>/tb."""
    plot: bool = True
    """Write <output_dir>/rl.png (reward and eval_pass1 against step) at the end (needs
    matplotlib: pip install 'tidal[plot]')."""


@dataclass(kw_only=True, slots=True)
class RLCheckpointConfig:
    """Policy checkpoints, through tidal's checkpoint code (tidal/train/checkpoint)."""

    enable: bool = True
    """Save the policy (model, optimizer, step) in <output_dir>/checkpoint/step-N every
    `interval` steps and at the last; a rerun of the same output_dir resumes there."""
    interval: int = 0
    """Save every this many steps; 0 saves only at the last step."""
    keep_latest_k: int = 2
    """Keep the newest k checkpoints; 0 keeps all."""

    def __post_init__(self) -> None:
        require(self.interval >= 0, f"checkpoint.interval must be >= 0, got {self.interval}")
        require(
            self.keep_latest_k >= 0,
            f"checkpoint.keep_latest_k must be >= 0, got {self.keep_latest_k}",
        )


@dataclass(kw_only=True, slots=True)
class StoreConfig:
    """The tensor store that couples the roles (docs/store.md)."""

    address: str = ""
    """tcp://host:port of a running store (`tidal store serve`); empty: `tidal rl` starts an
    embedded one in its own process, and the roles it launches connect to it."""
    connect_timeout_s: float = 10.0
    """Seconds to wait for the store to answer at start."""
    keep: int = 2
    """Versions kept per key by an embedded store."""
    policy_memory: Literal["auto", "host", "cuda"] = "auto"
    """Where published policy versions live: "host" (the store's shared memory: any reader,
    any host), "cuda" (the trainer's GPU memory, read by CUDA IPC device to device: readers on
    this host only; each kept version costs a copy of the weights there). auto: cuda when the
    trainer runs on CUDA and every role is on this machine (an empty store.address)."""

    def __post_init__(self) -> None:
        require(
            not self.address or self.address.startswith("tcp://"),
            f"store.address must be empty or tcp://host:port, got {self.address!r}",
        )
        require(
            self.connect_timeout_s > 0,
            f"store.connect_timeout_s must be > 0, got {self.connect_timeout_s}",
        )
        require(self.keep >= 2, f"store.keep must be >= 2, got {self.keep}")
        require(
            self.policy_memory in ("auto", "host", "cuda"),
            f"store.policy_memory must be auto, host or cuda; got {self.policy_memory!r}",
        )


@dataclass(kw_only=True, slots=True)
class RLConfig:
    """A whole RL job."""

    job: JobConfig = field(default_factory=lambda: JobConfig(name="rl", output_dir="outputs/rl"))
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=1e-5, weight_decay=0.0)
    )
    lr_scheduler: SchedulerConfig = field(
        default_factory=lambda: SchedulerConfig(warmup_steps=0, decay_fraction=0.0)
    )
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig
    )
    generator: GeneratorRoleConfig = field(default_factory=GeneratorRoleConfig)
    rl: LoopConfig = field(default_factory=LoopConfig)
    metrics: RLMetricsConfig = field(default_factory=RLMetricsConfig)
    checkpoint: RLCheckpointConfig = field(default_factory=RLCheckpointConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)

    def __post_init__(self) -> None:
        require(
            not (self.rollout.group_size == 1 and self.loss.std_normalize),
            "rollout.group_size=1 with loss.std_normalize=true: a group of one sample has no "
            "standard deviation to divide by; sample more per prompt (--rollout.group_size 8) "
            "or set --loss.std_normalize false",
        )
        require(
            self.rollout.prompts_per_step >= self.generator.count,
            f"rollout.prompts_per_step={self.rollout.prompts_per_step} is fewer than "
            f"generator.count={self.generator.count}: every generator needs a prompt a step",
        )
        require(
            self.rl.min_generators <= self.generator.count,
            f"rl.min_generators={self.rl.min_generators} exceeds generator.count="
            f"{self.generator.count}: the trainer starts once generator.count generators joined "
            "and stops when fewer than rl.min_generators are live",
        )
        require(
            self.parallelism.cp == 1,
            f"parallelism.cp={self.parallelism.cp}: the trainer's RL step does not run under "
            "context parallelism (the policy loss's per-sequence terms need whole rows); use "
            "parallelism.cp 1 (FSDP, HSDP, TP and PP are fine)",
        )
        require(
            self.rollout.group_size <= self.generator.max_batch,
            f"rollout.group_size={self.rollout.group_size} exceeds generator.max_batch="
            f"{self.generator.max_batch} (a group is decoded at once)",
        )
        for role in ("trainer", "generator"):
            share = getattr(self, role).sm_percent
            require(
                share == 100 or self.rl.mps,
                f"{role}.sm_percent={share} splits a GPU's SMs between the roles only "
                "under CUDA MPS: set --rl.mps true (tidal rl starts a daemon for its "
                "roles)",
            )
        require(
            self.rl.mode == "sync" or self.loss.corrects,
            "rl.mode=async trains on tokens of older policy versions and needs a per-token "
            "correction: set --loss.tis_cap (truncated IS, e.g. 2) or --loss.mask_low and "
            "--loss.mask_high (mask tokens whose ratio leaves the band, e.g. 0.5 and 2)",
        )

    def profile_folder(self, role: str) -> str:
        """The profiler folder of role `role` ("trainer", "generator0"): profiler.folder/role,
        relative to job.output_dir unless absolute (tidal/rl/distributed/profile.py)."""
        return str(Path(self.profiler.folder) / role)

    def queue_slots(self) -> int:
        """async: rollout batches each generator may have waiting in the store."""
        if self.rl.queue_depth is None:
            return 1
        return max(1, self.rl.queue_depth // self.generator.count)

    def queue_warning(self) -> str | None:
        """A warning when there are more generators than rl.queue_depth can serve."""
        g, q = self.generator.count, self.rl.queue_depth
        if self.rl.mode != "async" or q is None or g <= q:
            return None
        return (
            f"rl.queue_depth={q} rollout batches cannot serve generator.count={g} "
            f"generators (each needs a slot): every generator gets 1, so up to {g} batches "
            f"wait in the store and the oldest may go stale; raise rl.queue_depth to "
            f">= {g} or run fewer generators"
        )

    def prompts_of(self, generator: int) -> int:
        """Prompts generator `generator` samples each step (the remainder goes to the first)."""
        share, extra = divmod(self.rollout.prompts_per_step, self.generator.count)
        return share + (1 if generator < extra else 0)
