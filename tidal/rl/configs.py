"""Named RL configs: functions returning an `RLConfig`, registered by name.

`tidal rl --config NAME` starts from one of these; `--section.field value` overrides any
field (`tidal rl --config NAME --help` lists them). Add one with `@register` here, or name a
function anywhere as `--config MODULE:FUNCTION` (a dotted module or a `.py` file).
"""

from __future__ import annotations

from collections.abc import Callable

from tidal.rl.config import (
    GeneratorRoleConfig,
    LoopConfig,
    PolicyConfig,
    RLCheckpointConfig,
    RLConfig,
    RolloutConfig,
    TaskConfig,
    TrainerConfig,
)
from tidal.rl.loss import LossConfig
from tidal.train.config import JobConfig, ModelConfig, OptimizerConfig, SchedulerConfig
from tidal.train.configs import config_from_module

RL_CONFIGS: dict[str, Callable[[], RLConfig]] = {}


def register(fn: Callable[[], RLConfig]) -> Callable[[], RLConfig]:
    RL_CONFIGS[fn.__name__] = fn
    return fn


def get_rl_config(name: str) -> RLConfig:
    """The named RL config, freshly built: a registered name or `MODULE:FUNCTION`.

    Raises:
        ValueError: an unknown name, a module that cannot be imported, a missing function, or
            one that does not return an RLConfig.
    """
    if ":" in name:
        return config_from_module(name, RLConfig)
    if name not in RL_CONFIGS:
        raise ValueError(
            f"unknown RL config {name!r}; choose one of {sorted(RL_CONFIGS)}, "
            "or name a function as MODULE:FUNCTION"
        )
    return RL_CONFIGS[name]()


@register
def rl_addition() -> RLConfig:
    """`make demo`: GRPO on 1-3 digit addition, on CPU, sync mode, from an SFT warm start that
    imitated a teacher who forgets 55% of its carries. The reward checks the true sum, so the
    policy learns to carry: held-out pass@1 rises well past the warm start (docs/rl.md)."""
    return RLConfig(
        # Portable CPU kernels: a fresh clone on any x86-64 machine repeats the demo's curve.
        job=JobConfig(name="rl_addition", output_dir="outputs/rl_addition", cpu_kernels="portable"),
        policy=PolicyConfig(init="sft:sft_addition_slips"),
        # The held-out split is the SFT corpus's held-out split: never trained on by either.
        task=TaskConfig(name="addition", params={"digits": [1, 3]}, eval_problems=200),
        # A worked 3-digit solution is ~95 tokens and the stop token.
        rollout=RolloutConfig(
            prompts_per_step=16,
            group_size=8,
            temperature=1.0,
            max_new_tokens=128,
            max_prompt_tokens=48,
        ),
        loss=LossConfig(),
        # Adam starts fresh (the warm start loads the model only), so the rate warms up; it
        # then decays to 0 (cosine), as the SFT run's did: rates that stay at 1e-4 or above
        # undo the warm start's annealing and lose accuracy.
        optimizer=OptimizerConfig(lr=1e-4, weight_decay=0.0),
        lr_scheduler=SchedulerConfig(warmup_steps=5, decay_fraction=1.0, decay_type="cosine"),
        trainer=TrainerConfig(micro_batch_size=32),
        generator=GeneratorRoleConfig(count=1, max_batch=128),
        rl=LoopConfig(steps=50, eval_every=10),
        checkpoint=RLCheckpointConfig(enable=True),
    )


@register
def rl_llama3_1b() -> RLConfig:
    """Throughput: llama3_1b from the seed init on addition (one GPU: trainer and generator
    share it; bf16). Rewards stay near 0: this measures the loop, not learning."""
    return RLConfig(
        job=JobConfig(name="rl_llama3_1b", output_dir="outputs/rl_llama3_1b"),
        policy=PolicyConfig(init="seed", tokenizer="sft:sft_addition"),
        model=ModelConfig(flavor="llama3_1b"),
        task=TaskConfig(name="addition", params={"digits": [1, 4]}, eval_problems=64),
        rollout=RolloutConfig(
            prompts_per_step=32, group_size=8, max_new_tokens=128, max_prompt_tokens=64
        ),
        loss=LossConfig(drop_equal_groups=False),
        optimizer=OptimizerConfig(lr=1e-6, weight_decay=0.0),
        lr_scheduler=SchedulerConfig(warmup_steps=0, decay_fraction=0.0),
        trainer=TrainerConfig(micro_batch_size=16),
        generator=GeneratorRoleConfig(count=1, max_batch=256),
        rl=LoopConfig(steps=10, eval_every=0),
        checkpoint=RLCheckpointConfig(enable=False),
    )


