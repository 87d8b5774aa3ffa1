"""Tool calls in the chat template's format: rendering tool specs and results, parsing calls.

The model sees its tools and writes calls in the Hermes/Qwen format:

- the tools are listed as JSON, one a line, inside ``<tools></tools>`` in the system turn;
- a call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the assistant's text;
- each result comes back in a ``tool`` turn, inside ``<tool_response></tool_response>``.

Which template writes it (`tool_format`):

- ``"template"``: the chat template reads a `tools` variable (HF templates with tool support:
  Qwen 2.5 and 3, Hermes 2 Pro): it gets the specs as `tools`, tool turns as ``tool`` messages
  and earlier calls as the assistant's ``tool_calls``, and renders them its own way;
- ``"hermes"``: a template without a `tools` variable that still renders a ``system`` and a
  ``tool`` turn (tidal's built-in ChatML, most ChatML templates): tidal writes the Hermes system
  block, the ``<tool_call>`` text and the ``<tool_response>`` wrapping into the messages;
- otherwise (a template that refuses or drops those roles) a tool conversation is a ValueError
  naming the template, before any work.

Example::

    from tidal.rl.envs.tool_calls import parse_tool_calls, render_chat
    from tidal.rl.tools import make_tool

    calc = make_tool("calc")
    text = render_chat(template, [{"role": "user", "content": "2**10?"}], tools=[calc.spec()])
    content, calls, errors = parse_tool_calls(
        '<tool_call>{"name": "calc", "arguments": {"expression": "2**10"}}</tool_call>',
        tools=[calc.spec()],
    )
    calls[0].name, calls[0].arguments      # "calc", {"expression": "2**10"}

`parse_tool_calls` never raises for what the model wrote: a malformed call, an unknown tool or
bad arguments become an error sentence, returned to the model as that call's tool result.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from tidal.train.data.chat import ChatTemplate, Messages

ToolFormat = Literal["template", "hermes"]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


@dataclass(slots=True, frozen=True)
class ToolCall:
    """One well-formed call the model wrote."""

    name: str
    """The tool's name."""
    arguments: dict[str, Any] = field(default_factory=dict)
    """Its parsed JSON arguments."""
    index: int = 0
    """Its position among the ``<tool_call>`` blocks of the turn (0-based), errors included."""

    def text(self) -> str:
        """The call as the model writes it (Hermes form)."""
        body = json.dumps({"name": self.name, "arguments": self.arguments}, ensure_ascii=False)
        return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"

    def openai(self) -> dict[str, Any]:
        """The call in an OpenAI chat completion's ``tool_calls`` (arguments as a JSON string)."""
        return {
            "id": f"call_{self.index}",
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


def check_tool_specs(tools: Any) -> list[dict[str, Any]]:
    """`tools` if it is a list of OpenAI-style function specs, else a ValueError naming the
    bad entry.

    A spec is ``{"type": "function", "function": {"name": str, "description"?: str,
    "parameters"?: {"type": "object", ...}}}``; names are unique.
    """
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of function specs, got {type(tools).__name__}")
    names: set[str] = set()
    for i, spec in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(spec, dict) or spec.get("type") != "function":
            raise ValueError(f'{where} must be an object with "type": "function"')
        fn = spec.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f'{where}.function must be an object with a non-empty string "name"')
        if fn["name"] in names:
            raise ValueError(f"{where}: tool {fn['name']!r} is listed twice")
        names.add(fn["name"])
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError(
                f'{where}.function.parameters must be a JSON schema of "type": "object"'
            )
    return tools


def check_arguments(arguments: Mapping[str, Any], parameters: Mapping[str, Any]) -> str | None:
    """None if `arguments` fits the JSON schema `parameters` (required keys, the declared
    types of top-level properties, no extra keys when ``additionalProperties`` is false), else
    what is wrong, in a sentence."""
    props = parameters.get("properties") or {}
    missing = [k for k in parameters.get("required") or [] if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    if parameters.get("additionalProperties") is False:
        extra = sorted(set(arguments) - set(props))
        if extra:
            return f"unknown argument(s) {extra}; it takes {sorted(props)}"
    for key, value in arguments.items():
        kind = props.get(key, {}).get("type") if isinstance(props.get(key), dict) else None
        kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
        allowed = tuple(t for k in kinds for t in _JSON_TYPES.get(k, (object,)))
        bad_bool = isinstance(value, bool) and bool not in allowed and object not in allowed
        if allowed and (not isinstance(value, allowed) or bad_bool):
            return f"argument {key!r} must be of type {kind}, got {type(value).__name__}"
    return None


def _parse_one(
    body: str, index: int, specs: Mapping[str, Mapping[str, Any]] | None
) -> ToolCall | str:
    """One call body -> the call, or the error sentence for it."""
    where = f"Tool error: tool call {index + 1}"
    try:
        obj = json.loads(body.strip())
    except (ValueError, RecursionError) as e:
        return f'{where} is not valid JSON ({e}); write {{"name": ..., "arguments": {{...}}}}'
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return f'{where} must be a JSON object with a string "name" and an object "arguments"'
    name = obj["name"]
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI style: the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError) as e:
            return f"{where} ({name}): its arguments are not valid JSON ({e})"
    if not isinstance(args, dict):
        return f'{where} ({name}): "arguments" must be a JSON object, got {type(args).__name__}'
    if specs is not None:
        if name not in specs:
            return f"{where}: unknown tool {name!r}; the tools are {sorted(specs)}"
        problem = check_arguments(args, specs[name].get("parameters") or {})
        if problem is not None:
            return f"{where} ({name}): {problem}"
    return ToolCall(name=name, arguments=args, index=index)


