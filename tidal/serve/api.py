"""The OpenAI endpoints without the web stack: a request body to the Engine's prompts and
SamplingParams (`Served.chat` / `Served.completion`), and its samples to the response body.

Responses follow OpenAI's `chat.completion` and `text_completion` objects. With
`"return_token_ids": true` (the name vLLM uses) every choice also carries, so a trajectory
driven from outside can be trained on token-exactly:

- `prompt_token_ids`: the prompt as the model read it (also at the top of a chat response);
- `token_ids`: the completion's tokens (ending with the stop token when one was hit);
- `token_logprobs`: each token's log-prob under the model (temperature 1, untruncated: the
  trainer's; bitwise so in batch-invariant mode) and `sampling_logprobs`: under the
  distribution sampled (temperature, top-p);
- `policy_versions`: each token's policy version (-1: unversioned weights).

`"stream": true` is answered as OpenAI's server-sent events, the text sent as it decodes
(`Prepared.events`, tidal/serve/streaming.py); the deltas add up to the text without
streaming.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidal.generate import Sample, SamplingParams
from tidal.serve import schema
from tidal.serve.chat import ChatFormat, split_tool_calls
from tidal.serve.engine import Engine
from tidal.serve.schema import ApiError
from tidal.serve.streaming import EventStream

DEFAULT_COMPLETION_TOKENS = 16
"""`max_tokens` of /v1/completions when the request gives none (OpenAI's default); chat
completions default to the rest of the context."""


@dataclass(slots=True)
class Prepared:
    """A checked request: what to submit, and how to turn the samples into the response."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    respond: Callable[[list[list[Sample]]], dict[str, Any]]
    events: EventStream | None = None
    """How to answer as server-sent events (`"stream": true`); None: one JSON body."""


@dataclass
class Served:
    """One served model: its name, engine and how its prompts are encoded.

    Args:
        name: the model id clients pass (`model`) and /v1/models lists.
        engine: the Engine owning the model's Generator.
        encode: text to prompt ids for /v1/completions (as `tidal generate` encodes a plain
            prompt: BOS + text, or the Hugging Face tokenizer's own template).
        chat: the chat format for /v1/chat/completions (None: the endpoint answers 400).
        stop_ids: token ids that end a plain completion (None: the tokenizer's EOS).
    """

    name: str
    engine: Engine
    encode: Callable[[str], list[int]]
    chat: ChatFormat | None = None
    stop_ids: tuple[int, ...] | None = None
    sessions: int = 0
    """Chat sessions remembered (0: none). With it, a chat request whose session id (the
    `X-Session-ID` header) names a remembered session, and whose messages are that session's
    last ones followed by its reply and new messages, is continued from the session's exact
    ids: the last prompt's and sampled ids, then only the new messages' ids (as RL
    environments append observations). Otherwise the conversation is rendered whole."""

    def __post_init__(self) -> None:
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._bytes: frozenset[int] | None = None

    @property
    def capacity(self) -> int:
        return self.engine.generator.capacity

    def models(self) -> dict[str, Any]:
        entry = {
            "id": self.name,
            "object": "model",
            "created": 0,
            "owned_by": "tidal",
            "max_model_len": self.capacity,
        }
        return {"object": "list", "data": [entry]}

    # -- /v1/chat/completions ---------------------------------------------------------------

    def chat_completion(self, body: Any, session: str | None = None) -> Prepared:
        body = schema.check_fields(body, schema.CHAT_FIELDS)
        self._check_model(body)
        msgs = schema.messages(body)
        tools = schema.tools(body)
        if self.chat is None:
            raise ApiError("this model has no chat template: use /v1/completions")
        try:
            prompt = self._continued(session, msgs, tools) or self.chat.prompt_ids(msgs, tools)
        except ValueError as e:
            raise ApiError(str(e), param="messages") from None
        if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        want_logprobs = schema.flag(body, "logprobs")
        params = self._params(body, [prompt], self.chat.stop_ids, None)
        token_ids = schema.flag(body, "return_token_ids")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def respond(groups: list[list[Sample]]) -> dict[str, Any]:
            choices = []
            for s in groups[0]:
                content, calls = split_tool_calls(s.text or "", tools)
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = calls
                choice: dict[str, Any] = {
                    "index": s.sample_index,
                    "message": message,
                    "logprobs": {"content": self._chat_logprobs(s)} if want_logprobs else None,
                    "finish_reason": "tool_calls" if calls else s.finish_reason,
                }
                if token_ids:
                    choice.update(_extension(s))
                choices.append(choice)
            out = {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": self.name,
                "choices": choices,
                "usage": _usage(groups),
            }
            if token_ids:
                out["prompt_token_ids"] = prompt
            if session is not None and self.sessions and len(groups[0]) == 1:
                self._remember(session, msgs, tools, prompt, groups[0][0], choices[0])
            return out

        events = self._events(
            body,
            {"id": rid, "object": "chat.completion.chunk", "created": created},
            params,
            choices=params[0].n,
            live=not tools,  # with tools the content is what the calls leave: known at the end
            framing={"prompt_token_ids": prompt} if token_ids else None,
        )
        return Prepared([prompt], params, respond, events)

    def _continued(
        self, session: str | None, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int] | None:
        """The prompt ids continuing a remembered session (see `sessions`), or None."""
        if session is None or not self.sessions:
            return None
        with _SESSIONS_LOCK:
            held = self._sessions.get(session)
        if held is None or held.tools != tools or len(msgs) <= len(held.messages):
            return None
        if [_same(m) for m in msgs[: len(held.messages)]] != [_same(m) for m in held.messages]:
            return None
        from tidal.rl.envs.trajectory import TurnCodec

        assert self.chat is not None
        codec = TurnCodec(self.chat.encoder, tools)
        new = _turns(msgs[len(held.messages) :])
        return held.ids + codec.observation(_turns(held.messages), new, held.ids[-1])

    def _remember(
        self,
        session: str,
        msgs: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        prompt: list[int],
        sample: Sample,
        choice: dict[str, Any],
    ) -> None:
        reply = {"role": "assistant", **choice["message"]}
        held = _Session([*msgs, reply], tools, [*prompt, *sample.completion_ids])
        with _SESSIONS_LOCK:
            self._sessions[session] = held
            self._sessions.move_to_end(session)
            while len(self._sessions) > self.sessions:
                self._sessions.popitem(last=False)

    # -- /v1/completions ----------------------------------------------------------------------

    def completion(self, body: Any) -> Prepared:
        body = schema.check_fields(body, schema.COMPLETION_FIELDS)
        self._check_model(body)
        prompts = self._prompts(body.get("prompt"))
        logprobs = schema.integer(body, "logprobs", None, 0, 20)
        if logprobs:
            raise ApiError(
                "logprobs: top alternatives are not supported; logprobs=0 returns each sampled "
                "token's log-prob",
                param="logprobs",
            )
        params = self._params(body, prompts, self.stop_ids, DEFAULT_COMPLETION_TOKENS)
        token_ids = schema.flag(body, "return_token_ids")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def respond(groups: list[list[Sample]]) -> dict[str, Any]:
            choices = []
            for group in groups:
                for s in group:
                    choice: dict[str, Any] = {
                        "index": s.prompt_index * len(group) + s.sample_index,
                        "text": s.text or "",
                        "logprobs": self._completion_logprobs(s) if logprobs == 0 else None,
                        "finish_reason": s.finish_reason,
                    }
                    if token_ids:
                        choice.update(_extension(s))
                    choices.append(choice)
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.name,
                "choices": choices,
                "usage": _usage(groups),
            }

        events = self._events(
            body,
            {"id": rid, "object": "text_completion", "created": created},
            params,
            choices=len(prompts) * params[0].n,
            live=True,
        )
        return Prepared(prompts, params, respond, events)

    # -- shared ---------------------------------------------------------------------------

    def _events(
        self,
        body: dict[str, Any],
        head: dict[str, Any],
        params: list[SamplingParams],
        *,
        choices: int,
        live: bool,
        framing: dict[str, Any] | None = None,
    ) -> EventStream | None:
        """The request's EventStream if it streams (`live`: its text as it decodes; `head`
        without the model, `framing`: see EventStream)."""
        stream = schema.flag(body, "stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise ApiError("stream_options must be an object", param="stream_options")
        if not stream:
            return None
        tokenizer = self.engine.generator.tokenizer
        live = live and tokenizer is not None
        return EventStream(
            {**head, "model": self.name},
            n=params[0].n,
            choices=choices,
            decode=tokenizer.decode if live else None,
            stop=params[0].stop,
            byte_tokens=self._byte_tokens() if live else frozenset(),
            include_usage=bool(options and options.get("include_usage")),
            framing=framing,
        )

    def _byte_tokens(self) -> frozenset[int]:
        """The tokenizer's byte-fallback tokens (`<0xE2>`), found once."""
        if self._bytes is None:
            self._bytes = self.engine.generator.tokenizer.byte_fallback_ids()
        return self._bytes

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model != self.name:
            raise ApiError(
                f"the model {model!r} does not exist; this server serves {self.name!r}",
                param="model",
                code="model_not_found",
            )

    def _prompts(self, prompt: Any) -> list[list[int]]:
        """/v1/completions' `prompt`: a string, a list of strings, a list of token ids or a
        list of such lists."""
        bad = ApiError(
            "prompt must be a string, a list of strings, a list of token ids or a list of lists "
            "of token ids",
            param="prompt",
        )
        if isinstance(prompt, str):
            return [self.encode(prompt)]
        if not isinstance(prompt, list) or not prompt:
            raise bad
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append(self.encode(p))
            elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                out.append(list(p))
            else:
                raise bad
        return out

    def _params(
        self,
        body: dict[str, Any],
        prompts: list[list[int]],
        stop_ids: tuple[int, ...] | None,
        default_tokens: int | None,
    ) -> list[SamplingParams]:
        cap = self.capacity
        longest = max(len(p) for p in prompts)
        if longest >= cap:
            raise ApiError(
                f"the prompt has {longest} tokens; this model's context is {cap} tokens "
                "(prompt and completion)",
                param="messages" if "messages" in body else "prompt",
                code="context_length_exceeded",
            )
        max_tokens = schema.integer(body, "max_tokens", default_tokens, 1, 1 << 30)
        if max_tokens is None:
            max_tokens = cap - longest
        if longest + max_tokens > cap:
            raise ApiError(
                f"max_tokens={max_tokens} with a prompt of {longest} tokens exceeds this "
                f"model's context of {cap} tokens: at most {cap - longest} fit",
                param="max_tokens",
                code="context_length_exceeded",
            )
        n = schema.integer(body, "n", 1, 1, 1 << 16)
        assert n is not None
        seed = schema.integer(body, "seed", None, -(1 << 63), (1 << 64) - 1)
        base = random.getrandbits(62) if seed is None else seed % (1 << 63)
        temperature = schema.number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = schema.number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
        min_p = schema.number(body, "min_p", 0.0, 0.0, 1.0)
        top_k = schema.integer(body, "top_k", 0, -1, 1 << 30)
        stop = schema.stop_strings(body)
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                top_k=max(0, top_k or 0),
                min_p=min_p,
                max_new_tokens=max_tokens,
                stop=stop,
                stop_token_ids=stop_ids,
                seed=(base + i) % (1 << 63),
            )
            for i in range(len(prompts))
        ]
        try:
            self.engine.check(prompts, params)
        except ValueError as e:
            message = str(e)
            param = "n" if " n=" in message else "stop" if "stop string" in message else None
            if "outside the vocabulary" in message:
                param = "prompt"
            raise ApiError(message, param=param) from None
        return params

    def _token_text(self, token: int) -> str:
        """A token's text in log-probs ("token_id:N" without a tokenizer, as vLLM writes)."""
        tokenizer = self.engine.generator.tokenizer
        if tokenizer is None:
            return f"token_id:{token}"
        return tokenizer.decode([token], skip_special_tokens=False)

    def _chat_logprobs(self, s: Sample) -> list[dict[str, Any]]:
        out = []
        for t, lp in zip(s.completion_ids, s.logprobs, strict=True):
            text = self._token_text(t)
            out.append(
                {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            )
        return out

    def _completion_logprobs(self, s: Sample) -> dict[str, Any]:
        tokens = [self._token_text(t) for t in s.completion_ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": list(s.logprobs),
            "top_logprobs": None,
            "text_offset": offsets,
        }


_SESSIONS_LOCK = threading.Lock()


@dataclass(slots=True)
class _Session:
    """A chat session's last exchange: its messages and reply, and the exact ids."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    ids: list[int]
    """The prompt's ids and the sampled ids."""


def _turns(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them (`ChatFormat.prompt_ids`' mapping)."""
    return [
        {
            **m,
            "role": "system" if m["role"] == "developer" else m["role"],
            "content": m.get("content") or "",
        }
        for m in msgs
    ]


def _same(m: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a message for continuing a session: role, text (None as empty) and
    tool calls' names and arguments (their ids are the client's)."""
    calls = tuple(
        (c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []
    )
    return (m["role"], m.get("content") or "", calls)


def _extension(s: Sample) -> dict[str, Any]:
    versions = s.versions
    if versions is None:
        v = -1 if s.weight_version is None else s.weight_version
        versions = [v] * len(s.completion_ids)
    return {
        "prompt_token_ids": list(s.prompt_ids),
        "token_ids": list(s.completion_ids),
        "token_logprobs": list(s.logprobs),
        "sampling_logprobs": list(s.sampling_logprobs),
        "policy_versions": versions,
    }


def _usage(groups: list[list[Sample]]) -> dict[str, int]:
    prompt = sum(len(g[0].prompt_ids) for g in groups)
    completion = sum(len(s.completion_ids) for g in groups for s in g)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
