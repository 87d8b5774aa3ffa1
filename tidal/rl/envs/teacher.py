"""SFT conversations of a tool environment, played by a teacher: the warm start of
`make demo-tools`: `DataConfig(dataset="generated",
path="tidal.rl.envs.teacher:teacher_chats:calculator:tool=0.3:terms=2")` calls
`teacher_chats("calculator:tool=0.3:terms=2", n, split=...)`.

The teacher answers each problem of the environment's split one of two ways:

- with probability `tool`, it calls the tool (``<tool_call>`` with the problem's expression),
  reads the ``tool`` turn that comes back (the tool's real result) and answers ``#### N``;
- otherwise it answers at once with a guess: the true value with its last digits wrong, so
  the answer is almost always wrong.

SFT on it gives a model that sometimes calls the tool; an RL reward on the true answer tells
the two apart, so GRPO raises the tool-call rate and the success (docs/rl.md, "Tools demo").

The conversations are written in the Hermes tool format (tool_calls.py `prepare_messages`):
the tool block in the system turn (none with the environment's `list_tools=false`),
``<tool_call>`` text in the assistant turn, ``<tool_response>`` around the result, so a
template that renders a system and a ``tool`` turn (the built-in ChatML) encodes them into the
ids the environment's trajectories have (tests/rl/test_tools_demo.py checks it token by
token).

Splits: the environment's own (`Env.problems("train")` for training, its held-out split for
validation), so the SFT never sees a problem the RL run is scored on.

Example::

    chats = teacher_chats("calculator:tool=0.3:terms=2", 4, split="train")
    chats[0][-1]["content"]      # "#### 25890" (after a tool call) or a guess "#### 25913"
"""

from __future__ import annotations

import itertools
import random
import re
from typing import Any

from tidal.rl.envs.base import Env, get_env
from tidal.rl.envs.tool_calls import ToolCall, prepare_messages
from tidal.rl.tasks.base import Problem

Messages = list[dict[str, Any]]

TEACHER_ENVS = ("calculator",)
"""Environments with a teacher here."""

_EXPRESSION = re.compile(r"What is (.+?)\?")
_RANGE = re.compile(r"(\d+)-(\d+)")


def parse_teacher_spec(spec: str, *, where: str = "spec") -> tuple[str, float, dict[str, Any]]:
    """`"calculator:tool=0.3:terms=2:digits=1-3"` -> ("calculator", 0.3, {"terms": 2,
    "digits": (1, 3)}): the environment, the teacher's tool rate and the environment's
    parameters (integers, MIN-MAX ranges, or true/false).

    Raises:
        ValueError: an environment without a teacher, a bad option or value, naming `where`.
    """
    name, *opts = (spec or "").split(":")
    if name not in TEACHER_ENVS:
        raise ValueError(
            f"{where}: no teacher for environment {name!r} in {spec!r}; teachers: "
            f"{list(TEACHER_ENVS)}, written ENV:tool=P[:PARAM=N|MIN-MAX|true|false...] "
            "(e.g. calculator:tool=0.3:terms=2)"
        )
    tool = 0.5
    params: dict[str, Any] = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq or not key:
            raise ValueError(f"{where}: expected KEY=VALUE, got {opt!r} in {spec!r}")
        if key == "tool":
            try:
                tool = float(value)
            except ValueError:
                tool = -1.0
            if not 0.0 <= tool <= 1.0:
                raise ValueError(f"{where}: tool={value!r} in {spec!r} must be in [0, 1]")
            continue
        m = _RANGE.fullmatch(value)
        if m:
            params[key] = (int(m[1]), int(m[2]))
        elif value.isdigit():
            params[key] = int(value)
        elif value in ("true", "false"):
            params[key] = value == "true"
        else:
            raise ValueError(
                f"{where}: {key}={value!r} in {spec!r} must be an integer, MIN-MAX, true or false"
            )
    try:
        get_env(name, **params)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {spec!r}: {e}") from None
    return name, tool, params


def _guess(value: int, rng: random.Random) -> int:
    """`value` off in its last one or two digits (never `value` itself)."""
    scale = 10 if abs(value) < 100 or rng.random() < 0.5 else 100
    return value + rng.choice((-1, 1)) * rng.randrange(1, scale)


def teacher_chat(env: Env, problem: Problem, *, tool: bool, rng: random.Random) -> Messages:
    """One conversation of `env` for `problem`, as the teacher plays it (OpenAI-style
    messages: an assistant ``tool_calls`` turn and a ``tool`` turn when `tool`)."""
    opening = env.episode().reset(problem)
    if not tool:
        guess = _guess(int(problem.reference), rng)
        return [*opening, {"role": "assistant", "content": f"#### {guess}"}]
    m = _EXPRESSION.search(problem.prompt)
    if m is None:
        raise ValueError(f"teacher: no expression in the prompt {problem.prompt!r}")
    (calc,) = env.tools()
    call = ToolCall(name=calc.name, arguments={"expression": m[1]})
    result = calc(call.arguments)
    return [
        *opening,
        {"role": "assistant", "content": "", "tool_calls": [call.openai()]},
        {"role": "tool", "name": calc.name, "content": result},
        {"role": "assistant", "content": f"#### {result}"},
    ]


def teacher_chats(spec: str, n: int, *, split: str, seed: int = 0) -> list[Messages]:
    """`n` teacher conversations of the environment `spec` names (`parse_teacher_spec`), from
    its `split` ("train", or "val"/"eval" for its held-out split), in the Hermes tool format:
    plain system/user/assistant/tool messages a ChatML template renders as the environment's
    trajectories are rendered. Deterministic in (spec, n, split, seed)."""
    name, tool_rate, params = parse_teacher_spec(spec, where="teacher")
    env = get_env(name, **params)
    specs = [t.spec() for t in env.tools()] if env.list_tools else None
    rng = random.Random(f"tidal-teacher|{spec}|{split}|{seed}")
    stream = env.problems("train" if split == "train" else "eval", seed=seed)
    out = []
    for p in itertools.islice(stream, n):
        chat = teacher_chat(env, p, tool=rng.random() < tool_rate, rng=rng)
        out.append(prepare_messages(chat, specs, "hermes"))
    return out
