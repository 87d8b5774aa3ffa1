"""`addition`: "What is 457 + 168?", answered with a final line "#### 625".

The prompt text is `format_prompt(a, b)`, the one the warm-start SFT corpus uses: import it
there rather than retyping it. Each operand has a number of digits drawn from `digits`
(a leading digit of 1-9; 1-digit operands are 0-9), so carries come as they fall: about
half the columns of random operands carry.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tidal.rl.tasks.answers import grade_number
from tidal.rl.tasks.base import Grade, Problem, Task, int_range, register


def format_prompt(a: int, b: int) -> str:
    """The user message for a + b."""
    return f"What is {a} + {b}?"


@register("addition")
@dataclass(kw_only=True)
class Addition(Task):
    """n-digit addition.

    Example::

        task = get_task("addition", digits=(1, 3))
        prompt, reference = next(task.problems("train", seed=0))   # "What is 7 + 305?", "312"
        task.grade("7 + 305 = 312\\n#### 312", reference).reward     # 1.0
    """

    digits: int | tuple[int, int] = 3
    """Digits of each operand: a number, or an inclusive range (each operand draws its own)."""
    strict: bool = False
    """Credit only an answer on a "#### N" line (or in \\boxed{}), not a bare last number."""

    def __post_init__(self) -> None:
        super().__post_init__()
        int_range(self.digits, "Addition.digits", 1, 50)

    def _operand(self, rng: random.Random) -> int:
        n = rng.randint(*int_range(self.digits, "Addition.digits", 1, 50))
        return rng.randrange(10 ** (n - 1) if n > 1 else 0, 10**n)

    def problem(self, rng: random.Random) -> Problem:
        a, b = self._operand(rng), self._operand(rng)
        return Problem(format_prompt(a, b), str(a + b))

    def key(self, problem: Problem) -> str:
        # a + b and b + a are one problem: both go to the same split.
        a, b = problem.prompt.removeprefix("What is ").removesuffix("?").split(" + ")
        return "+".join(sorted((a, b), key=int))

    def grade(self, completion: str, reference: Any) -> Grade:
        return grade_number(completion, reference, strict=self.strict)
