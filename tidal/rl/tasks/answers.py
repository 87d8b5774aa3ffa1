"""Final answers out of free text, and numeric grading.

Where the answer is, in order of trust:

1. a marked answer: the last `#### ...` line or `\\boxed{...}` (also `\\fbox{}`), whichever comes
   last in the text; the first number inside it is the answer (`#### $1,234.50` -> 1234.50);
2. otherwise the last number anywhere in the text.

A number is ASCII digits with an optional sign (`-`, `+`, or the Unicode minus `−`, taken as a
sign only where it cannot be a binary minus: "10-3" holds 10 and 3), thousands commas
(`1,234,567`), a decimal part (`3.50`, `.5`) and a denominator (`3/4`, `\\frac{3}{4}`).
Percent and currency signs around it are ignored. Numbers compare exactly as fractions
(625 == 625.00 == +625 == 1250/2). Runs of more than 100 digits are not numbers (no
int-conversion blowups on adversarial text); a zero denominator is not a number.

Not handled (an answer in these forms gets no credit): scientific notation (`1e5` reads as
1), words ("five"), mixed numbers ("1 1/2" reads as 1 and 1/2).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import NamedTuple

from tidal.rl.tasks.base import Grade

# A sign only where the previous character cannot end an operand (digit, letter, ")" ...).
_NUMBER = re.compile(
    r"(?<![\w.)\]}])(?P<sign>[-+\u2212])?"
    r"(?<![\w.])(?P<body>[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|[0-9]{1,100}(?:\.[0-9]+)?|\.[0-9]+)"
    r"(?:[ \t]*/[ \t]*(?P<den>[0-9]{1,100}))?(?![0-9])"
)
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*([-+\u2212]?[0-9]{1,100})\s*\}\s*\{\s*([0-9]{1,100})\s*\}")
_HASHES = re.compile(r"####[ \t]*(?P<rest>[^\n]*)")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


class Answer(NamedTuple):
    text: str
    """The answer as written, cleaned: "-1234.5" for "−1,234.5"."""
    value: Fraction
    marked: bool
    """Found in a `####` line or `\\boxed{}` (the expected formats), not as a last number."""


def _numbers(text: str) -> list[tuple[str, Fraction]]:
    out = []
    for m in _NUMBER.finditer(_FRAC.sub(r"\1/\2", text)):
        sign = "-" if m["sign"] in ("-", "\u2212") else ""
        body = m["body"].replace(",", "")
        if len(body) > 100 or (m["den"] is not None and int(m["den"]) == 0):
            continue  # (the decimal part is unbounded in the pattern)
        value = Fraction(sign + body)
        if m["den"] is not None:
            value /= int(m["den"])
            body += "/" + m["den"]
        out.append((sign + body, value))
    return out


def _boxed_contents(text: str) -> list[tuple[int, str]]:
    """(start, content) of every `\\boxed{...}` with balanced braces."""
    out = []
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append((m.start(), text[m.end() : i - 1]))
    return out


def marked_answer(text: str) -> tuple[int, str] | None:
    """(position, content) of the last marked answer: a `#### ...` line's rest or a
    `\\boxed{...}`'s content, whichever starts last; None if there is neither."""
    marks = [(m.start(), m["rest"]) for m in _HASHES.finditer(text)]
    marks += _boxed_contents(text)
    return max(marks) if marks else None


def extract_answer(text: str) -> Answer | None:
    """The final numeric answer of a completion, or None if it holds no number.

    Example::

        extract_answer("457 + 168 = 625\\n#### 625")      # Answer("625", Fraction(625), True)
        extract_answer("so the total is $1,234.")       # Answer("1234", ..., marked=False)
    """
    if not isinstance(text, str):
        raise TypeError(
            f"completion must be a str, got {type(text).__name__} (Sample.text is None when "
            "the Generator has no tokenizer)"
        )
    mark = marked_answer(text)
    if mark is not None:
        nums = _numbers(mark[1])
        if nums:
            return Answer(nums[0][0], nums[0][1], True)
    nums = _numbers(text)
    if nums:
        return Answer(nums[-1][0], nums[-1][1], False)
    return None


def parse_number(text: str) -> Fraction:
    """The value of a reference answer such as "625", "-3.5" or "1,234".

    Raises:
        ValueError: `text` is not exactly one number.
    """
    nums = _numbers(str(text))
    if len(nums) != 1 or _NUMBER.sub("", str(text)).strip():
        raise ValueError(f"reference answer must be one number, got {text!r}")
    return nums[0][1]


def grade_number(completion: str, reference: str | int, *, strict: bool = False) -> Grade:
    """Reward 1 when the completion's final answer equals the reference number, else 0.

    Args:
        completion: the completion text.
        reference: the expected number, as a string ("625", "12.5") or an int.
        strict: credit only a marked answer (`#### N` or `\\boxed{N}`), not a last number.

    Returns:
        Grade(reward, the parsed answer or None, format_ok: the answer was marked).
    """
    expected = parse_number(str(reference))
    ans = extract_answer(completion)
    if ans is None:
        return Grade(reward=0.0, answer=None, format_ok=False)
    correct = ans.value == expected and (ans.marked or not strict)
    return Grade(reward=1.0 if correct else 0.0, answer=ans.text, format_ok=ans.marked)
