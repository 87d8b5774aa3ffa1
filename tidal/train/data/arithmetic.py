"""Arithmetic problems with worked solutions, generated in code: an offline SFT corpus whose
answers can be checked, for the RL tasks that start from it.

A problem is a chat sample: the user asks "What is 457 + 168?" and the assistant works it out
column by column, units first, and ends with a line `#### N`:

    457 + 168: 7 + 8 = 15, carry 1, so far 5
    45 + 16: 5 + 6 + 1 = 12, carry 1, so far 25
    4 + 1: 4 + 1 + 1 = 6, so far 625
    #### 625

Each line starts with what is left of the operands (the previous line's, last digit dropped),
so the digits it adds are the ones just written, and ends with the digits of the result found
so far, the previous line's with one more in front: every step reads only nearby text. A plain
column list ("5 + 6 + 1 = 12, write 2, carry 1") makes the model count columns back through
the prompt and the answer back through the lines: with the `sft_addition` run (300 steps of
the debug model) it reached 30% held-out exact match, this format 67%.

Forms (`FORM[:MIN-MAX]`, MIN-MAX the number of digits of each operand, drawn uniformly):

- `add` (default 1-4): a + b, one line per column of the longer operand; an operand that has
  run out is 0; the last column writes its whole sum.
- `sub` (default 1-4): a - b with a >= b; a column that borrows adds 10 to its top digit and
  says `borrow 1`, the next subtracts it (`5 - 1 - 1 = 3`); the final line drops leading zeros.
- `mul` (default 1-4): a * d with a single digit d, one line per digit of a with its carry.

A form may add `:slip=P` (`add:1-4:slip=0.6`, add only): an imperfect teacher, whose worked
solution forgets an incoming carry with probability P in each column that has one, and whose
`####` answer follows the slip. SFT on it imitates the slips; an RL reward that checks the true
sum can then do better than the teacher (the `make demo` warm start, docs/rl.md).

Graders read the final answer with `parse_answer`: the integer after the last `####`, or
failing that the last integer in the text.

Splits: an `add` problem belongs to the validation split exactly when it is in the held-out
split of the RL `addition` task (tidal/rl/tasks: a 64-bit BLAKE2 of "addition", a NUL and
"A+B" with the smaller operand first, below 10% of the range), so an SFT warm start never
trains on the problems its RL run is scored on. Other problems are held out when the sha256 of
their key (`"sub:457:168"`) is 0 mod 20. The splits never share a problem whatever the seed or
sizes. Within a split, problems are drawn with a seeded `random.Random` and may repeat.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

FORMS: dict[str, tuple[int, int]] = {"add": (1, 4), "sub": (1, 4), "mul": (1, 4)}
"""Problem forms and their default operand digit ranges."""

_SYMBOL = {"add": "+", "sub": "-", "mul": "*"}
_VAL_MODULUS = 20  # one sub or mul problem in 20 is held out
_ADD_VAL_FRACTION = 0.1  # the RL addition task's default eval_fraction
_FINAL = re.compile(r"####\s*(-?\d+)")
_INT = re.compile(r"-?\d+")

Split = Literal["train", "val"]


class FormSpec(NamedTuple):
    """One part of a spec: a form, its operand digit range and the teacher's slip rate."""

    form: str
    lo: int
    hi: int
    slip: float = 0.0
    """Probability of forgetting an incoming carry in a column (add only); 0 is a perfect
    teacher."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One arithmetic problem and its worked solution."""

    form: str
    """add, sub or mul."""
    a: int
    b: int
    prompt: str
    """The question, e.g. "What is 457 + 168?"."""
    solution: str
    """The worked answer; its last line is `#### <answer>`."""
    answer: int
    """The answer the solution works out: the true one unless the teacher slipped."""

    @property
    def key(self) -> str:
        """Identity of the problem, e.g. "add:457:168" (what the split hashes)."""
        return f"{self.form}:{self.a}:{self.b}"

    def messages(self) -> list[dict[str, str]]:
        """The problem as a chat sample: a user turn and the assistant's worked answer."""
        return [
            {"role": "user", "content": self.prompt},
            {"role": "assistant", "content": self.solution},
        ]


