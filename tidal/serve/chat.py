"""Chat prompts and tool calls for the server: OpenAI messages and tools to prompt token ids,
and a completion's text back to content and tool calls.

The tool format is the one RL environments use (tidal/rl/envs/tool_calls.py): the template's
own when it reads a `tools` variable, else the Hermes/Qwen form (`<tools>` in the system turn,
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` in the assistant's text,
`<tool_response>` around results), so a model trained through the environments calls tools
the same way through the server.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from tidal.rl.envs.tool_calls import parse_tool_calls, render_chat
from tidal.train.data.chat import ChatEncoder


def split_tool_calls(
    text: str, tools: list[dict[str, Any]] | None
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI `tool_calls`) of a completion. Well-formed calls to declared tools
    become `tool_calls` and leave the content (None when nothing else is left); when the text
    holds no well-formed call, it all stays the content, malformed blocks included."""
    if not tools:
        return text, []
    content, calls, _errors = parse_tool_calls(text, tools)
    if not calls:
        return text, []
    out = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in calls
    ]
    return (content or None), out


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
            ValueError: the template cannot render the conversation, or has no tool support
                for a conversation with tools.
        """
        turns = [
            {
                **m,
                "role": "system" if m["role"] == "developer" else m["role"],
                "content": m.get("content") or "",
            }
            for m in messages
        ]
        tok = self.encoder.tokenizer
        text = render_chat(self.encoder.template, turns, tools)
        ids = tok.encode(text, special_tokens=True)
        return ids if ids and ids[0] == tok.bos_id else [tok.bos_id, *ids]
