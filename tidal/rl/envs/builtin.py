"""Built-in environments: `calculator` and `python` (tools) and `guess` (a game, no tools).

- `calculator`: multi-step integer arithmetic, "What is 4821 * 37 - 905 * 12?", long enough
  that the `calc` tool pays; the final answer on a "#### N" line.
- `python`: small problems whose answer needs a computation (counting multiples in a range,
  sums of squares, primes below n, digit sums of a power), with the sandboxed `python` tool;
  the reference is computed here, by tidal, never by running model code.
- `guess`: a number in [low, top] (top drawn per problem, at most `high`); each turn the
  model guesses, the game answers "Higher." or "Lower."; reward 1 for the right number
  within `max_turns`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from tidal.rl.envs.base import Env, Step, Turn, register_env
from tidal.rl.tasks.answers import grade_number
from tidal.rl.tasks.base import Problem, int_range
from tidal.rl.tools import SandboxConfig, Tool, calc_tool, python_tool

_TOOL_HINT = 'Use the {tool} tool when it helps. End with the answer on a line "#### N".'


def _final(turn: Turn, reference: Any, strict: bool) -> Step:
    g = grade_number(turn.content, reference, strict=strict)
    return Step(done=True, reward=g.reward, answer=g.answer, format_ok=g.format_ok)


@register_env("calculator")
@dataclass(kw_only=True)
class Calculator(Env):
    """Multi-step arithmetic with the `calc` tool.

    Example::

        env = get_env("calculator", terms=3, digits=(2, 4))
        problem = next(env.problems("train", seed=0))   # "What is 4821 * 37 - 905 + 12?"
    """

    terms: int | tuple[int, int] = (3, 4)
    """Products in the expression (each `a * b`), a number or an inclusive range."""
    digits: int | tuple[int, int] = (2, 4)
    """Digits of each operand, a number or an inclusive range."""
    strict: bool = True
    """Credit only an answer on a "#### N" line, not a bare last number."""
    brief_tool: bool = False
    """List `calc` with a two-word description (calc_tool's `brief`): a shorter opening."""
    hint_first: bool = False
    """Put the hint ("Use the calc tool ...") before the question, so the question ends the
    prompt, next to the model's call: a small model learns to copy it sooner."""
    max_turns: int = 4
    max_tool_calls: int = 6

    def __post_init__(self) -> None:
        super().__post_init__()
        int_range(self.terms, "Calculator.terms", 1, 8)
        int_range(self.digits, "Calculator.digits", 1, 12)

    def tools(self) -> list[Tool]:
        return [calc_tool(brief=bool(self.brief_tool))]

    def problem(self, rng: random.Random) -> Problem:
        def operand() -> int:
            n = rng.randint(*int_range(self.digits, "Calculator.digits", 1, 12))
            return rng.randrange(10 ** (n - 1) if n > 1 else 0, 10**n)

        terms = rng.randint(*int_range(self.terms, "Calculator.terms", 1, 8))
        parts, value = [], 0
        for k in range(terms):
            a, b = operand(), operand()
            sign = 1 if k == 0 or rng.random() < 0.5 else -1
            parts.append(("" if k == 0 else " + " if sign > 0 else " - ") + f"{a} * {b}")
            value += sign * a * b
        expression = "".join(parts)
        hint, question = _TOOL_HINT.format(tool="calc"), f"What is {expression}?"
        prompt = f"{hint} {question}" if self.hint_first else f"{question} {hint}"
        return Problem(prompt, str(value))

    def grade(self, turn: Turn) -> Step:
        return _final(turn, self.reference, self.strict)


def _count_multiples(rng: random.Random) -> tuple[str, int]:
    a = rng.randrange(1, 5000)
    b = a + rng.randrange(500, 20000)
    k = rng.randrange(3, 40)
    return f"How many integers from {a} to {b} (inclusive) are divisible by {k}?", b // k - (
        a - 1
    ) // k


def _sum_squares(rng: random.Random) -> tuple[str, int]:
    a = rng.randrange(1, 300)
    b = a + rng.randrange(20, 400)
    return f"What is the sum of the squares of the integers from {a} to {b}?", sum(
        i * i for i in range(a, b + 1)
    )


