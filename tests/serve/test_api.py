"""The server's endpoints through FastAPI's TestClient: the token-id extension, tool calls in
responses, every kind of bad request (400, OpenAI error body) and the API key (401)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
from fastapi.testclient import TestClient

from tests.serve.conftest import CONTEXT, MODEL, make_served
from tidal.generate import Sample, logprobs
from tidal.serve.app import create_app

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate arithmetic.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
USER = [{"role": "user", "content": "What is 12 + 30?"}]


@pytest.fixture
def client(served):
    with TestClient(create_app(served)) as c:
        yield c


def test_completion_token_ids_and_logprobs_match_the_trainer(client, served, tiny_model):
    r = client.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": ["1 + 2 =", [0, 40, 41]],
            "max_tokens": 6,
            "n": 2,
            "seed": 3,
            "logprobs": 0,
            "return_token_ids": True,
            "user": "someone",  # accepted, changes nothing
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[2]["prompt_token_ids"] == [0, 40, 41]
    completion_tokens = 0
    for c in choices:
        ids, lps = c["token_ids"], c["token_logprobs"]
        assert 1 <= len(ids) <= 6 and len(lps) == len(ids) == len(c["policy_versions"])
        assert c["policy_versions"] == [-1] * len(ids)  # unversioned weights
        assert c["logprobs"]["token_logprobs"] == lps
        assert len(c["logprobs"]["tokens"]) == len(ids)
        completion_tokens += len(ids)
        # The reported log-probs are the trainer's scoring of the same tokens.
        prompt = c["prompt_token_ids"]
        ref = logprobs(tiny_model, torch.tensor([prompt + ids]))[0, len(prompt) - 1 :]
        torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-4, rtol=1e-4)
    usage = body["usage"]
    assert usage["completion_tokens"] == completion_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + completion_tokens


def test_batch_invariant_logprobs_are_bitwise_the_trainers(tiny_model, chat_tokenizer):
    served = make_served(tiny_model, chat_tokenizer, batch_invariant=True)
    with TestClient(create_app(served)) as client:
        req = {"model": MODEL, "messages": USER, "max_tokens": 5, "n": 3, "seed": 1}
        r = client.post("/v1/chat/completions", json=req | {"return_token_ids": True})
    for c in r.json()["choices"]:
        prompt, ids = c["prompt_token_ids"], c["token_ids"]
        ref = logprobs(tiny_model, torch.tensor([prompt + ids]), batch_invariant=True)
        assert c["token_logprobs"] == ref[0, len(prompt) - 1 :].tolist()


def test_same_seed_same_tokens(client):
    req = {"model": MODEL, "messages": USER, "max_tokens": 8, "seed": 11, "return_token_ids": True}
    a, b = (client.post("/v1/chat/completions", json=req).json() for _ in range(2))
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert a["prompt_token_ids"] == a["choices"][0]["prompt_token_ids"]


def test_chat_prompt_renders_tools_calls_and_results(client, chat_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calc", "arguments": '{"expression": "12 + 30"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": messages,
            "tools": [CALC],
            "max_tokens": 4,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    prompt = chat_tokenizer.decode(r.json()["prompt_token_ids"], skip_special_tokens=False)
    assert prompt.index("Be brief.") < prompt.index("<tools>") < prompt.index("What is 12 + 30?")
    assert '"name": "calc"' in prompt and "<tool_response>\n42\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


class ScriptedEngine:
    """An engine whose model writes `text`: the response side of tool calls, without training
    a model to call tools."""

    def __init__(self, generator, text: str):
        self.generator, self.text = generator, text

    def check(self, prompts, params):
        pass

    def submit(self, prompts, params, on_tokens=None):
        self.prompt = prompts[0]
        ids = self.generator.tokenizer.encode(self.text)
        sample = Sample(
            0, 0, prompts[0], ids, self.text, "stop", [0.0] * len(ids), [0.0] * len(ids), 7
        )
        future: Future = Future()
        future.set_result([[sample]])
        return future

    def start(self):
        pass

    def stop(self):
        pass


def test_chat_returns_tool_calls(served):
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12 + 30"}}\n</tool_call>'
    served.engine = ScriptedEngine(served.engine.generator, "Let me compute.\n" + call)
    with TestClient(create_app(served)) as client:
        req = {"model": MODEL, "messages": USER, "tools": [CALC], "return_token_ids": True}
        choice = client.post("/v1/chat/completions", json=req).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Let me compute."
        (tc,) = choice["message"]["tool_calls"]
        assert tc["type"] == "function" and tc["id"].startswith("call_")
        assert tc["function"] == {"name": "calc", "arguments": '{"expression": "12 + 30"}'}
        assert choice["policy_versions"] == [7] * len(choice["token_ids"])
        # Without tools, or a call to an undeclared tool: the text is the content.
        del req["tools"]
        choice = client.post("/v1/chat/completions", json=req).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert choice["message"]["content"].endswith("</tool_call>")
        other = {"type": "function", "function": {"name": "search"}}
        req["tools"] = [other]
        choice = client.post("/v1/chat/completions", json=req).json()["choices"][0]
        assert "tool_calls" not in choice["message"]


BAD = [
    ({"model": "gpt-4", "messages": USER}, "model", "does not exist"),
    ({"messages": USER}, "model", "does not exist"),
    ({"model": MODEL, "messages": USER, "max_tokens": CONTEXT}, "max_tokens", "context"),
    ({"model": MODEL, "messages": USER, "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"model": MODEL, "messages": []}, "messages", "non-empty"),
    ({"model": MODEL, "messages": "hi"}, "messages", "non-empty"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages", "role"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, "messages", "content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 3}]}, "messages", "content"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages",
        "text parts",
    ),
    (
        {"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]},
        "messages",
        "function.name",
    ),
    ({"model": MODEL, "messages": USER, "tools": {"calc": 1}}, "tools", "list"),
    ({"model": MODEL, "messages": USER, "tools": [{"type": "function"}]}, "tools", "name"),
    ({"model": MODEL, "messages": USER, "tools": [CALC, CALC]}, "tools", "twice"),
    ({"model": MODEL, "messages": USER, "logit_bias": {"5": 3}}, "logit_bias", "logit_bias"),
    ({"model": MODEL, "messages": USER, "presence_penalty": 0.5}, "presence_penalty", "not"),
    ({"model": MODEL, "messages": USER, "stream": "yes"}, "stream", "true or false"),
    ({"model": MODEL, "messages": USER, "top_logprobs": 3}, "top_logprobs", "not supported"),
    ({"model": MODEL, "messages": USER, "tool_choice": "required"}, "tool_choice", "auto"),
    ({"model": MODEL, "messages": USER, "frobnicate": 1}, "frobnicate", "unrecognized"),
    ({"model": MODEL, "messages": USER, "temperature": 3}, "temperature", "[0.0, 2.0]"),
    ({"model": MODEL, "messages": USER, "top_p": 0}, "top_p", "top_p"),
    ({"model": MODEL, "messages": USER, "n": 17}, "n", "max_batch"),
    ({"model": MODEL, "messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most"),
    ({"model": MODEL, "messages": USER, "stop": ""}, "stop", "non-empty"),
    ({"model": MODEL, "messages": USER, "seed": "x"}, "seed", "integer"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 800}]}, "messages", "context"),
]


@pytest.mark.parametrize(("body", "param", "words"), BAD, ids=[b[1] for b in BAD])
def test_bad_chat_requests_are_400_naming_the_field(client, body, param, words):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "prompt": 5}, "prompt"),
        ({"model": MODEL, "prompt": [[0, 1], "x", {}]}, "prompt"),
        ({"model": MODEL, "prompt": [[0, 100_000]]}, "prompt"),
        ({"model": MODEL, "prompt": "x", "logprobs": 2}, "logprobs"),
        ({"model": MODEL, "prompt": "x", "echo": True}, "echo"),
        ({"model": MODEL, "prompt": "x", "best_of": 3}, "best_of"),
        ({"model": MODEL, "prompt": "x", "max_tokens": CONTEXT}, "max_tokens"),
    ],
)
def test_bad_completion_requests_are_400(client, body, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_body_that_is_not_json_and_unknown_paths(client):
    r = client.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    assert client.get("/v1/nothing").status_code == 404
    assert client.get("/v1/nothing").json()["error"]["type"] == "not_found_error"
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == CONTEXT


def test_api_key(served):
    with TestClient(create_app(served, api_key="sesame")) as client:
        req = {"model": MODEL, "prompt": "1 +", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "sesame"}):
            r = client.post("/v1/completions", json=req, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models").status_code == 401
        ok = client.post("/v1/completions", json=req, headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200, ok.text


def test_an_engine_failure_is_a_500_body(served):
    """Also for a streamed request that fails before its first token: no stream begins."""

    class Failing(ScriptedEngine):
        def submit(self, prompts, params, on_tokens=None):
            future: Future = Future()
            future.set_exception(RuntimeError("device lost"))
            return future

    served.engine = Failing(served.engine.generator, "")
    with TestClient(create_app(served)) as client:
        for stream in (False, True):
            body = {"model": MODEL, "prompt": "1 +", "stream": stream}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 500
            assert r.json()["error"] == {
                "message": "the engine failed: RuntimeError: device lost",
                "type": "server_error",
                "param": None,
                "code": None,
            }
