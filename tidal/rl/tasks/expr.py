"""A tiny arithmetic parser for graders: integers, + - * /, parentheses. Nothing is eval'd.

Grammar (recursive descent, usual precedence, left-associative)::

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := INTEGER | "(" expr ")"

Values are exact fractions (7 / 2 is 7/2, not 3). `×`, `·` and `÷`, `−` are read as `*`, `/`,
`-`. No unary minus or plus (Countdown's rules: numbers are combined, not negated), no
decimals, no implicit multiplication. Limits keep hostile text cheap: at most `max_length`
characters, `max_depth` nested parentheses, `MAX_DIGITS` digits a literal.

`extended=True` is the calculator's grammar (the `calc` tool, tidal/rl/tools/calc.py)::

    term   := unary (("*" | "/" | "//" | "%") unary)*
    unary  := ("-" | "+") unary | power
    power  := atom ("**" unary)?          (right-associative: 2 ** 3 ** 2 is 2 ** 9)
    atom   := INTEGER | DECIMAL | "(" expr ")"

`//` and `%` floor as Python's do; `-2 ** 2` is -4. Exponents must be integers, and no
intermediate value may need more than `max_bits` bits (numerator or denominator): the size of
a power is checked before it is computed, so ``9 ** 9 ** 9`` is refused at once.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import NamedTuple

MAX_DIGITS = 12
"""Most digits in one integer literal."""

_TOKEN = re.compile(r"\s*(?:(?P<num>[0-9]+)|(?P<op>[-+*/()\u00d7\u00b7\u00f7\u2212]))")
_TOKEN_EXTENDED = re.compile(
    r"\s*(?:(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)|(?P<op>\*\*|//|[-+*/%()\u00d7\u00b7\u00f7\u2212]))"
)
_CANON = {"\u00d7": "*", "\u00b7": "*", "\u00f7": "/", "\u2212": "-"}


class ExpressionError(ValueError):
    """Text that is not a valid expression (or divides by zero)."""


class Evaluated(NamedTuple):
    value: Fraction
    numbers: list[int]
    """The integer literals, in order of appearance."""


def _tokens(
    text: str, extended: bool = False, max_digits: int = MAX_DIGITS
) -> list[str | int | Fraction]:
    out: list[str | int | Fraction] = []
    pos = 0
    text = text.rstrip()
    pattern = _TOKEN_EXTENDED if extended else _TOKEN
    while pos < len(text):
        m = pattern.match(text, pos)
        if m is None:
            raise ExpressionError(f"unexpected character {text[pos]!r} at {pos}")
        if m["num"] is not None:
            if len(m["num"].replace(".", "")) > max_digits:
                raise ExpressionError(f"number with more than {max_digits} digits at {pos}")
            out.append(int(m["num"]) if m["num"].isdigit() else Fraction(m["num"]))
        else:
            out.append(_CANON.get(m["op"], m["op"]))
        pos = m.end()
    return out


def evaluate(
    text: str,
    *,
    max_length: int = 256,
    max_depth: int = 32,
    extended: bool = False,
    max_digits: int = MAX_DIGITS,
    max_bits: int = 4096,
) -> Evaluated:
    """The exact value of an arithmetic expression and the integers it uses.

    `extended` reads the calculator's grammar (see the module docstring); `max_bits` bounds
    its values. Both are ignored by the default (Countdown) grammar, as are decimals, which
    are not listed in `numbers`.

    Raises:
        ExpressionError: empty, too long or too deeply nested text, an unexpected token,
            unbalanced parentheses, or a division by zero; with `extended`, also a
            non-integer exponent, 0 to a negative power, or a value over `max_bits`.

    Example::

        evaluate("(50 + 25) * 3 - 7 / 7")    # Evaluated(Fraction(224), [50, 25, 3, 7, 7])
    """
    if len(text) > max_length:
        raise ExpressionError(f"expression longer than {max_length} characters")
    toks = _tokens(text, extended, max_digits)
    numbers: list[int] = []
    pos = 0

    def peek() -> str | int | Fraction | None:
        return toks[pos] if pos < len(toks) else None

    def sized(value: Fraction) -> Fraction:
        if max(value.numerator.bit_length(), value.denominator.bit_length()) > max_bits:
            raise ExpressionError(f"a value needs more than {max_bits} bits")
        return value

    def power(base: Fraction, exp: Fraction) -> Fraction:
        if exp.denominator != 1:
            raise ExpressionError(f"non-integer exponent {exp}")
        if base == 0 and exp < 0:
            raise ExpressionError("division by zero (0 to a negative power)")
        size = max(base.numerator.bit_length(), base.denominator.bit_length())
        if size > 1 and (size - 1) * abs(exp.numerator) > max_bits:
            raise ExpressionError(f"a value needs more than {max_bits} bits")
        return sized(base**exp.numerator)

    def binary(op: object, lhs: Fraction, rhs: Fraction) -> Fraction:
        if op in ("/", "//", "%") and rhs == 0:
            raise ExpressionError("division by zero")
        if op == "+":
            return lhs + rhs
        if op == "-":
            return lhs - rhs
        if op == "*":
            return lhs * rhs
        if op == "/":
            return lhs / rhs
        return Fraction(lhs // rhs) if op == "//" else lhs % rhs

    def expr(depth: int) -> Fraction:
        nonlocal pos
        if extended:
            value = term_ext(depth)
            while peek() in ("+", "-"):
                op = toks[pos]
                pos += 1
                value = sized(binary(op, value, term_ext(depth)))
            return value
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

    def term_ext(depth: int) -> Fraction:
        nonlocal pos
        value = unary(depth)
        while peek() in ("*", "/", "//", "%"):
            op = toks[pos]
            pos += 1
            value = sized(binary(op, value, unary(depth)))
        return value

    def unary(depth: int) -> Fraction:
        nonlocal pos
        negate = False
        while peek() in ("-", "+"):
            negate ^= toks[pos] == "-"
            pos += 1
        value = factor(depth)
        if peek() == "**":
            if depth >= max_depth:
                raise ExpressionError(f"more than {max_depth} nested powers and parentheses")
            pos += 1
            value = power(value, unary(depth + 1))
        return -value if negate else value

    def factor(depth: int) -> Fraction:
        nonlocal pos
        tok = peek()
        if isinstance(tok, Fraction):
            pos += 1
            return tok
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
