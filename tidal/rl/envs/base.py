"""What an environment is, and the registry of environments by name.

An environment is a multi-turn task: a dataclass of its parameters (like `Task`, with the same
seeded train/eval problem streams) with

- `reset(problem)`: the opening messages of a conversation (a user turn, maybe a system one);
- `step(turn)`: the model's turn in, what comes back out (a `Step`): tool results, a user or
  game message, or the end with a reward; a `Step` may carry a per-turn reward too;
- limits: `max_turns` (assistant turns) and `max_tool_calls` (per trajectory);
- `tools()`: the tools the model may call (tidal/rl/tools `Tool`s), listed in the chat
  template's tool format (tool_calls.py).

The driver (trajectory.py) runs each trajectory on its own shallow copy of the environment,
so `reset` may keep the episode's state on `self`. The base `step` runs the turn's tool calls
when there are any (a call to an undeclared tool, malformed JSON or bad arguments come back
as a tool error, never an exception) and otherwise calls `grade(turn)`, which ends the
trajectory: a tool environment only writes `problem`, `reset` (or just uses the default,
which sends the problem's prompt as the user turn) and `grade`.

A single-turn `Task` is the special case with one turn: `get_env(name)` for a task name gives
`TaskEnv(task)`, whose trajectories are the task's samples, graded the same way.

Example::

    @register_env("echo")
    @dataclass(kw_only=True)
    class Echo(Env):
        max_turns: int = 2

        def problem(self, rng):
            word = rng.choice(["red", "blue"])
            return Problem(f"Say {word}, twice.", word)

        def step(self, turn):
            if self.reference in turn.content and turn.index == 1:
                return Step(done=True, reward=1.0)
            return Step(messages=[{"role": "user", "content": "Again."}])
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from tidal.rl.envs.tool_calls import ToolCall, parse_tool_calls
from tidal.rl.tasks.base import TASKS, Grade, Problem, Split, Task, get_task
from tidal.rl.tools import Tool

if TYPE_CHECKING:
    from tidal.generate import SamplingParams
    from tidal.rl.envs.trajectory import GenerateTurn, Trajectory, TurnCodec
    from tidal.rl.experience import Policy

Messages = list[dict[str, Any]]


@dataclass(kw_only=True, slots=True)
class Turn:
    """One assistant turn, as the environment sees it."""

    text: str
    """What the model wrote (decoded, without the end-of-turn marker)."""
    index: int
    """0 for the first assistant turn."""
    content: str = ""
    """`text` without its ``<tool_call>`` blocks (the whole text when no tools)."""
    calls: list[ToolCall] = field(default_factory=list)
    """Its well-formed tool calls (only for environments with tools)."""
    call_errors: list[str] = field(default_factory=list)
    """A ``Tool error: ...`` sentence per malformed call, undeclared tool or bad arguments."""
    last: bool = False
    """The turn limit is reached: whatever `step` returns, the trajectory ends after it."""
    calls_left: int = 0
    """Tool calls the trajectory may still make (`max_tool_calls` minus those made)."""
    finish_reason: str = "stop"
    """"stop" (end-of-turn token) or "length" (the turn hit its token limit)."""

    @property
    def n_calls(self) -> int:
        """Tool calls the model wrote this turn, malformed ones included."""
        return len(self.calls) + len(self.call_errors)


@dataclass(kw_only=True, slots=True)
class Step:
    """What comes back after a turn."""

    messages: Messages = field(default_factory=list)
    """The next messages the model reads (``tool`` results, a ``user`` reply); ignored when
    `done`."""
    done: bool = False
    """The trajectory ends here."""
    reward: float = 0.0
    """This turn's reward; a trajectory's reward is the sum over its turns (GRPO's advantage
    is of the whole trajectory)."""
    answer: str | None = None
    """The answer parsed from the model (logging), on the final step."""
    format_ok: bool = False
    """The answer was in the expected format (logging), on the final step."""


@dataclass(kw_only=True)
class Env:
    """Base class of environments: subclass it as a dataclass of parameters, write `problem`
    and `step` (or `grade`, for a tool environment), and decorate it with
    `@register_env("name")`. See the module docstring."""

    name: ClassVar[str] = ""
    """Set by `register_env`."""

    max_turns: int = 1
    """Assistant turns per trajectory; at the limit the trajectory ends (reward: the turns'
    rewards so far, the last `step` included)."""
    max_tool_calls: int = 8
    """Tool calls per trajectory; calls past it get a tool error."""
    eval_fraction: float = 0.1
    """Share of the problem space held out for evaluation (as `Task.eval_fraction`)."""
    list_tools: bool = True
    """List the tools' specs in the opening (the template's tool block, e.g. Hermes' ~150
    tokens in the system turn). False: the opening has no tool block, the tools are still
    parsed and run; for a small model taught its tool by SFT (`make demo-tools`)."""

    reference: Any = field(default=None, init=False, repr=False)
    """The current problem's reference, set by the default `reset`."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"{type(self).__name__}.max_turns must be >= 1, got {self.max_turns}")
        if self.max_tool_calls < 0:
            raise ValueError(
                f"{type(self).__name__}.max_tool_calls must be >= 0, got {self.max_tool_calls}"
            )
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(
                f"{type(self).__name__}.eval_fraction must be in (0, 1), got {self.eval_fraction}"
            )

    # -- problems (as Task's) ------------------------------------------------------------

    def problem(self, rng: random.Random) -> Problem:
        """Draw one problem, using only `rng` for randomness."""
        raise NotImplementedError(f"{type(self).__name__} must define problem(rng)")

    def key(self, problem: Problem) -> str:
        """What identifies a problem for the train/eval split (default: its prompt)."""
        return problem.prompt

    def problems(self, split: Split = "train", *, seed: int = 0) -> Iterator[Problem]:
        """An endless, deterministic stream of the split's problems (`Task.problems`)."""
        return self._as_task().problems(split, seed=seed)

    def eval_set(self, n: int, *, seed: int = 0) -> list[Problem]:
        """`n` distinct eval problems (`Task.eval_set`)."""
        return self._as_task().eval_set(n, seed=seed)

    def _as_task(self) -> Task:
        """A Task view sharing this environment's problems, key, name and split."""
        return _ProblemsOf(env=self, eval_fraction=self.eval_fraction)

    # -- the conversation ----------------------------------------------------------------

    def tools(self) -> list[Tool]:
        """The tools the model may call (none by default)."""
        return []

    def reset(self, problem: Problem) -> Messages:
        """The opening messages of a trajectory for `problem`; default: the prompt as the
        user turn (and `self.reference` set)."""
        self.reference = problem.reference
        return [{"role": "user", "content": problem.prompt}]

    def step(self, turn: Turn) -> Step:
        """What comes back after `turn`. Default: the tool results when the turn calls tools
        (and is not the last), else `grade(turn)`, which ends the trajectory."""
        if turn.n_calls and not turn.last:
            return Step(messages=self.run_tools(turn))
        return self.grade(turn)

    def grade(self, turn: Turn) -> Step:
        """The final step for a turn without tool calls (tool environments write this)."""
        raise NotImplementedError(f"{type(self).__name__} must define step(turn) or grade(turn)")

    def run_tools(self, turn: Turn) -> Messages:
        """One ``tool`` message per call of `turn`, in the order written: the tool's result,
        or the call's error (malformed, undeclared, past `max_tool_calls`). A tool that raises
        gives a tool error too."""
        tools = {t.name: t for t in self.tools()}
        calls = {c.index: c for c in turn.calls}
        errors = iter(turn.call_errors)
        out: Messages = []
        left = turn.calls_left
        for i in range(turn.n_calls):
            call = calls.get(i)
            if call is None:
                out.append({"role": "tool", "content": next(errors)})
                continue
            if left <= 0:
                result = (
                    f"Tool error: the limit of {self.max_tool_calls} tool calls is reached; "
                    "answer without tools"
                )
            elif call.name not in tools:  # declared specs pass the parser; this is a backstop
                result = f"Tool error: unknown tool {call.name!r}; the tools are {sorted(tools)}"
            else:
                try:
                    result = tools[call.name](call.arguments)
                except Exception as e:  # documented: a tool's crash is the model's tool error
                    result = f"Tool error: {call.name} failed: {type(e).__name__}: {e}"
            left -= 1
            out.append({"role": "tool", "name": call.name, "content": result})
        return out

    def parse(
        self,
        text: str,
        index: int = 0,
        *,
        last: bool = False,
        calls_left: int | None = None,
        finish: str = "stop",
    ) -> Turn:
        """The `Turn` of a model's text: its tool calls parsed against `tools()` (a call to
        a tool not declared is a call error). Without tools, the whole text is the content.
        `calls_left` defaults to `max_tool_calls`."""
        specs = [t.spec() for t in self.tools()]
        calls_left = self.max_tool_calls if calls_left is None else calls_left
        content, calls, errors = parse_tool_calls(text, specs)
        return Turn(
            text=text,
            index=index,
            content=content if specs else text.strip(),
            calls=calls if specs else [],
            call_errors=errors if specs else [],
            last=last,
            calls_left=calls_left,
            finish_reason=finish,
        )

    def episode(self) -> Env:
        """A fresh copy for one trajectory (shallow: `reset` assigns the episode's state)."""
        return copy.copy(self)

    def play(
        self,
        problems: Sequence[Problem],
        params: Sequence[SamplingParams],
        *,
        policy: Policy,
        codec: TurnCodec,
        generate_turn: GenerateTurn,
        max_context: int,
        max_prompt_tokens: int | None,
    ) -> tuple[list[list[Trajectory]], dict[str, Any]]:
        """Play `params[i].n` trajectories of each problem: what `sample_env_batch` and
        `evaluate_env` call. Default: tidal's driver over `reset` and `step`
        (`run_trajectories`, which documents the arguments and the counts returned). An
        environment whose own program drives the model (an external library through the
        OpenAI-compatible server: tidal/rl/envs/verifiers.py) overrides it and returns the
        same token-exact trajectories."""
        from tidal.rl.envs.trajectory import run_trajectories

        return run_trajectories(
            self,
            problems,
            codec,
            generate_turn,
            params,
            max_context=max_context,
            max_prompt_tokens=max_prompt_tokens,
        )


