"""The server through the official `openai` client against a real uvicorn server on a
loopback port: chat with tools, n > 1, stop strings, log-probs, the token-id extension, the
API key, and concurrent clients batched together by the engine."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serve.conftest import MODEL, uvicorn_server
from tests.serve.test_api import CALC, USER
from tidal.serve.app import create_app

openai = pytest.importorskip("openai")


@pytest.fixture
def server(served):
    with uvicorn_server(create_app(served, api_key="k")) as url:
        yield url, served


def client(url: str, key: str = "k"):
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


def test_chat_with_tools_n_stop_and_logprobs(server):
    url, _ = server
    c = client(url)
    assert [m.id for m in c.models.list()] == [MODEL]
    r = c.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=[CALC],
        n=3,
        temperature=0.9,
        top_p=0.95,
        max_tokens=12,
        seed=5,
        logprobs=True,
        user="u1",
        extra_body={"return_token_ids": True},
    )
    assert r.object == "chat.completion" and len(r.choices) == 3
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    for ch in r.choices:
        assert ch.message.role == "assistant"
        assert ch.finish_reason in ("stop", "length", "tool_calls")
        ids = ch.model_extra["token_ids"]
        assert len(ch.logprobs.content) == len(ids) == len(ch.model_extra["token_logprobs"])
        assert [t.logprob for t in ch.logprobs.content] == ch.model_extra["token_logprobs"]
    assert r.usage.completion_tokens == sum(len(ch.model_extra["token_ids"]) for ch in r.choices)
    # The same request again: the same seed gives the same samples.
    again = c.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=[CALC],
        n=3,
        temperature=0.9,
        top_p=0.95,
        max_tokens=12,
        seed=5,
    )
    assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in r.choices]


def test_stop_strings(server, chat_tokenizer):
    url, _ = server
    c = client(url)
    base = dict(model=MODEL, prompt="1 + 2 = ", max_tokens=24, seed=2, temperature=1.0)
    free = c.completions.create(**base, extra_body={"return_token_ids": True})
    text = free.choices[0].text
    assert sum(ch.isascii() for ch in text) >= 4, text
    # A string the free-running sample writes (plain characters: ones the tokenizer produces).
    at = next(i for i in range(1, len(text) - 1) if text[i : i + 2].isascii())
    stop = text[at : at + 2]
    r = c.completions.create(**base, stop=[stop, "never-written"], logprobs=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[: text.index(stop)]
    assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.tokens)


def test_bad_requests_and_the_key(server):
    url, _ = server
    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong").models.list()
    c = client(url)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="gpt-4o", messages=USER)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=USER, logit_bias={"5": 10})
    assert e.value.body["param"] == "logit_bias" and "logit_bias" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=USER, max_tokens=100_000)
    assert e.value.body["code"] == "context_length_exceeded"


def test_concurrent_clients_share_batches(server):
    url, served = server
    c = client(url)

    def one(i: int) -> int:
        r = c.completions.create(model=MODEL, prompt=f"{i} + {i} =", max_tokens=48, seed=i)
        return r.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        tokens = list(pool.map(one, range(8)))
    assert all(t >= 1 for t in tokens)
    stats = served.engine.stats
    assert stats.requests == 8 and stats.restarts == 0
    assert stats.max_in_flight >= 2  # several clients' requests decoded together
    assert stats.batches_fed < 8  # and some of them fed to the Generator as one batch


def test_tool_calls_reach_the_client_parsed(served):
    """A model that writes a call (scripted: an untrained model does not): the openai client
    reads it as `tool_calls`, and the next turn sends the call and its result back."""
    from tests.serve.test_api import ScriptedEngine

    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12 + 30"}}\n</tool_call>'
    served.engine = ScriptedEngine(served.engine.generator, call)
    with uvicorn_server(create_app(served)) as url:
        c = client(url, key="none")
        r = c.chat.completions.create(model=MODEL, messages=USER, tools=[CALC])
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (tc,) = choice.message.tool_calls
        assert tc.function.name == "calc"
        assert json.loads(tc.function.arguments) == {"expression": "12 + 30"}
        history = [*USER, choice.message.model_dump(exclude_none=True)]
        history.append({"role": "tool", "tool_call_id": tc.id, "content": "42"})
        again = c.chat.completions.create(
            model=MODEL, messages=history, tools=[CALC], extra_body={"return_token_ids": True}
        )
        assert again.choices[0].finish_reason == "tool_calls"
        prompt = served.engine.generator.tokenizer.decode(
            served.engine.prompt, skip_special_tokens=False
        )
        assert '"name": "calc"' in prompt and "<tool_response>\n42\n</tool_response>" in prompt


def test_streaming_gives_the_same_completion_as_events(server):
    """`stream=True` (what agent programs such as verifiers' chat harness send): the same
    completion as without streaming, as OpenAI's chunks, its usage with include_usage, and
    the record hook sees it whole."""
    url, _ = server
    c = client(url)
    args = dict(model=MODEL, messages=USER, n=2, max_tokens=10, seed=3)
    whole = c.chat.completions.create(**args, extra_body={"return_token_ids": True})
    chunks = list(
        c.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    texts, finish = ["", ""], [None, None]
    for ch in chunks[:-1]:
        (choice,) = ch.choices
        texts[choice.index] += choice.delta.content or ""
        finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [ch.message.content for ch in whole.choices]
    assert finish == [ch.finish_reason for ch in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    # plain completions stream too
    text = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=MODEL, prompt="1+1=", max_tokens=5, seed=1, stream=True
        )
    )
    assert (
        text
        == c.completions.create(model=MODEL, prompt="1+1=", max_tokens=5, seed=1).choices[0].text
    )


def test_record_sees_each_completion_with_its_headers(served):
    seen = []
    app = create_app(served, record=lambda headers, body: seen.append((headers, body)))
    with uvicorn_server(app) as url:
        c = client(url)
        c.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=4,
            stream=True,
            extra_headers={"X-Session-ID": "abc"},
            extra_body={"return_token_ids": True},
        )
    ((headers, body),) = seen
    assert headers["x-session-id"] == "abc"
    assert body["object"] == "chat.completion" and body["choices"][0]["token_ids"]


def test_a_session_continues_from_its_exact_ids(served):
    """With `sessions`, a chat that sends back the reply and a new message is continued from
    the ids sampled (a model's tokens need not re-encode to themselves); a conversation that
    does not extend the session's is rendered whole."""
    served.sessions = 4
    with uvicorn_server(create_app(served)) as url:
        c = client(url)
        kw = dict(model=MODEL, max_tokens=6, seed=2, extra_body={"return_token_ids": True})
        head = {"X-Session-ID": "s1"}
        first = c.chat.completions.create(messages=USER, extra_headers=head, **kw)
        sent = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
        reply = {"role": "assistant", "content": first.choices[0].message.content}
        more = [*USER, reply, {"role": "user", "content": "And 3 + 4?"}]
        second = c.chat.completions.create(messages=more, extra_headers=head, **kw)
        ids = second.model_extra["prompt_token_ids"]
        assert ids[: len(sent)] == sent and len(ids) > len(sent)
        # the same conversation without the session: rendered from its messages
        fresh = c.chat.completions.create(messages=more, **kw).model_extra["prompt_token_ids"]
        assert fresh == served.chat.prompt_ids(more, None)
        # another history under the session's id: rendered whole too
        other = [{"role": "user", "content": "Hi"}, reply, {"role": "user", "content": "x"}]
        got = c.chat.completions.create(messages=other, extra_headers=head, **kw)
        assert got.model_extra["prompt_token_ids"] == served.chat.prompt_ids(other, None)
