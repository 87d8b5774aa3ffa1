"""A tiny arithmetic parser for graders: integers, + - * /, parentheses. Nothing is eval'd.

Grammar (recursive descent, usual precedence, left-associative)::

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := INTEGER | "(" expr ")"

Values are exact fractions (7 / 2 is 7/2, not 3). `×`, `·` and `÷`, `−` are read as `*`, `/`,
`-`. No unary minus or plus (Countdown's rules: numbers are combined, not negated), no
decimals, no implicit multiplication. Limits keep hostile text cheap: at most `max_length`
characters, `max_depth` nested parentheses, `MAX_DIGITS` digits a literal.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import NamedTuple

MAX_DIGITS = 12
"""Most digits in one integer literal."""

_TOKEN = re.compile(r"\s*(?:(?P<num>[0-9]+)|(?P<op>[-+*/()\u00d7\u00b7\u00f7\u2212]))")
_CANON = {"\u00d7": "*", "\u00b7": "*", "\u00f7": "/", "\u2212": "-"}


class ExpressionError(ValueError):
    """Text that is not a valid expression (or divides by zero)."""


class Evaluated(NamedTuple):
    value: Fraction
    numbers: list[int]
    """The integer literals, in order of appearance."""


def _tokens(text: str) -> list[str | int]:
    out: list[str | int] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ExpressionError(f"unexpected character {text[pos]!r} at {pos}")
        if m["num"] is not None:
            if len(m["num"]) > MAX_DIGITS:
                raise ExpressionError(f"number with more than {MAX_DIGITS} digits at {pos}")
            out.append(int(m["num"]))
        else:
            out.append(_CANON.get(m["op"], m["op"]))
        pos = m.end()
    return out


def evaluate(text: str, *, max_length: int = 256, max_depth: int = 32) -> Evaluated:
    """The exact value of an arithmetic expression and the integers it uses.

    Raises:
        ExpressionError: empty, too long or too deeply nested text, an unexpected token,
            unbalanced parentheses, or a division by zero.

    Example::

        evaluate("(50 + 25) * 3 - 7 / 7")    # Evaluated(Fraction(224), [50, 25, 3, 7, 7])
    """
    if len(text) > max_length:
        raise ExpressionError(f"expression longer than {max_length} characters")
    toks = _tokens(text)
    numbers: list[int] = []
    pos = 0

    def peek() -> str | int | None:
        return toks[pos] if pos < len(toks) else None

    def expr(depth: int) -> Fraction:
        nonlocal pos
        value = term(depth)
        while peek() in ("+", "-"):
            op = toks[pos]
            pos += 1
            rhs = term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(depth: int) -> Fraction:
        nonlocal pos
        value = factor(depth)
        while peek() in ("*", "/"):
            op = toks[pos]
            pos += 1
            rhs = factor(depth)
            if op == "/" and rhs == 0:
                raise ExpressionError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def factor(depth: int) -> Fraction:
        nonlocal pos
        tok = peek()
        if isinstance(tok, int):
            pos += 1
            numbers.append(tok)
            return Fraction(tok)
        if tok == "(":
            if depth >= max_depth:
                raise ExpressionError(f"more than {max_depth} nested parentheses")
            pos += 1
            value = expr(depth + 1)
            if peek() != ")":
                raise ExpressionError("unbalanced parentheses: expected ')'")
            pos += 1
            return value
        raise ExpressionError(
            "unexpected end of expression" if tok is None else f"unexpected {tok!r}"
        )

    value = expr(0)
    if pos != len(toks):
        raise ExpressionError(f"unexpected {toks[pos]!r} after a complete expression")
    return Evaluated(value, numbers)