@dataclass(kw_only=True)
class _ProblemsOf(Task):
    """An environment's problems as a Task (for its seeded train/eval streams)."""

    env: Env

    def __post_init__(self) -> None:
        super().__post_init__()
        self.name = self.env.name  # type: ignore[misc]  # the split hashes the env's name

    def problem(self, rng: random.Random) -> Problem:
        return self.env.problem(rng)

    def key(self, problem: Problem) -> str:
        return self.env.key(problem)

    def grade(self, completion: str, reference: Any) -> Grade:  # pragma: no cover - unused
        # Only the problem streams are used: an environment's rewards come from its steps.
        raise TypeError(
            f"environment {self.env.name!r} grades trajectories through step(turn), not a "
            "single completion string"
        )


@dataclass(kw_only=True)
class TaskEnv(Env):
    """A single-turn `Task` as an environment: the prompt as the user turn, one assistant
    turn, graded by the task (a grader that raises gives reward 0, counted by the driver as
    an environment error). Its problems, splits and rewards are the task's."""

    task: Task

    def problem(self, rng: random.Random) -> Problem:
        return self.task.problem(rng)

    def key(self, problem: Problem) -> str:
        return self.task.key(problem)

    def problems(self, split: Split = "train", *, seed: int = 0) -> Iterator[Problem]:
        return self.task.problems(split, seed=seed)

    def eval_set(self, n: int, *, seed: int = 0) -> list[Problem]:
        return self.task.eval_set(n, seed=seed)

    def parse(
        self,
        text: str,
        index: int = 0,
        *,
        last: bool = False,
        calls_left: int | None = None,
        finish: str = "stop",
    ) -> Turn:
        return Turn(text=text, index=index, content=text, last=last, finish_reason=finish)

    def step(self, turn: Turn) -> Step:
        g = self.task.grade(turn.text, self.reference)
        return Step(done=True, reward=g.reward, answer=g.answer, format_ok=g.format_ok)


