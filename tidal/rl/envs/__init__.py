"""Environments for RL: multi-turn conversations with tools and games, as token-exact
trajectories.

    from tidal.rl.envs import get_env, sample_env_batch

    env = get_env("calculator")                  # or "python", "guess", or a task's name
    rollout = sample_env_batch(policy, env, cfg, seeds=(cfg.rollout.seed, step, 0),
                               n_prompts=cfg.rollout.prompts_per_step)

Built in: `calculator` and `python` (with the `calc` and sandboxed `python` tools) and
`guess` (a game without tools), in builtin.py; `verifiers` (a verifiers taskset played by
verifiers through tidal's OpenAI-compatible server) in verifiers.py; every task of
tidal/rl/tasks is a one-turn environment. A new environment is an `Env` subclass decorated
with `@register_env("name")` (base.py, docs/rl.md "Environments"). Trajectories and the
multi-turn driver are in trajectory.py, the chat template's tool-call format in
tool_calls.py.
"""

# they register their environments (verifiers.py imports the library only when used)
from tidal.rl.envs import builtin, verifiers  # noqa: F401
from tidal.rl.envs.base import ENVS, Env, Messages, Step, TaskEnv, Turn, get_env, register_env
from tidal.rl.envs.tool_calls import (
    ToolCall,
    check_arguments,
    check_tool_specs,
    hermes_system_block,
    parse_tool_calls,
    prepare_messages,
    render_chat,
    tool_format,
)
from tidal.rl.envs.trajectory import (
    FromCache,
    GenerateTurn,
    Trajectory,
    TurnCodec,
    TurnRequest,
    evaluate_env,
    resubmit,
    run_trajectories,
    sample_env_batch,
)

__all__ = [
    "ENVS",
    "Env",
    "FromCache",
    "GenerateTurn",
    "Messages",
    "Step",
    "TaskEnv",
    "ToolCall",
    "Trajectory",
    "Turn",
    "TurnCodec",
    "TurnRequest",
    "check_arguments",
    "check_tool_specs",
    "evaluate_env",
    "get_env",
    "hermes_system_block",
    "parse_tool_calls",
    "prepare_messages",
    "register_env",
    "render_chat",
    "resubmit",
    "run_trajectories",
    "sample_env_batch",
    "tool_format",
]
