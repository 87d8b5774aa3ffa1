"""`countdown`: combine the given numbers with + - * / and parentheses to reach a target.

Every problem is solvable: the target is built by combining all the numbers in a random
order with random operations whose intermediate results are positive integers. A completion
answers with its expression on a final "#### ..." line (or in `\\boxed{}`, or between
`<answer>` tags); an "= target" after it is ignored. The expression is parsed by
tidal/rl/tasks/expr.py (never eval'd); it scores 1 when its exact value equals the target and
it uses each given number at most once (a number given twice may be used twice).
Intermediate fractions are allowed ((8 / 3) * 3 reaches 8), unlike the TV show.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tidal.rl.tasks.answers import marked_answer
from tidal.rl.tasks.base import Grade, Problem, Task, int_range, register
from tidal.rl.tasks.expr import ExpressionError, evaluate

_ANSWER_TAG = re.compile(r"<answer>(?P<rest>.*?)</answer>", re.DOTALL)


def format_prompt(numbers: list[int], target: int) -> str:
    """The user message for one problem."""
    listed = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
    return (
        f"Using the numbers {listed}, write an arithmetic expression that equals {target}. "
        "You may use +, -, *, / and parentheses, and each number at most once. "
        'End with a line "#### <expression>".'
    )


def _expression_of(completion: str) -> str | None:
    marks = [(m.start(), m["rest"]) for m in _ANSWER_TAG.finditer(completion)]
    mark = marked_answer(completion)
    if mark is not None:
        marks.append(mark)
    if not marks:
        return None
    text = max(marks)[1].split("=")[0]
    return text.strip().rstrip(".").strip().strip("$`").strip().rstrip(".")


@register("countdown")
@dataclass(kw_only=True)
class Countdown(Task):
    """Reach a target from given numbers.

    Example::

        task = get_task("countdown", n_numbers=3)
        task.grade("#### (50 + 25) * 3", {"numbers": [3, 25, 50], "target": 225}).reward  # 1.0
    """

    n_numbers: int | tuple[int, int] = (3, 4)
    """How many numbers a problem gives: a number or an inclusive range."""
    max_number: int = 99
    """Numbers are drawn from 1..max_number."""
    max_target: int = 999
    """Targets lie in 1..max_target and differ from every given number."""
    use_all: bool = False
    """Credit only expressions that use every given number."""

    def __post_init__(self) -> None:
        super().__post_init__()
        int_range(self.n_numbers, "Countdown.n_numbers", 2, 8)
        if self.max_number < 1:
            raise ValueError(f"Countdown.max_number must be >= 1, got {self.max_number}")
        if self.max_target < 2:
            raise ValueError(f"Countdown.max_target must be >= 2, got {self.max_target}")

    def problem(self, rng: random.Random) -> Problem:
        k = rng.randint(*int_range(self.n_numbers, "Countdown.n_numbers", 2, 8))
        for _ in range(1000):
            numbers = [rng.randint(1, self.max_number) for _ in range(k)]
            target = _combine(list(numbers), rng)
            if target is not None and target <= self.max_target and target not in numbers:
                numbers.sort()
                return Problem(
                    format_prompt(numbers, target), {"numbers": numbers, "target": target}
                )
        raise RuntimeError(
            f"countdown: no target in 1..{self.max_target} after 1000 tries; raise max_target"
        )

    def key(self, problem: Problem) -> str:
        ref = problem.reference
        return f"{sorted(ref['numbers'])}->{ref['target']}"

    def grade(self, completion: str, reference: Any) -> Grade:
        numbers, target = list(reference["numbers"]), int(reference["target"])
        if not isinstance(completion, str):
            raise TypeError(f"completion must be a str, got {type(completion).__name__}")
        text = _expression_of(completion)
        if text is None:
            return Grade(reward=0.0, answer=None, format_ok=False)
        try:
            value, used = evaluate(text)
        except ExpressionError:
            return Grade(reward=0.0, answer=text[:256], format_ok=False)
        allowed, counts = Counter(numbers), Counter(used)
        fits = all(counts[x] <= allowed[x] for x in counts)
        if self.use_all:
            fits = fits and counts == allowed
        ok = fits and value == target
        return Grade(reward=1.0 if ok else 0.0, answer=text, format_ok=True)


def _combine(pool: list[int], rng: random.Random) -> int | None:
    """Fold the pool into one positive integer by random operations on random pairs."""
    while len(pool) > 1:
        a = pool.pop(rng.randrange(len(pool)))
        b = pool.pop(rng.randrange(len(pool)))
        ops = ["+", "*"] + (["-"] if a != b else []) + (["/"] if max(a, b) % min(a, b) == 0 else [])
        op = rng.choice(ops)
        hi, lo = max(a, b), min(a, b)
        pool.append({"+": a + b, "*": a * b, "-": hi - lo, "/": hi // lo}[op])
    return pool[0] if pool[0] >= 1 else None