@register
def rl_addition_moe() -> RLConfig:
    """Routing replay on CPU (docs/rl.md, "Routing replay"): GRPO on addition with the tiny
    mixture-of-experts policy `debug_moe` (8 experts, 2 per token) from its seed init, a few
    short steps. It learns little; it measures the generator-trainer log-prob gap
    (`logprob_diff_max` / `logprob_diff_mean`), with `--loss.routing_replay true` or
    without."""
    return RLConfig(
        job=JobConfig(name="rl_addition_moe", output_dir="outputs/rl_addition_moe"),
        policy=PolicyConfig(init="seed", tokenizer="sft:sft_addition"),
        model=ModelConfig(flavor="debug_moe", vocab_size=512),
        task=TaskConfig(name="addition", params={"digits": [1, 3]}, eval_problems=16),
        rollout=RolloutConfig(
            prompts_per_step=8, group_size=4, max_new_tokens=24, max_prompt_tokens=48
        ),
        loss=LossConfig(drop_equal_groups=False),
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0),
        lr_scheduler=SchedulerConfig(warmup_steps=0, decay_fraction=0.0),
        trainer=TrainerConfig(micro_batch_size=32),
        generator=GeneratorRoleConfig(count=1, max_batch=32),
        rl=LoopConfig(steps=4, eval_every=0),
        checkpoint=RLCheckpointConfig(enable=False),
    )


@register
def rl_addition_135m() -> RLConfig:
    """The RL peer benchmark (benchmarks/rl_peer.py, one GPU): `rl_addition`'s task and batch
    (16 prompts x 8 samples x up to 128 new tokens) on a SmolLM2-135M-shaped model, warm-started
    by the same sloppy-teacher SFT at that size, so TRL's GRPOTrainer can run the same model."""
    cfg = _at_135m(rl_addition(), "rl_addition_135m", "training.steps=400", micro_batch=128)
    cfg.rl = LoopConfig(steps=30, eval_every=10)
    cfg.checkpoint = RLCheckpointConfig(enable=False)
    return cfg


def _at_135m(cfg: RLConfig, name: str, sft_extra: str, micro_batch: int) -> RLConfig:
    """`cfg` on a SmolLM2-135M-shaped model: its SFT warm start at that size (lr 1e-3, plus
    `sft_extra`), GRPO at lr 3e-5, the trainer and the generator's blocks compiled."""
    cfg.job = JobConfig(name=name, output_dir=f"outputs/{name}")
    cfg.policy = PolicyConfig(
        init=cfg.policy.init,
        sft_overrides=f"model.flavor=smollm2_135m optimizer.lr=1e-3 {sft_extra}".strip(),
    )
    cfg.optimizer = OptimizerConfig(lr=3e-5, weight_decay=0.0)
    # Compiled blocks: 0.301 s a sync step against 0.389 eager on an H200 (benchmarks/rl.md).
    cfg.trainer = TrainerConfig(micro_batch_size=micro_batch, compile=True)
    # The generator compiles one block for every layer: seconds to warm up, not minutes.
    cfg.generator.compile_scope = "blocks"
    return cfg


@register
def rl_calculator() -> RLConfig:
    """`make demo-tools`: GRPO on the `calculator` environment (one product of two 3-digit
    operands, the `calc` tool, no tool block in the opening: the 1M warm start does not learn
    to copy the question's numbers from behind one), on CPU, from an SFT warm start whose
    teacher called the tool on 40% of the problems and guessed the rest. The reward checks the
    true answer, so trajectories that call the tool are reinforced and greedy decoding comes
    to call it (held-out 0 -> 80 of 100 as measured; docs/rl.md, "Tools demo")."""
    return RLConfig(
        job=JobConfig(
            name="rl_calculator", output_dir="outputs/rl_calculator", cpu_kernels="portable"
        ),
        policy=PolicyConfig(init="sft:sft_calculator_tools"),
        # The SFT teacher's problems (sft_calculator_tools' data.path); held out: the
        # environment's eval split, which the SFT never trained on.
        task=TaskConfig(
            name="calculator",
            params={
                "terms": 1,
                "digits": 3,
                "list_tools": False,
                "hint_first": True,
                "max_turns": 3,
                "max_tool_calls": 2,
            },
            eval_problems=100,
        ),
        # The opening (the question, no tool block) is ~45 tokens; a turn ~30; a whole
        # trajectory with one call ~110.
        rollout=RolloutConfig(
            prompts_per_step=8,
            group_size=8,
            temperature=1.0,
            max_new_tokens=48,
            max_prompt_tokens=96,
            max_context=224,
        ),
        loss=LossConfig(),
        optimizer=OptimizerConfig(lr=3e-4, weight_decay=0.0),
        lr_scheduler=SchedulerConfig(warmup_steps=3, decay_fraction=1.0, decay_type="cosine"),
        trainer=TrainerConfig(micro_batch_size=32),
        generator=GeneratorRoleConfig(count=1, max_batch=64),
        rl=LoopConfig(steps=30, eval_every=10),
        checkpoint=RLCheckpointConfig(enable=False),
    )


@register
def rl_calculator_135m() -> RLConfig:
    """The tools demo on one GPU (issue 34's benchmark): `rl_calculator`'s environment, batch
    and steps on a SmolLM2-135M-shaped model, warm-started by the same 40%-calling teacher's
    SFT at that size, compiled as `rl_addition_135m`. Not yet measured (docs/rl.md, "Tools
    demo")."""
    return _at_135m(rl_calculator(), "rl_calculator_135m", "", micro_batch=64)