def _primes_below(rng: random.Random) -> tuple[str, int]:
    n = rng.randrange(100, 5000)
    sieve = bytearray([1]) * n
    sieve[:2] = b"\0\0"
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytes(len(range(i * i, n, i)))
    return f"How many prime numbers are less than {n}?", sum(sieve)


def _digit_sum_power(rng: random.Random) -> tuple[str, int]:
    base, exp = rng.randrange(2, 13), rng.randrange(30, 200)
    return f"What is the sum of the digits of {base}**{exp}?", sum(map(int, str(base**exp)))


_PYTHON_KINDS = {
    "multiples": _count_multiples,
    "squares": _sum_squares,
    "primes": _primes_below,
    "digits": _digit_sum_power,
}


@register_env("python")
@dataclass(kw_only=True)
class PythonProblems(Env):
    """Problems whose answer needs a computation, with the sandboxed `python` tool.

    Example::

        env = get_env("python", kinds=["primes"])
        problem = next(env.problems("train", seed=0))   # "How many prime numbers are ..."
    """

    kinds: list[str] = field(default_factory=lambda: sorted(_PYTHON_KINDS))
    """Which problems: "multiples", "squares", "primes", "digits"."""
    sandbox: SandboxConfig = field(default_factory=lambda: SandboxConfig(wall_seconds=10.0))
    """Limits of each run of the model's code (tidal/rl/tools/sandbox.py)."""
    strict: bool = True
    """Credit only an answer on a "#### N" line, not a bare last number."""
    max_turns: int = 4
    max_tool_calls: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = sorted(set(self.kinds) - set(_PYTHON_KINDS)) if self.kinds else ["(none)"]
        if bad:
            raise ValueError(
                f"PythonProblems.kinds: unknown {bad}; choose from {sorted(_PYTHON_KINDS)}"
            )

    def tools(self) -> list[Tool]:
        return [python_tool(self.sandbox)]

    def problem(self, rng: random.Random) -> Problem:
        question, answer = _PYTHON_KINDS[rng.choice(sorted(self.kinds))](rng)
        return Problem(f"{question} " + _TOOL_HINT.format(tool="python"), str(answer))

    def grade(self, turn: Turn) -> Step:
        return _final(turn, self.reference, self.strict)


_INT = re.compile(r"-?\d+")


@register_env("guess")
@dataclass(kw_only=True)
class Guess(Env):
    """Guess a number with "Higher."/"Lower." feedback; no tools. Each problem draws its
    range's top from [high // 2, high] (so held-out games are other games) and the number in
    [low, top]. Reward 1 for the right number within `max_turns` guesses, else 0.

    Example::

        env = get_env("guess", high=50, max_turns=6)
        next(env.problems("train")).reference      # {"target": 17, "high": 38}
    """

    low: int = 1
    """The smallest number."""
    high: int = 100
    """The largest top of a range."""
    max_turns: int = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.low < self.high // 2:
            raise ValueError(
                f"Guess needs low < high // 2 (ranges of 2 numbers at least), got "
                f"low={self.low}, high={self.high}"
            )

    def problem(self, rng: random.Random) -> Problem:
        top = rng.randint(self.high // 2, self.high)
        target = rng.randint(self.low, top)
        prompt = (
            f"Guess my number from {self.low} to {top} in {self.max_turns} tries. "
            "Reply with one number; I say higher or lower."
        )
        return Problem(prompt, {"target": target, "high": top})

    def key(self, problem: Problem) -> str:
        return f"{problem.reference['target']}/{problem.reference['high']}"

    def step(self, turn: Turn) -> Step:
        target, top = self.reference["target"], self.reference["high"]
        numbers = _INT.findall(turn.content)
        if not numbers:
            reply = f"Reply with one number from {self.low} to {top}."
            return Step(messages=[{"role": "user", "content": reply}])
        guess = int(numbers[-1])
        if guess == target:
            return Step(done=True, reward=1.0, answer=str(guess), format_ok=True)
        reply = "Higher." if guess < target else "Lower."
        return Step(messages=[{"role": "user", "content": reply}], answer=str(guess))
