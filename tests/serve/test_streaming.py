"""Token streaming: text deltas that add up to the unstreamed text, sent while the samples run
(the official `openai` client against a real uvicorn server), and the hold-back rules."""

from __future__ import annotations

import random
import time

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models

from tests.serve.conftest import MODEL, make_served, uvicorn_server
from tests.serve.test_api import CALC, USER
from tidal.serve.app import create_app
from tidal.serve.streaming import TextDeltas
from tidal.train.data.tokenizer import Tokenizer as TidalTokenizer

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
    partial = TextDeltas(lambda ids: bytes(ids).decode("utf-8", "replace"))
    assert partial.add(list(b"caf")) == "caf"
    assert partial.add([0xC3]) == ""  # the first of the two bytes of "é"
    assert partial.add([0xA9]) == "é"


def sentencepiece_like() -> TidalTokenizer:
    """A Llama-2-style vocabulary: byte-fallback tokens, `▁` for spaces, a decoder that drops
    the text's leading space and decodes a run of byte tokens as one (an invalid byte makes
    every byte of the run a U+FFFD)."""
    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    vocab |= {"▁a": 258, "▁b": 259, "▁": 260, "c": 261}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return TidalTokenizer(tok, bos_id=1, eos_id=1)


def test_byte_fallback_runs_and_leading_spaces_stream_as_decoded_whole():
    """'a', then a euro sign's three byte tokens and an invalid byte (the run decodes as four
    U+FFFD once the invalid byte is in it), then ' b': nothing of the run goes out until it
    ends, and the stretch decoded apart keeps its space."""
    tok = sentencepiece_like()
    assert tok.byte_fallback_ids() == frozenset(range(2, 258))
    euro = [2 + 0xE2, 2 + 0x82, 2 + 0xAC]
    for ids in ([258, *euro, 2 + 0xFF, 259], [258, *euro, 259, 261, 258]):
        final = tok.decode(ids)
        for run in (1, 2, 3):
            texts, sent = TextDeltas(tok.decode, (), tok.byte_fallback_ids()), ""
            for at in range(0, len(ids), run):
                sent += texts.add(ids[at : at + run])
                assert final.startswith(sent), (sent, final)
            assert sent + texts.rest(final) == final


def test_a_decoder_that_changes_its_mind_never_gets_text_twice():
    texts = TextDeltas(lambda ids: "".join(map(chr, ids)))
    assert texts.add([ord(c) for c in "abc"]) == "abc"
    assert texts.rest("abXYZ") == "XYZ"


def test_streamed_chat_sends_the_prompt_ids_once(url):
    """`return_token_ids` streamed: `prompt_token_ids` with the opening and closing chunks,
    not with every text delta."""
    c = client(url)
    args = dict(model=MODEL, messages=USER, max_tokens=40, seed=7, temperature=1.0)
    chunks = list(
        c.chat.completions.create(**args, stream=True, extra_body={"return_token_ids": True})
    )
    with_ids = [ch for ch in chunks if "prompt_token_ids" in (ch.model_extra or {})]
    deltas = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(with_ids) == 3 and len(deltas) >= 3  # role, last delta, finish
    assert (
        with_ids[0].model_extra["prompt_token_ids"] == with_ids[-1].model_extra["prompt_token_ids"]
    )


def test_a_client_that_leaves_early_still_has_its_response_recorded(tiny_model, chat_tokenizer):
    """The response is settled when the engine is done, whether or not the client reads on:
    the record hook (and a chat session's memory) sees it."""
    seen = []
    served = make_served(tiny_model, chat_tokenizer, check_every=2)
    app = create_app(served, record=lambda headers, body: seen.append(body))
    with uvicorn_server(app) as url:
        body = {"model": MODEL, "messages": USER, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the opening, then the client goes
        deadline = time.monotonic() + 60
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(seen) == 1 and seen[0]["object"] == "chat.completion"
