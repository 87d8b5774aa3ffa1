"""The `calc` tool: arithmetic with tidal's own parser (tidal/rl/tasks/expr.py), never eval.

Reads ``+ - * / // % **``, parentheses, unary signs, integers and decimals (the parser's
``extended`` grammar), exactly, as fractions. Hostile text stays cheap on every platform: at
most `max_length` characters, 32 nested parentheses or powers, 40 digits a literal, and no
value over `max_bits` bits, checked before a power is computed (``9 ** 9 ** 9`` is refused in
microseconds). Nothing here touches the OS, so no sandbox is needed.
"""

from __future__ import annotations

from decimal import Decimal, localcontext
from fractions import Fraction

from tidal.rl.tasks.expr import ExpressionError, evaluate

MAX_DIGITS = 40
"""Most digits in one literal for the calculator."""


def format_value(value: Fraction, digits: int = 15) -> str:
    """`value` as the calculator prints it: integers in full, other values to `digits`
    significant digits (exact when they terminate within that).

    Example::

        format_value(Fraction(7, 2))   # "3.5"
        format_value(Fraction(2, 3))   # "0.666666666666667"
    """
    if value.denominator == 1:
        return str(value.numerator)
    with localcontext() as ctx:
        ctx.prec = digits
        dec = (Decimal(value.numerator) / Decimal(value.denominator)).normalize()
    if -7 <= dec.adjusted() < 21:
        return format(dec, "f")
    return format(dec, "e")


def calc(expression: str, *, max_length: int = 256, max_bits: int = 4096) -> str:
    """Evaluate `expression`; the result as text, or a ``Tool error: ...`` sentence.

    Never raises for anything in `expression`.

    Example::

        calc("(2 + 3) * 4 / 8")   # "2.5"
        calc("1 / 0")             # "Tool error: division by zero"
    """
    if not isinstance(expression, str):
        return f"Tool error: the expression must be a string, got {type(expression).__name__}"
    try:
        result = evaluate(
            expression,
            max_length=max_length,
            extended=True,
            max_digits=MAX_DIGITS,
            max_bits=max_bits,
        )
    except ExpressionError as e:
        return f"Tool error: {e}"
    return format_value(result.value)
