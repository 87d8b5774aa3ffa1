"""Chat prompts and tool calls for the server: OpenAI messages and tools to prompt token ids,
and a completion's text back to content and tool calls.

Tools are written in the Hermes/Qwen form that Qwen 2.5/3 templates use:

- the tool schemas go into the system message, one JSON object per line inside
  `<tools></tools>`, with the instruction to answer `<tool_call>{"name": ..., "arguments":
  ...}</tool_call>`;
- an earlier assistant turn's `tool_calls` are written back into its content in that form;
- `tool` messages become a user turn of `<tool_response>...</tool_response>` blocks (several
  consecutive results in one turn).

The rewritten conversation holds only `role` / `content` strings, so any chat template renders
it (tidal's built-in ChatML included). `render_tools` and `parse_tool_calls` are the two
functions to swap for another tool format.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tidal.train.data.chat import ChatEncoder

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def render_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, str]]:
    """`messages` (checked OpenAI chat messages, content already a string or None) rewritten
    as plain role/content turns with the tools, tool calls and tool results in Hermes form."""
    out: list[dict[str, str]] = []
    if tools:
        schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        block = _TOOLS_HEADER + schemas + _TOOLS_FOOTER
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": f"{messages[0]['content'] or ''}\n\n{block}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            text = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "_tool": "1"})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = [
                json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False,
                )
                for c in m["tool_calls"]
            ]
            parts = [content] if content else []
            content = "\n".join([*parts, *(f"<tool_call>\n{c}\n</tool_call>" for c in calls)])
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a completion: each well-formed `<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>` block becomes a call `{"name", "arguments"}` (arguments a
    JSON string, as OpenAI returns them) and is cut from the content; a malformed block stays
    in the content as text. Content is None when only calls remain."""
    calls: list[dict[str, Any]] = []

    def take(match: re.Match[str]) -> str:
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return match.group(0)
        args = call.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return match.group(0)
        if not isinstance(args, dict):
            return match.group(0)
        calls.append({"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)})
        return ""

    rest = _CALL.sub(take, text).strip()
    if not calls:
        return text, []
    return (rest or None), calls


class ChatFormat:
    """Chat messages to prompt token ids with one tokenizer and template, as SFT encodes a
    prompt (`ChatEncoder.prompt_ids`: BOS first), and the tokens that end an assistant turn.

    Args:
        encoder: the ChatEncoder of the served tokenizer and template
            (tidal.train.data.chat.build_encoder).
        extra_stop_ids: more ids that end a turn (a Hugging Face config's `eos_token_id`).
    """

    def __init__(self, encoder: ChatEncoder, extra_stop_ids: tuple[int, ...] = ()):
        self.encoder = encoder
        self.stop_ids = tuple(sorted(set(encoder.stop_ids) | set(extra_stop_ids)))

    def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """Token ids of the conversation followed by the assistant header.

        Raises:
            ValueError: the template cannot render the conversation.
        """
        turns = render_tools(messages, tools)
        tok = self.encoder.tokenizer
        text = self.encoder.template.render(
            turns, add_generation_prompt=True, where="the request's messages"
        )
        ids = tok.encode(text, special_tokens=True)
        return ids if ids and ids[0] == tok.bos_id else [tok.bos_id, *ids]
