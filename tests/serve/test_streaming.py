"""Token streaming: text deltas that add up to the unstreamed text, sent while the samples run
(the official `openai` client against a real uvicorn server), and the hold-back rules."""

from __future__ import annotations

import random

import pytest

from tests.serve.conftest import MODEL, make_served, uvicorn_server
from tests.serve.test_api import CALC, USER
from tidal.serve.app import create_app
from tidal.serve.streaming import TextDeltas

openai = pytest.importorskip("openai")


@pytest.fixture
def url(tiny_model, chat_tokenizer):
    # A host check every 2 steps: a 40-token completion reports ~20 times.
    served = make_served(tiny_model, chat_tokenizer, check_every=2)
    with uvicorn_server(create_app(served)) as url:
        yield url


def client(url: str):
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)


def test_chat_text_streams_as_it_decodes(url):
    """Several content deltas per choice (the closing alone would send one), adding up to
    the text of the same request unstreamed, with its finish reason."""
    c = client(url)
    args = dict(model=MODEL, messages=USER, n=2, max_tokens=40, seed=7, temperature=1.0)
    whole = c.chat.completions.create(**args)
    deltas: list[list[str]] = [[], []]
    finish = [None, None]
    for chunk in c.chat.completions.create(**args, stream=True):
        (choice,) = chunk.choices
        if choice.delta.content:
            deltas[choice.index].append(choice.delta.content)
        finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert ["".join(d) for d in deltas] == [ch.message.content for ch in whole.choices]
    assert finish == [ch.finish_reason for ch in whole.choices]
    assert all(len(d) >= 3 for d in deltas), deltas


def test_completions_stream_per_choice_with_stop_strings(url):
    """Two prompts, n=2 and a stop string: each choice's deltas add up to its text, cut
    before the stop string as without streaming."""
    c = client(url)
    args = dict(model=MODEL, prompt=["1+1=", "12+30="], n=2, max_tokens=30, seed=3, stop=["0"])
    whole = c.completions.create(**args)
    texts = ["" for _ in whole.choices]
    chunks = 0
    for chunk in c.completions.create(**args, stream=True):
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        chunks += 1
    assert texts == [ch.text for ch in sorted(whole.choices, key=lambda ch: ch.index)]
    assert all("0" not in t for t in texts)
    assert chunks > 2 * len(texts)  # more than each choice's closing pair


def test_chat_with_tools_sends_the_content_whole(url):
    """With tools the content is what the tool calls leave: it comes in one delta, at the
    end, equal to the unstreamed content."""
    c = client(url)
    args = dict(model=MODEL, messages=USER, tools=[CALC], max_tokens=30, seed=2)
    whole = c.chat.completions.create(**args)
    content = [
        ch.choices[0].delta.content
        for ch in c.chat.completions.create(**args, stream=True)
        if ch.choices and ch.choices[0].delta.content
    ]
    assert content == (
        [whole.choices[0].message.content] if whole.choices[0].message.content else []
    )


@pytest.mark.parametrize("seed", range(20))
def test_deltas_are_always_a_prefix_of_the_final_text(chat_tokenizer, seed):
    """Random token ids (byte-level: split multi-byte characters and invalid bytes among
    them) fed in random runs, with stop strings: every text sent is a prefix of the finished
    text (decoded whole and cut at the first stop string), and the rest completes it."""
    rng = random.Random(seed)
    ids = [rng.randrange(chat_tokenizer.vocab_size) for _ in range(rng.randrange(1, 60))]
    stop = tuple(rng.sample(["0", "= ", "\ufffd", "ab", "1+1"], rng.randrange(0, 3)))
    full = chat_tokenizer.decode(ids)
    cuts = [full.find(s) for s in stop if s in full]
    final = full[: min(cuts)] if cuts else full
    texts, sent, at = TextDeltas(chat_tokenizer.decode, stop), "", 0
    while at < len(ids):
        run = rng.randrange(1, 6)
        sent += texts.add(ids[at : at + run])
        at += run
        assert final.startswith(sent), (sent, final)
    assert sent + texts.rest(final) == final


def test_hold_back_rules():
    """What waits: a possible start of a stop string, and a character whose bytes are not
    all decoded; what never goes out: a stop string and what follows it."""
    texts = TextDeltas(lambda ids: "".join(map(chr, ids)), stop=("STOP",))
    assert texts.add([ord(c) for c in "hello S"]) == "hello "
    assert texts.add([ord("T")]) == ""
    assert texts.add([ord("x")]) == "STx"  # not a stop after all
    assert texts.add([ord(c) for c in " STOP and on"]) == " "
    assert texts.rest("hello STx ") == ""
    partial = TextDeltas(lambda ids: "caf" + "\ufffd" * ids[0])
    assert partial.add([2]) == "caf" and partial.rest("café") == "é"
