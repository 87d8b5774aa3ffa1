"""Request checking for the OpenAI-compatible API: which fields are read, which are accepted
and ignored, which are refused, and the OpenAI error body.

Every check raises `ApiError` (status 400 unless said) naming the field, which the app turns
into `{"error": {"message", "type", "param", "code"}}` as OpenAI answers.
"""

from __future__ import annotations

import math
from typing import Any

from tidal.rl.envs.tool_calls import check_tool_specs

MAX_STOP_STRINGS = 4
"""Stop strings per request, as OpenAI allows."""

IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "prompt_cache_key",
        "safety_identifier",
        "stream_options",
        # vLLM's: prefix-cache isolation and scheduling priority, no change to the output
        "cache_salt",
        "priority",
    }
)
"""Fields of the OpenAI API (and vLLM's) that change nothing here: accepted, so existing
clients work (`stream_options` is read with `stream`)."""

COMMON = frozenset(
    {
        "model",
        "n",
        "temperature",
        "top_p",
        "max_tokens",
        "stop",
        "seed",
        "logprobs",
        "stream",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        "top_k",
        "min_p",
        "return_token_ids",
    }
)
CHAT_FIELDS = COMMON | {
    "messages",
    "tools",
    "tool_choice",
    "top_logprobs",
    "max_completion_tokens",
    "response_format",
}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of", "suffix"}


class ApiError(Exception):
    """An OpenAI-style error: `status`, a message, the field at fault (`param`)."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.type, self.code = type, code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def check_fields(body: Any, known: frozenset[str]) -> dict[str, Any]:
    """`body` as a dict whose every field is known; refuses what would change the output."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    for key in body:
        if key in IGNORED:
            continue
        if key not in known:
            raise ApiError(f"unrecognized request argument supplied: {key}", param=key)
    _refuse(body, "logit_bias", bool(body.get("logit_bias")), "logit_bias is not supported")
    for key in ("presence_penalty", "frequency_penalty"):
        _refuse(body, key, body.get(key) not in (None, 0, 0.0), f"{key} is not supported")
    _refuse(body, "echo", bool(body.get("echo")), "echo is not supported")
    _refuse(body, "suffix", body.get("suffix") not in (None, ""), "suffix is not supported")
    _refuse(body, "best_of", body.get("best_of") not in (None, 1), "best_of is not supported")
    _refuse(
        body,
        "top_logprobs",
        body.get("top_logprobs") not in (None, 0),
        "top_logprobs is not supported: logprobs=true returns each sampled token's log-prob",
    )
    fmt = body.get("response_format")
    _refuse(
        body,
        "response_format",
        fmt is not None and fmt != {"type": "text"},
        'response_format other than {"type": "text"} is not supported',
    )
    choice = body.get("tool_choice")
    _refuse(
        body,
        "tool_choice",
        choice not in (None, "auto", "none"),
        'tool_choice must be "auto" or "none" (forcing a call is not supported)',
    )
    return body


def _refuse(body: dict[str, Any], key: str, bad: bool, message: str) -> None:
    if key in body and bad:
        raise ApiError(f"{key}: {message}", param=key)


def number(
    body: dict[str, Any], key: str, default: float, lo: float, hi: float, *, lo_open: bool = False
) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(f"{key} must be a number, got {value!r}", param=key)
    if value < lo or (lo_open and value == lo) or value > hi:
        low = f"({lo}" if lo_open else f"[{lo}"
        raise ApiError(f"{key} must be in {low}, {hi}], got {value!r}", param=key)
    return float(value)


def integer(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"{key} must be an integer, got {value!r}", param=key)
    if not lo <= value <= hi:
        raise ApiError(f"{key} must be in [{lo}, {hi}], got {value}", param=key)
    return value


def flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(f"{key} must be true or false, got {value!r}", param=key)
    return value


def stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise ApiError("stop must be a non-empty string or a list of them", param="stop")
    if len(items) > MAX_STOP_STRINGS:
        raise ApiError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(items)}", param="stop")
    return tuple(items)


def text_content(content: Any, where: str) -> str | None:
    """A message's content as a string: a string, null, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(
                    f"{where}.content[{k}]: only text parts are supported, got {kind!r}",
                    param="messages",
                )
            if not isinstance(part.get("text"), str):
                raise ApiError(f"{where}.content[{k}] needs a string 'text'", param="messages")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(
        f"{where}.content must be a string, null or a list of text parts, got "
        f"{type(content).__name__}",
        param="messages",
    )


ROLES = ("system", "developer", "user", "assistant", "tool")


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The checked chat messages: role, content (string or None), tool_calls, tool_call_id."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError("messages must be a non-empty list of messages", param="messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{where} must be an object", param="messages")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(f"{where}.role must be one of {ROLES}, got {role!r}", param="messages")
        content = text_content(m.get("content"), where)
        msg: dict[str, Any] = {"role": role, "content": content}
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise ApiError(
                    f"{where}.tool_calls must be a list, on an assistant message", param="messages"
                )
            msg["tool_calls"] = [
                _tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)
            ]
        elif content is None and role != "assistant":
            raise ApiError(f"{where} ({role}) needs a content", param="messages")
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
        out.append(msg)
    return out


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(f"{where} needs function.name", param="messages")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        raise ApiError(f"{where}.function.arguments must be a JSON string", param="messages")
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }


def tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The checked tool declarations (`{"type": "function", "function": {"name", ...}}`, as
    tidal/rl/envs/tool_calls.py checks them), or None when there are none or tool_choice is
    "none"."""
    raw = body.get("tools")
    if raw is None:
        return None
    try:
        out = check_tool_specs(raw)
    except ValueError as e:
        raise ApiError(str(e), param="tools") from None
    if body.get("tool_choice") == "none" or not out:
        return None
    return out