def parse_spec(spec: str, *, where: str = "spec") -> list[FormSpec]:
    """`"add:1-4,sub"` -> [("add", 1, 4, 0.0), ("sub", 1, 4, 0.0)]; empty is `add` with its
    defaults; `"add:1-3:slip=0.6"` is a teacher that forgets 60% of its carries.

    Raises:
        ValueError: an unknown form, a bad digit range or slip, naming `where`.
    """
    out = []
    for part in (p.strip() for p in (spec or "add").split(",")):
        form, *rest = part.split(":")
        if form not in FORMS:
            raise ValueError(
                f"{where}: unknown arithmetic form {form!r} in {spec!r}; forms are "
                f"{sorted(FORMS)}, written FORM, FORM:MIN-MAX or FORM:MIN-MAX:slip=P "
                "(e.g. add:1-4)"
            )
        lo, hi = FORMS[form]
        slip = 0.0
        for opt in rest:
            if opt.startswith("slip="):
                slip = _slip(opt.removeprefix("slip="), form, spec, where)
                continue
            m = re.fullmatch(r"(\d+)-(\d+)", opt)
            if not m or not 1 <= int(m[1]) <= int(m[2]) <= 18:
                raise ValueError(
                    f"{where}: bad digit range {opt!r} in {spec!r}; expected MIN-MAX with "
                    "1 <= MIN <= MAX <= 18 (e.g. add:2-5)"
                )
            lo, hi = int(m[1]), int(m[2])
        out.append(FormSpec(form, lo, hi, slip))
    return out


def _slip(text: str, form: str, spec: str, where: str) -> float:
    try:
        slip = float(text)
    except ValueError:
        slip = -1.0
    if not 0.0 <= slip <= 1.0:
        raise ValueError(f"{where}: slip={text!r} in {spec!r} must be a probability in [0, 1]")
    if form != "add" and slip:
        raise ValueError(f"{where}: slip applies to add (a forgotten carry), not {form!r}")
    return slip


def split_of(key: str) -> Split:
    """The split a problem key belongs to (fixed by the key alone)."""
    form, a, b = key.split(":")
    if form == "add":
        # The RL addition task's split (Task.split_of, eval_fraction 0.1), kept equal by a test.
        rl_key = "+".join(sorted((a, b), key=int))
        data = f"addition\0{rl_key}".encode()
        h = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
        return "val" if h < _ADD_VAL_FRACTION * 2**64 else "train"
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return "val" if h % _VAL_MODULUS == 0 else "train"


def make_problem(
    form: str, a: int, b: int, *, slip: float = 0.0, rng: random.Random | None = None
) -> Problem:
    """The problem `a <form> b` with its worked solution; with `slip` (add only) the solution
    forgets each incoming carry with that probability (drawn from `rng`), and its answer is the
    one it works out."""
    if a < 0 or b < 0:
        raise ValueError(f"operands must be non-negative, got {a} and {b}")
    if slip and (form != "add" or rng is None):
        raise ValueError("slip needs form 'add' and an rng to draw the slips from")
    if form == "add":
        lines, answer = _add_steps(a, b, slip, rng)
    elif form == "sub":
        if a < b:
            raise ValueError(f"sub problems need a >= b, got {a} - {b}")
        lines, answer = _sub_steps(a, b), a - b
    elif form == "mul":
        if not 0 <= b <= 9:
            raise ValueError(f"mul problems multiply by one digit, got {b}")
        lines, answer = _mul_steps(a, b), a * b
    else:
        raise ValueError(f"unknown arithmetic form {form!r}; forms are {sorted(FORMS)}")
    solution = "\n".join([*lines, f"#### {answer}"])
    return Problem(
        form=form,
        a=a,
        b=b,
        prompt=f"What is {a} {_SYMBOL[form]} {b}?",
        solution=solution,
        answer=answer,
    )


