"""What an RL run is built from, given its config: the task, the trainer, the generator and
the policy wrapper the experience functions take. tidal/rl/grpo.py (one process) and the
roles of `tidal rl` (tidal/rl/distributed/) build their pieces with these same functions, so
both run the same model, optimizer and sampler.

    task = make_task(cfg)
    src = resolve_policy(cfg)                       # tidal/rl/warmstart.py
    trainer = build_trainer(cfg, src)               # tidal.train Trainer, no data pipeline
    generator = build_generator(cfg, src)           # its own copy of the model
    policy = make_policy(cfg, src, generator)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import torch

from tidal.rl.config import RLConfig
from tidal.rl.experience import Policy
from tidal.rl.warmstart import PolicySource

Log = Callable[[str], None]


def make_task(cfg: RLConfig):
    """The configured task, or the environment `task.name` names (tidal/rl/envs).

    Both modes run either: in async mode an environment's batches are played whole, the
    weights switching between rounds of turns (tidal/rl/distributed/async_generator.py).

    Raises:
        ValueError: an unknown task or a bad parameter (the message names it)."""
    from tidal.rl.envs import ENVS, get_env
    from tidal.rl.tasks import get_task

    if cfg.task.name in ENVS:
        try:
            return get_env(cfg.task.name, **cfg.task.params)
        except TypeError as e:
            raise ValueError(f"task.params: {e}") from e
    try:
        return get_task(cfg.task.name, **cfg.task.params)
    except TypeError as e:
        raise ValueError(f"task.params: {e}") from e
    except ValueError as e:
        raise ValueError(f"task.name: {e}; or an environment: {sorted(ENVS)}") from e


def check_task_text(cfg: RLConfig, src: PolicySource, task) -> None:
    """The policy's tokenizer and model cover the task's text: every id of a rendered prompt
    and of a reference answer is inside the model's vocabulary, the text comes back from the
    ids unchanged, and rendered prompts fit `rollout.max_prompt_tokens` (on a sample of
    train and held-out problems). For an environment, the prompt is its opening with its
    tools listed (a chat template without tool support is an error here).

    Raises:
        ValueError: naming the text, the ids and the vocabulary size.
    """
    from tidal.rl.envs import Env
    from tidal.rl.envs.trajectory import env_codec

    vocab = src.args.vocab_size
    tok = src.tokenizer
    if tok.vocab_size > vocab:
        raise ValueError(
            f"the policy's tokenizer has {tok.vocab_size} tokens but the model embeds only "
            f"{vocab}: its vocabulary does not cover the tokenizer's ids"
        )
    problems = list(itertools.islice(task.problems("train", seed=cfg.rollout.seed), 16))
    problems += task.eval_set(min(16, cfg.task.eval_problems), seed=cfg.task.eval_seed)
    codec = None
    if isinstance(task, Env):  # its openings, tools listed: a template without them fails here
        codec = env_codec(src.encoder, task)
    for p in problems:
        if codec is not None:
            ids = codec.opening(task.episode().reset(p))
        else:
            ids = src.encoder.prompt_ids([{"role": "user", "content": p.prompt}])
        if len(ids) > cfg.rollout.max_prompt_tokens:
            raise ValueError(
                f"a prompt of the task {task.name!r} renders to {len(ids)} tokens, over "
                f"rollout.max_prompt_tokens={cfg.rollout.max_prompt_tokens}: {p.prompt[:60]!r}"
            )
        for text in (p.prompt, str(p.reference)):
            got = tok.encode(text)
            back = tok.decode(got)
            if back != text:
                raise ValueError(
                    f"the policy's tokenizer cannot represent the task {task.name!r}'s text: "
                    f"{text[:60]!r} decodes back as {back[:60]!r}"
                )
            ids = ids + got
        top = max(ids)
        if top >= vocab:
            raise ValueError(
                f"the model's vocabulary ({vocab} ids) does not cover the task {task.name!r}: "
                f"its text {p.prompt[:60]!r} encodes to id {top}"
            )


def check_routing_replay(cfg: RLConfig, args: Any, where: str = "the policy's model") -> None:
    """`loss.routing_replay` asks for a mixture-of-experts policy (`args`: its ModelArgs)
    trained without pipeline or context parallelism, on a task or an environment tidal's
    driver plays (whose trajectories carry the generator's records; not `verifiers`).

    Raises:
        ValueError: naming the field (one line, before any work)."""
    if not cfg.loss.routing_replay:
        return
    from tidal.rl.envs import ENVS, Env

    if args.moe is None:
        raise ValueError(
            f"loss.routing_replay=true replays the experts of a mixture-of-experts model; "
            f"{where} is dense (no model.moe): set loss.routing_replay false"
        )
    p = cfg.parallelism
    if p.pp > 1 or p.cp > 1:
        raise ValueError(
            f"loss.routing_replay=true runs without pipeline or context parallelism; got "
            f"parallelism.pp={p.pp}, parallelism.cp={p.cp}"
        )
    env = ENVS.get(cfg.task.name)
    if env is not None and env.play is not Env.play:
        raise ValueError(
            f"loss.routing_replay=true: environment task.name={cfg.task.name!r} plays its own "
            "turns (not through tidal's generator) and carries no routing records; use a "
            "tidal-driven environment or a task"
        )


def describe_model(src: PolicySource) -> str:
    """The policy's model, as error messages name it."""
    return f"the policy's model ({src.describe})" if src.describe else "the policy's model"


# -- the trainer -----------------------------------------------------------------------------


def trainer_seq_len(cfg: RLConfig, src: PolicySource) -> int:
    """Positions per sequence: the longest prompt and completion (a multi-turn trajectory's
    `rollout.max_context`), within the model."""
    r = cfg.rollout
    return min(src.args.max_seq_len, max(r.max_context, r.max_prompt_tokens + r.max_new_tokens))


def trainer_config(cfg: RLConfig, src: PolicySource):
    """The tidal.train Config of the trainer (no data pipeline: the loop feeds it)."""
    from tidal.train.config import (
        CheckpointConfig,
        Config,
        MetricsConfig,
        ModelConfig,
        SampleConfig,
        TrainingConfig,
    )

    t, c = cfg.trainer, cfg.checkpoint
    return Config(
        job=dataclasses.replace(cfg.job),
        model=ModelConfig(
            flavor=src.flavor, attention=cfg.model.attention, vocab_size=src.vocab_size
        ),
        training=TrainingConfig(
            steps=cfg.rl.steps,
            batch_size=t.micro_batch_size,
            seq_len=trainer_seq_len(cfg, src),
            max_norm=t.max_norm,
            mixed_precision=t.mixed_precision,
            compile=t.compile,
            compile_dynamic=True,  # every step's rollouts have their own length
            seed=t.seed,
            deterministic=t.deterministic,
            batch_invariant=cfg.generator.batch_invariant,
        ),
        optimizer=cfg.optimizer,
        lr_scheduler=cfg.lr_scheduler,
        parallelism=cfg.parallelism,
        activation_checkpoint=cfg.activation_checkpoint,
        metrics=MetricsConfig(log_every=1, val_every=0, tensorboard=cfg.metrics.tensorboard),
        # Each role traces the same window of steps into a folder of its own.
        profiler=dataclasses.replace(cfg.profiler, folder=cfg.profile_folder("trainer")),
        sample=SampleConfig(max_new_tokens=0),
        # The warm start loads through the checkpoint code, which reads initial_load_path only
        # when enabled: without policy checkpoints it is enabled to load, never to save.
        checkpoint=CheckpointConfig(
            enable=c.enable or src.checkpoint is not None,
            load_only=not c.enable,
            interval=c.interval or cfg.rl.steps,
            keep_latest_k=c.keep_latest_k,
            initial_load_path=str(src.checkpoint) if src.checkpoint else None,
            # The folder's config.json is the architecture; loaded in any layout (without
            # policy checkpoints too) and skipped when the run resumes.
            initial_load_hf=str(src.hf_folder) if src.hf_folder else None,
            initial_load_model_only=True,
        ),
    )


def build_trainer(cfg: RLConfig, src: PolicySource, *, dist_info: Any = None, log: Log = print):
    """The tidal.train Trainer of the run (on every rank: `dist_info` is torchrun's, None for
    one process), without a data pipeline, its first weights loaded (the warm start, or the
    run's newest checkpoint when it resumes: `trainer.step`)."""
    from tidal.train.data import DataBundle
    from tidal.train.trainer import Trainer

    data = DataBundle(tokenizer=src.tokenizer, train=None, val=None)
    return Trainer(trainer_config(cfg, src), data=data, dist_info=dist_info, log=log)


def reference_weights(trainer: Any, cfg: RLConfig) -> list[torch.Tensor] | None:
    """A frozen copy of the trainer's parameters (in its own layout) for the KL term when
    `loss.kl_coef` > 0, else None."""
    return [p.detach().clone() for p in trainer.params] if cfg.loss.kl_coef else None


def trainer_weights(trainer: Any) -> dict[str, torch.Tensor]:
    """The trainer's model state dict (every model part's), as it is published."""
    return {k: v for m in trainer.modules for k, v in m.state_dict().items()}


# -- the generator ---------------------------------------------------------------------------


def publish_dtype(cfg: RLConfig) -> torch.dtype | None:
    """bf16 when the generators run bf16 (an fp32 trainer casts while publishing)."""
    return torch.bfloat16 if generator_dtype(cfg) == torch.bfloat16 else None


def generator_device(cfg: RLConfig, local_rank: int = 0) -> torch.device:
    d = cfg.generator.device
    if d == "auto":
        d = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(d, local_rank) if d == "cuda" else torch.device(d)


def generator_dtype(cfg: RLConfig) -> torch.dtype:
    d = cfg.generator.dtype
    if d == "auto":
        d = "bf16" if generator_device(cfg).type == "cuda" else "fp32"
    return torch.bfloat16 if d == "bf16" else torch.float32


def build_generator(cfg: RLConfig, src: PolicySource, *, mesh: Any = None, local_rank: int = 0):
    """The generator's model (its own copy, on its device and dtype; its weights are loaded
    from the trainer's afterwards) wrapped in a tidal.generate.Generator; with a `tp` `mesh`, this
    rank's shard of it."""
    from tidal.generate import Generator, GeneratorConfig
    from tidal.models.transformer import Transformer

    device, dtype = generator_device(cfg, local_rank), generator_dtype(cfg)
    with torch.device("meta"):
        model = Transformer(src.args)
    shard_model(model, mesh)
    model.to_empty(device=device)
    model.init_weights(seed=cfg.trainer.seed)
    model.to(dtype)
    capacity = trainer_seq_len(cfg, src)
    g = cfg.generator
    config = GeneratorConfig(
        max_batch=g.max_batch,
        max_seq_len=capacity,
        batch_invariant=g.batch_invariant,
        compile=g.compile,
        cuda_graphs=g.cuda_graphs,
        compile_scope=g.compile_scope,
        record_routing=cfg.loss.routing_replay,
    )
    return Generator(model, tokenizer=src.tokenizer, config=config)


def shard_model(model: Any, mesh: Any) -> None:
    """Apply the generation TP plan (replicated activations, no sequence parallel) to a
    meta-device model over `mesh` (a no-op for None)."""
    if mesh is None:
        return
    from tidal.parallel.parallelize import apply_tp

    apply_tp(model, mesh, loss_parallel=False, sequence_parallel=False)


def warm_up_generator(gen: Any, cfg: RLConfig, index: int, *, log: Log) -> None:
    """Compile and capture now (`Generator.warm_up`) every decode bucket of the sampler
    variants generator `index` runs: its rollouts', and greedy for generator 0's held-out
    evaluations. Nothing is done where nothing is compiled or captured (CPU)."""
    from tidal.generate import SamplingParams

    r, name = cfg.rollout, f"generator {index}"
    params = [SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)]
    if index == 0:
        params.append(SamplingParams(temperature=0.0))
    if gen.device.type == "cuda":  # a compile scope "step" warm-up may take minutes
        log(
            f"{name}: warming up (batch buckets {gen.buckets}, "
            f"{len(params)} sampler variant(s)); it joins the job when done"
        )
    seconds = gen.warm_up(params)
    if seconds:
        log(
            f"{name}: warmed up in {seconds:.1f} s ({gen.stats.graphs_captured} "
            f"CUDA graphs; batch buckets {gen.buckets})"
        )


def make_policy(cfg: RLConfig, src: PolicySource, generator: Any) -> Policy:
    """The generator with the policy's prompt rendering, stop and pad ids (tidal/rl/
    experience.py takes it)."""
    return Policy(
        generator=generator,
        encoder=src.encoder,
        pad_id=src.tokenizer.eos_id,
        max_prompt_tokens=cfg.rollout.max_prompt_tokens,
    )