def parse_tool_calls(
    text: str, tools: Sequence[Mapping[str, Any]] | None = None
) -> tuple[str, list[ToolCall], list[str]]:
    """Split an assistant turn into (content, calls, errors); never raises.

    Args:
        text: the turn's text as the model wrote it (without the end-of-turn marker).
        tools: the OpenAI-style specs the model was given; a call to another name, or with
            arguments that do not fit its ``parameters``, is an error. None: names and
            arguments are not checked.

    Returns:
        content: the text outside the ``<tool_call>`` blocks, stripped.
        calls: the well-formed calls, in order (``ToolCall.index`` counts errors too).
        errors: one ``Tool error: ...`` sentence per malformed call, in order, to be returned
            to the model as that call's result. A last block without ``</tool_call>`` (the
            turn hit its token limit) is parsed if its JSON is complete.
    """
    specs = None
    if tools is not None:
        specs = {
            t["function"]["name"]: t["function"]
            for t in tools
            if isinstance(t, Mapping) and isinstance(t.get("function"), Mapping)
        }
    calls: list[ToolCall] = []
    errors: list[str] = []
    pieces: list[str] = []
    at = 0
    for i, m in enumerate(_CALL.finditer(text)):
        pieces.append(text[at : m.start()])
        at = m.end()
        parsed = _parse_one(m.group(1), i, specs)
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)  # type: ignore[arg-type]
    pieces.append(text[at:])
    content = "".join(pieces).replace(TOOL_CALL_CLOSE, "").strip()
    return content, calls, errors


# ---------------------------------------------------------------------------------------------
# Rendering


def hermes_system_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text listing `tools` and how to call them (Qwen 2.5's wording)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


_PROBE_TOOL = "tidal-probe-7d1f"


def tool_format(template: ChatTemplate) -> ToolFormat:
    """How tool conversations are written with `template` (see the module docstring).

    Raises:
        ValueError: the template has no tool support: it neither reads `tools` nor renders a
            ``system`` and a ``tool`` turn.
    """
    if template.declares_tools:
        return "template"
    probe = [
        {"role": "system", "content": _PROBE_TOOL + "-system"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Calling."},
        {"role": "tool", "content": _PROBE_TOOL + "-result"},
    ]
    try:
        text = template.render(probe, add_generation_prompt=True, where="a tool probe")
    except ValueError as e:
        raise ValueError(
            f"chat template {template.name} has no tool support: it does not read a `tools` "
            f"variable and cannot render a system and a tool turn ({e}); use "
            "--data.chat_template builtin (ChatML, Hermes tool calls) or a template with tools"
        ) from None
    if _PROBE_TOOL + "-system" not in text or _PROBE_TOOL + "-result" not in text:
        raise ValueError(
            f"chat template {template.name} has no tool support: it does not read a `tools` "
            "variable and drops system or tool turns; use --data.chat_template builtin "
            "(ChatML, Hermes tool calls) or a template with tools"
        )
    return "hermes"


def _arguments(raw: Any) -> Any:
    """OpenAI sends arguments as a JSON string; templates want the object."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def prepare_messages(
    messages: Messages, tools: Sequence[Mapping[str, Any]] | None, fmt: ToolFormat
) -> Messages:
    """`messages` (OpenAI style: assistant ``tool_calls``, ``tool`` turns) as the template of
    format `fmt` renders them; `tools` listed in the system turn for ``"hermes"``.

    ``"template"``: assistant ``tool_calls`` get their arguments as objects, the rest is as
    given. ``"hermes"``: the tool block starts the system turn (one is added if absent), calls
    become ``<tool_call>`` text after the content, and tool results are wrapped in
    ``<tool_response>``. Messages are copied, never changed in place.
    """
    out: Messages = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        calls = m.get("tool_calls")
        if fmt == "template":
            if calls:
                m["tool_calls"] = [
                    {
                        **c,
                        "function": {
                            **c["function"],
                            "arguments": _arguments(c["function"].get("arguments")),
                        },
                    }
                    if isinstance(c, dict) and isinstance(c.get("function"), dict)
                    else c
                    for c in calls
                ]
        else:
            if m.get("role") == "assistant" and calls:
                texts = [
                    ToolCall(
                        name=str(c["function"].get("name", "")),
                        arguments=_arguments(c["function"].get("arguments")) or {},
                    ).text()
                    for c in calls
                    if isinstance(c, dict) and isinstance(c.get("function"), dict)
                ]
                m["content"] = "\n".join([m["content"], *texts] if m["content"] else texts)
                del m["tool_calls"]
            elif m.get("role") == "tool":
                m["content"] = f"{TOOL_RESPONSE_OPEN}\n{m['content']}\n{TOOL_RESPONSE_CLOSE}"
        out.append(m)
    if fmt == "hermes" and tools:
        block = hermes_system_block(tools)
        if out and out[0].get("role") == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def render_chat(
    template: ChatTemplate,
    messages: Messages,
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The text of `messages` (OpenAI style) with `tools` available, as `template` writes it.

    Without tools this is `template.render`. Raises ValueError for a template without tool
    support (`tool_format`) or one that cannot render the messages.
    """
    has_tool_turns = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    if not tools and not has_tool_turns:
        return template.render(messages, add_generation_prompt=add_generation_prompt)
    fmt = tool_format(template)
    specs = check_tool_specs(list(tools)) if tools else None
    prepared = prepare_messages(messages, specs, fmt)
    return template.render(
        prepared,
        add_generation_prompt=add_generation_prompt,
        tools=specs if fmt == "template" else None,
    )
