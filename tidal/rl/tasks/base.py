"""What a task is, and the registry of tasks by name.

A task is a dataclass of its parameters (difficulty and the like) with two methods:
`problem(rng)` draws one `Problem(prompt, reference)` and `grade(completion, reference)`
scores a completion to a `Grade` with a reward in [0, 1]. The base class turns `problem`
into seeded train and held-out eval streams that never share a problem.

Splits: every problem has a key (`Task.key`, by default its prompt; tasks override it to
name problems that are the same, e.g. "457 + 168" and "168 + 457"). A problem is in the eval
split when a 64-bit BLAKE2 hash of the task name and key falls below `eval_fraction` of the
hash range, else in train. Each split's stream draws problems from its own seeded generator
and skips those of the other split, so no eval problem is ever yielded for training, in any
process, for any seed. Raising `eval_fraction` only moves problems from train to eval.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple, TypeVar

Split = Literal["train", "eval"]

MAX_SKIPS = 10_000
"""Draws in a row that may land in the other split before a stream gives up (a problem
space too small for the split asked for)."""


class Problem(NamedTuple):
    """One prompt and what its grader needs to score a completion."""

    prompt: str
    """The user message, a plain string (the caller applies any chat template)."""
    reference: Any
    """The expected answer or grading data: plain values only (str, int, float, lists and
    dicts of them), so it can travel through the store with a rollout."""


@dataclass(frozen=True, slots=True)
class Grade:
    """A grader's verdict on one completion."""

    reward: float
    """In [0, 1]."""
    answer: str | None
    """The answer the grader parsed from the completion (normalized), None if none."""
    format_ok: bool
    """The answer was given in the task's format (e.g. a final "#### N" line)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.reward <= 1.0:
            raise ValueError(f"Grade.reward must be in [0, 1], got {self.reward}")

    def to_dict(self) -> dict[str, Any]:
        return {"reward": self.reward, "answer": self.answer, "format_ok": self.format_ok}


@dataclass(kw_only=True)
class Task(ABC):
    """Base class of tasks: subclass it as a dataclass of parameters, write `problem` and
    `grade`, and decorate it with `@register("name")`.

    Example::

        @register("multiply")
        @dataclass(kw_only=True)
        class Multiply(Task):
            digits: int = 2

            def problem(self, rng):
                a, b = (rng.randrange(10 ** (self.digits - 1), 10**self.digits) for _ in "ab")
                return Problem(f"What is {a} * {b}?", str(a * b))

            def grade(self, completion, reference):
                return grade_number(completion, reference)
    """

    name: ClassVar[str] = ""
    """Set by `register`."""

    eval_fraction: float = 0.1
    """Share of the problem space held out for evaluation (by a hash of each problem's key)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(
                f"{type(self).__name__}.eval_fraction must be in (0, 1), got {self.eval_fraction}"
            )

    @abstractmethod
    def problem(self, rng: random.Random) -> Problem:
        """Draw one problem, using only `rng` for randomness."""

    @abstractmethod
    def grade(self, completion: str, reference: Any) -> Grade:
        """Score a completion's text against a problem's reference. Never raises on what a
        model wrote: a completion without an answer gets reward 0."""

    def key(self, problem: Problem) -> str:
        """What identifies a problem for the train/eval split (default: its prompt). Problems
        with equal keys are always in the same split."""
        return problem.prompt

    def split_of(self, problem: Problem) -> Split:
        """ "eval" or "train": a hash of the task name and the problem's key."""
        data = f"{self.name}\0{self.key(problem)}".encode()
        h = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
        return "eval" if h < self.eval_fraction * 2**64 else "train"

    def problems(self, split: Split = "train", *, seed: int = 0) -> Iterator[Problem]:
        """An endless, deterministic stream of the split's problems for `seed` (repeats are
        possible in small problem spaces).

        Raises:
            ValueError: `split` is neither "train" nor "eval".
            RuntimeError: `MAX_SKIPS` draws in a row fell in the other split.

        Example::

            for prompt, reference in itertools.islice(task.problems("train", seed=rank), 64):
                ...
        """
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rng = random.Random(f"tidal.rl.tasks:{self.name}:{split}:{seed}")
        skipped = 0
        while True:
            p = self.problem(rng)
            if self.split_of(p) == split:
                skipped = 0
                yield p
                continue
            skipped += 1
            if skipped >= MAX_SKIPS:
                raise RuntimeError(
                    f"task {self.name!r}: {MAX_SKIPS} draws in a row fell outside the "
                    f"{split!r} split; its problem space is too small for eval_fraction="
                    f"{self.eval_fraction}"
                )

    def eval_set(self, n: int, *, seed: int = 0) -> list[Problem]:
        """`n` distinct eval problems (by key), the same ones for the same parameters and seed.

        Raises:
            RuntimeError: the eval split has fewer than `n` distinct problems within reach.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        out: list[Problem] = []
        seen: set[str] = set()
        stream = self.problems("eval", seed=seed)
        budget = 100 * n + 1000
        while len(out) < n:
            if budget == 0:
                raise RuntimeError(
                    f"task {self.name!r}: found only {len(out)} distinct eval problems of the "
                    f"{n} asked for; use a larger eval_fraction or problem space"
                )
            budget -= 1
            p = next(stream)
            if (k := self.key(p)) not in seen:
                seen.add(k)
                out.append(p)
        return out


def int_range(value: Any, field: str, lo: int, hi: int) -> tuple[int, int]:
    """An int or an inclusive (a, b) range (a list from a config file too) as (a, b), checked
    to satisfy lo <= a <= b <= hi; a ValueError naming `field` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        a = b = value
    elif (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    ):
        a, b = value
    else:
        a, b = lo - 1, lo - 1
    if not lo <= a <= b <= hi:
        raise ValueError(
            f"{field} must be an int or an inclusive range (a, b) with {lo} <= a <= b <= {hi}, "
            f"got {value!r}"
        )
    return a, b


TASKS: dict[str, type[Task]] = {}
"""Registered tasks by name."""

T = TypeVar("T", bound=type[Task])


def register(name: str) -> Callable[[T], T]:
    """Class decorator: make a `Task` subclass available as `get_task(name, ...)`.

    Raises:
        ValueError: the name is taken by another class. TypeError: not a Task subclass.
    """

    def deco(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise TypeError(f"register({name!r}) decorates Task subclasses, got {cls!r}")
        old = TASKS.get(name)
        if old is not None and old.__qualname__ != cls.__qualname__:
            raise ValueError(f"task name {name!r} is already registered by {old.__qualname__}")
        cls.name = name
        TASKS[name] = cls
        return cls

    return deco


def get_task(name: str, **params: Any) -> Task:
    """A registered task built with the given parameters.

    Raises:
        ValueError: unknown task name (the message lists the registered ones).
        TypeError: a parameter the task does not have (the message lists those it has).
        ModuleNotFoundError: the task needs an optional package that is not installed.

    Example::

        task = get_task("addition", digits=(2, 4))
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    cls = TASKS[name]
    allowed = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise TypeError(f"task {name!r} has no parameter {unknown[0]!r}; its parameters: {allowed}")
    return cls(**params)
