"""`"stream": true`: a completion as OpenAI's server-sent events, its text sent as it decodes.

An `EventStream` turns one request's progress into events: the opening (a chat choice's role),
text deltas while the samples run (`tokens`, fed by the Engine's `on_tokens` at each host
check), then the closing (the rest of each choice's text, its tool calls, log-probs and
token-exact fields, its finish reason, the usage with `stream_options.include_usage`, and
`data: [DONE]`). The text deltas of a choice add up to the text of the same request without
streaming, exactly: only text the finished completion is sure to begin with is sent early
(`TextDeltas`). A chat request with tools is not sent token by token (its tool calls are
parsed from the whole turn, and its content is what the calls leave): all of it comes in the
closing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

_EXTENSION = (
    "prompt_token_ids",
    "token_ids",
    "token_logprobs",
    "sampling_logprobs",
    "policy_versions",
)
"""A choice's token-exact fields (`return_token_ids`): sent with its last text delta."""


class TextDeltas:
    """One sample's text as its tokens arrive: `add` returns the text that can be sent now.

    The text is decoded incrementally, as vLLM and TGI do: each new stretch of tokens is
    decoded together with the stretch before it and only the difference is taken, so a
    decoder that treats the first token of a call apart (SentencePiece's leading space) gives
    the same text as decoding the whole. Held back: a stretch whose last character's bytes
    are not all decoded yet (it ends in U+FFFD), trailing byte tokens (`byte_tokens`:
    SentencePiece's `<0xE2>` fallback, whose runs are decoded as one), and an end that could
    begin one of the `stop` strings (the completion's text ends before a stop string).
    What `add` returned is therefore a prefix of the finished sample's text (`Sample.text`,
    decoded the same way), and `rest(text)` is what remains of it.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stop: tuple[str, ...] = (),
        byte_tokens: frozenset[int] = frozenset(),
    ):
        self.decode = decode
        self.stop = stop
        self.byte_tokens = byte_tokens
        self.ids: list[int] = []
        self.text = ""
        """The decoded text of ids[: self._read]."""
        self.sent = ""
        self._prefix = self._read = 0  # ids[_prefix:_read]: the stretch decoded last
        self._longest_stop = max(map(len, stop), default=0)

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        end = len(self.ids)
        while end > self._read and self.ids[end - 1] in self.byte_tokens:
            end -= 1
        if end > self._read:
            before = self.decode(self.ids[self._prefix : self._read])
            after = self.decode(self.ids[self._prefix : end])
            if len(after) > len(before) and after.startswith(before) and after[-1] != "\ufffd":
                self.text += after[len(before) :]
                self._prefix, self._read = self._read, end
        safe = self._safe()
        if safe <= len(self.sent):
            return ""
        delta = self.text[len(self.sent) : safe]
        self.sent += delta
        return delta

    def rest(self, text: str) -> str:
        """What is left to send of the finished text (past what was sent, or past the part
        of it the finished text agrees with, for a decoder that changed its mind: the
        client then has sent text the finished text lacks, never text twice)."""
        if text.startswith(self.sent):
            return text[len(self.sent) :]
        same = 0
        while same < min(len(text), len(self.sent)) and text[same] == self.sent[same]:
            same += 1
        return text[same:]

    def _safe(self) -> int:
        """How much of `text` can be out: up to the first stop string, and short of an end
        that could begin one. Only text that is not out yet, and the stop strings' length
        before it, is searched (what is out holds no stop string)."""
        text = self.text
        start = max(0, len(self.sent) - self._longest_stop)
        cuts = [k for k in (text.find(s, start) for s in self.stop) if k >= 0]
        if cuts:
            return min(cuts)
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return len(text) - hold


class EventStream:
    """The events of one streamed request.

    Args:
        head: the fields every chunk starts with: `id`, `object` (`chat.completion.chunk` or
            `text_completion`), `created`, `model`.
        n: samples per prompt (a completion choice's index is prompt index * n + sample).
        choices: choices in all.
        decode: token ids to text as the samples' text is decoded; None: no text before the
            closing.
        stop: the request's stop strings.
        byte_tokens: the tokenizer's byte-fallback tokens (see `TextDeltas`).
        include_usage: a last chunk with the usage.
        framing: fields of the opening and closing chunks only (a chat's `prompt_token_ids`
            with `return_token_ids`: once, not with every delta).
    """

    def __init__(
        self,
        head: dict[str, Any],
        *,
        n: int,
        choices: int,
        decode: Callable[[list[int]], str] | None,
        stop: tuple[str, ...] = (),
        byte_tokens: frozenset[int] = frozenset(),
        include_usage: bool = False,
        framing: dict[str, Any] | None = None,
    ):
        self.head = head
        self.framing = framing or {}
        self.byte_tokens = byte_tokens
        self.chat = head["object"] == "chat.completion.chunk"
        self.n = n
        self.choices = choices
        self.decode = decode
        self.stop = stop
        self.include_usage = include_usage
        self._texts: dict[int, TextDeltas] = {}

    @property
    def live(self) -> bool:
        """Whether text is sent as it decodes (else all of it in the closing)."""
        return self.decode is not None

    def opening(self) -> list[bytes]:
        """A chat choice's first chunk gives its role."""
        if not self.chat:
            return []
        return [
            self._event({"index": i, "delta": {"role": "assistant", "content": ""}}, framed=True)
            for i in range(self.choices)
        ]

    def tokens(self, prompt_index: int, sample_index: int, ids: list[int]) -> list[bytes]:
        """The text delta of a running sample's new tokens (none while held back)."""
        if self.decode is None:
            return []
        i = prompt_index * self.n + sample_index
        texts = self._texts.get(i)
        if texts is None:
            texts = self._texts[i] = TextDeltas(self.decode, self.stop, self.byte_tokens)
        delta = texts.add(ids)
        if not delta:
            return []
        if self.chat:
            return [self._event({"index": i, "delta": {"content": delta}, "logprobs": None})]
        return [self._event({"index": i, "text": delta, "logprobs": None})]

    def closing(self, response: dict[str, Any]) -> list[bytes]:
        """The rest of each choice of the finished `response` (a `chat.completion` or
        `text_completion` body), the usage chunk if asked, and `[DONE]`."""
        out = []
        for choice in response["choices"]:
            i = choice["index"]
            extra = {k: v for k, v in choice.items() if k in _EXTENSION}
            texts = self._texts.get(i)
            if self.chat:
                message = choice["message"]
                content = message.get("content") or ""
                delta: dict[str, Any] = {}
                rest = texts.rest(content) if texts else content
                if rest:
                    delta["content"] = rest
                if message.get("tool_calls"):
                    delta["tool_calls"] = [
                        {"index": k, **call} for k, call in enumerate(message["tool_calls"])
                    ]
                last = {"index": i, "delta": delta, "logprobs": choice["logprobs"], **extra}
                done = {"index": i, "delta": {}, "finish_reason": choice["finish_reason"]}
            else:
                text = choice["text"]
                rest = texts.rest(text) if texts else text
                last = {"index": i, "text": rest, "logprobs": choice["logprobs"], **extra}
                done = {"index": i, "text": "", "finish_reason": choice["finish_reason"]}
            out += [self._event(last, framed=True), self._event(done, framed=True)]
        if self.include_usage:
            out.append(_sse({**self.head, "choices": [], "usage": response["usage"]}))
        return [*out, b"data: [DONE]\n\n"]

    def error(self, body: dict[str, Any]) -> list[bytes]:
        """An error after the stream began (an OpenAI error body), as the last event."""
        return [_sse(body), b"data: [DONE]\n\n"]

    def _event(self, choice: dict[str, Any], framed: bool = False) -> bytes:
        choice.setdefault("finish_reason", None)
        head = {**self.head, **self.framing} if framed else self.head
        return _sse({**head, "choices": [choice]})


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
