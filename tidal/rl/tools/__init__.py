"""Tools a model calls during a trajectory: `python` (a sandboxed subprocess) and `calc`.

    from tidal.rl.tools import make_tool

    python = make_tool("python", config=SandboxConfig(wall_seconds=5))
    python.spec()                                  # the OpenAI/Hermes function schema
    python({"code": "print(sum(range(10)))"})      # "45"
    make_tool("calc")({"expression": "2 ** 10"})   # "1024"

A tool takes the parsed JSON arguments of a call and returns the text the model reads next.
It never raises for what the model wrote: bad arguments, crashes and limits come back as a
``Tool error: ...`` sentence. What the sandbox guarantees, and where, is in sandbox.py's
docstring; `calc` never touches the OS (calc.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tidal.rl.tools.calc import calc, format_value
from tidal.rl.tools.sandbox import (
    Isolation,
    SandboxConfig,
    SandboxResult,
    probe_isolation,
    run_python,
)


@dataclass(kw_only=True, slots=True, frozen=True)
class Tool:
    """A function the model may call: its schema and how to run it."""

    name: str
    """The name the model calls it by."""
    description: str
    """What the model is told it does."""
    argument: str
    """Its one string argument (both built-in tools take one)."""
    argument_description: str
    """What the model is told the argument is."""
    run: Callable[[str], str]
    """The argument's value -> the text the model reads."""

    def spec(self) -> dict[str, Any]:
        """The OpenAI-style function schema that chat templates render for the model."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": {
                        self.argument: {"type": "string", "description": self.argument_description}
                    },
                    "required": [self.argument],
                },
            },
        }

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        """Run a call's parsed arguments; a tool error string for malformed ones."""
        if not isinstance(arguments, Mapping):
            return f"Tool error: {self.name} takes a JSON object of arguments"
        value = arguments.get(self.argument)
        if not isinstance(value, str):
            return f'Tool error: {self.name} needs a string argument "{self.argument}"'
        extra = sorted(set(arguments) - {self.argument})
        if extra:
            return f"Tool error: {self.name} takes only {self.argument!r}, not {extra}"
        return self.run(value)


def python_tool(config: SandboxConfig | None = None, max_chars: int = 4000) -> Tool:
    """The `python` tool: runs the code in the sandbox; stdout, stderr, or a limit's error,
    clipped to `max_chars`."""
    cfg = config or SandboxConfig()
    return Tool(
        name="python",
        description=(
            "Run a Python 3 program (standard library only, no network, no input) and "
            "return what it prints. Use print() to see values."
        ),
        argument="code",
        argument_description="The complete program.",
        run=lambda code: run_python(code, cfg).tool_text(max_chars),
    )


def calc_tool(max_length: int = 256, *, brief: bool = False) -> Tool:
    """The `calc` tool: exact arithmetic, see calc.py. `brief` describes it in two words and
    its argument in two (~30 fewer tokens in every opening that lists it: the small models of
    `make demo-tools`)."""
    return Tool(
        name="calc",
        description=(
            "Exact arithmetic."
            if brief
            else "Evaluate an arithmetic expression exactly: + - * / // % ** and parentheses, "
            "integers and decimals."
        ),
        argument="expression",
        argument_description="An expression." if brief else 'For example "(12.5 + 3) * 4 // 7".',
        run=lambda text: calc(text, max_length=max_length),
    )


TOOLS: dict[str, Callable[..., Tool]] = {"python": python_tool, "calc": calc_tool}
"""Built-in tools by name: each a factory taking that tool's options."""


def make_tool(name: str, **options: Any) -> Tool:
    """The built-in tool `name`, built with `options`.

    Raises:
        KeyError: an unknown tool name (the message lists the known ones).
    """
    if name not in TOOLS:
        raise KeyError(f"unknown tool {name!r}; known tools: {sorted(TOOLS)}")
    return TOOLS[name](**options)


__all__ = [
    "TOOLS",
    "Isolation",
    "SandboxConfig",
    "SandboxResult",
    "Tool",
    "calc",
    "calc_tool",
    "format_value",
    "make_tool",
    "probe_isolation",
    "python_tool",
    "run_python",
]