def generate(
    spec: str | Sequence[FormSpec], n: int, *, split: Split, seed: int = 0
) -> list[Problem]:
    """`n` problems of the forms in `spec` (each form equally likely) from `split`.

    Deterministic in (spec, n, split, seed); the train and val splits never share a problem.

    Raises:
        ValueError: a bad spec, or a split with no problem of some form (ranges so small that
            every problem hashes to the other split).
    """
    forms = parse_spec(spec) if isinstance(spec, str) else [FormSpec(*f) for f in spec]
    # Seeded by the parts as plain tuples, slip only where set: a spec without slips draws the
    # corpus it drew before slips existed.
    parts = [tuple(f) if f.slip else tuple(f[:3]) for f in forms]
    rng = random.Random(f"tidal-arithmetic|{seed}|{split}|{parts}")
    out: list[Problem] = []
    misses = 0
    while len(out) < n:
        form, lo, hi, slip = forms[rng.randrange(len(forms))]
        a = _number(rng, lo, hi)
        b = rng.randrange(10) if form == "mul" else _number(rng, lo, hi)
        if form == "sub" and a < b:
            a, b = b, a
        if split_of(f"{form}:{a}:{b}") != split:
            misses += 1
            if misses > 1000 + 100 * n:
                raise ValueError(
                    f"cannot draw {n} {split} problems from {forms}: the ranges hold too few "
                    "problems of that split; widen the digit ranges"
                )
            continue
        out.append(make_problem(form, a, b, slip=slip, rng=rng))
    return out


def parse_answer(text: str) -> int | None:
    """The final answer of a worked solution: the integer after the last `####`, else the
    last integer in `text`, else None.

    Example::

        parse_answer("7 + 8 = 15, write 5, carry 1\\n...\\n#### 625")  # 625
    """
    finals = _FINAL.findall(text)
    if finals:
        return int(finals[-1])
    ints = _INT.findall(text)
    return int(ints[-1]) if ints else None


def _number(rng: random.Random, lo: int, hi: int) -> int:
    """A number whose digit count is uniform in [lo, hi] (one digit includes 0)."""
    digits = rng.randint(lo, hi)
    if digits == 1:
        return rng.randrange(10)
    return rng.randrange(10 ** (digits - 1), 10**digits)


def _digits(x: int, width: int) -> list[int]:
    """Digits of `x`, units first, padded with zeros to `width`."""
    return [(x // 10**i) % 10 for i in range(width)]


def _add_steps(a: int, b: int, slip: float, rng: random.Random | None) -> tuple[list[str], int]:
    width = max(len(str(a)), len(str(b)))
    lines, carry, so_far = [], 0, ""
    for i in range(width):
        ra, rb = a // 10**i, b // 10**i  # what is left of each operand
        if carry and slip and rng is not None and rng.random() < slip:
            carry = 0  # the teacher forgets the carry it just wrote down
        terms = f"{ra % 10} + {rb % 10}" + (f" + {carry}" if carry else "")
        total = ra % 10 + rb % 10 + carry
        last = i == width - 1
        carry = 0 if last else total // 10
        so_far = (str(total) if last else str(total % 10)) + so_far
        lines.append(
            f"{ra} + {rb}: {terms} = {total}"
            + (f", carry {carry}" if carry else "")
            + f", so far {so_far}"
        )
    return lines, int(so_far)


def _sub_steps(a: int, b: int) -> list[str]:
    width = len(str(a))
    lines, borrow, so_far = [], 0, ""
    for i in range(width):
        ra, rb = a // 10**i, b // 10**i
        top, bottom = ra % 10, rb % 10
        new_borrow = 1 if top - borrow < bottom else 0
        top += 10 * new_borrow
        terms = f"{top} - {bottom}" + (f" - {borrow}" if borrow else "")
        diff = top - bottom - borrow
        so_far = str(diff) + so_far
        lines.append(
            f"{ra} - {rb}: {terms} = {diff}"
            + (", borrow 1" if new_borrow else "")
            + f", so far {so_far}"
        )
        borrow = new_borrow
    assert borrow == 0, f"{a} - {b} left a borrow"
    return lines


def _mul_steps(a: int, d: int) -> list[str]:
    width = len(str(a))
    lines, carry, so_far = [], 0, ""
    for i in range(width):
        ra = a // 10**i
        terms = f"{ra % 10} * {d}" + (f" + {carry}" if carry else "")
        total = (ra % 10) * d + carry
        last = i == width - 1
        carry = 0 if last else total // 10
        so_far = (str(total) if last else str(total % 10)) + so_far
        lines.append(
            f"{ra} * {d}: {terms} = {total}"
            + (f", carry {carry}" if carry else "")
            + f", so far {so_far}"
        )
    return lines