ENVS: dict[str, type[Env]] = {}
"""Registered environments by name."""

E = TypeVar("E", bound=type[Env])


def register_env(name: str) -> Callable[[E], E]:
    """Class decorator: make an `Env` subclass available as `get_env(name, ...)`.

    Raises:
        ValueError: the name is taken by another class (or by a task). TypeError: not an Env.
    """

    def deco(cls: E) -> E:
        if not (isinstance(cls, type) and issubclass(cls, Env)):
            raise TypeError(f"register_env({name!r}) decorates Env subclasses, got {cls!r}")
        old = ENVS.get(name)
        if old is not None and old.__qualname__ != cls.__qualname__:
            raise ValueError(
                f"environment name {name!r} is already registered by {old.__qualname__}"
            )
        if name in TASKS:
            raise ValueError(f"environment name {name!r} is a task's; choose another")
        cls.name = name
        ENVS[name] = cls
        return cls

    return deco


def get_env(name: str, **params: Any) -> Env:
    """A registered environment built with `params`; a registered task's name gives the
    task as a single-turn `TaskEnv` (params are the task's).

    Raises:
        ValueError: neither an environment nor a task of that name (the message lists both).
        TypeError: a parameter it does not have (the message lists those it has).

    Example::

        env = get_env("guess", high=50, max_turns=6)
        env = get_env("addition", digits=2)      # the task, one turn
    """
    if name in ENVS:
        cls = ENVS[name]
        allowed = [f.name for f in dataclasses.fields(cls) if f.init]
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            raise TypeError(
                f"environment {name!r} has no parameter {unknown[0]!r}; its parameters: {allowed}"
            )
        return cls(**params)
    if name in TASKS:
        env = TaskEnv(task=get_task(name, **params))
        env.name = name  # type: ignore[misc]  # the task's name, per instance
        return env
    raise ValueError(
        f"unknown environment {name!r}; environments: {sorted(ENVS)}, tasks (one turn): "
        f"{sorted(TASKS)}"
    )
