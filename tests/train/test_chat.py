"""Chat (SFT) data: message checks, chat templates, loss masks, packing whole samples into rows,
and the chat pipeline end to end on small generated files; no network."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch

from tidal.train.data import DataConfig, Tokenizer, build_data
from tidal.train.data.chat import (
    BUILTIN_TEMPLATE,
    ChatEncoder,
    ChatTemplate,
    build_encoder,
    check_messages,
    find_template,
)
from tidal.train.data.config import CHAT_SPECIAL_TOKENS
from tidal.train.data.packing import PackedSplit, pack_rows
from tidal.train.data.tokenizer import train_bpe
from tidal.train.loss import IGNORE_INDEX

WORDS = "the cat sat on a mat while dogs ran far away from home and back again".split()


def chats(n: int, seed: int = 0, turns: int = 1) -> list[list[dict[str, str]]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        sample = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for t in range(turns):
            q = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 9))))
            a = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 12))))
            sample += [
                {"role": "user", "content": f"{i}.{t}: {q}?"},
                {"role": "assistant", "content": a},
            ]
        out.append(sample)
    return out


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    texts = [m["content"] for s in chats(200, turns=2) for m in s] + ["user assistant system"]
    return train_bpe(texts, 400, tmp_path_factory.mktemp("bpe"), extra_specials=CHAT_SPECIAL_TOKENS)


@pytest.fixture(scope="module")
def encoder(tok: Tokenizer) -> ChatEncoder:
    return build_encoder(tok, "builtin", None)


def write_jsonl(path: Path, samples: list, field: str = "messages") -> Path:
    with open(path, "w") as f:
        for s in samples:
            f.write(json.dumps({field: s, "id": 0}) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# Messages and templates


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ([{"role": "user", "content": "hi"}], "no assistant turn (roles ['user'])"),
        ([], "non-empty list of messages"),
        ("hello", "non-empty list of messages"),
        ([{"role": "user"}, {"role": "assistant", "content": "x"}], "string 'content'"),
        ([{"role": "assistant", "content": 3}], "string 'content' (int)"),
        (["hi"], "message 0 is str"),
    ],
)
def test_bad_samples_are_named(sample: object, message: str) -> None:
    with pytest.raises(ValueError, match="f.jsonl:7") as e:
        check_messages(sample, "f.jsonl:7")
    assert message in str(e.value)


def test_assistant_tokens_alone_are_masked_in(tok: Tokenizer, encoder: ChatEncoder) -> None:
    assert encoder.stop_text == "<|im_end|>"
    assert tok.token_id("<|im_end|>") in encoder.stop_ids and tok.eos_id in encoder.stop_ids
    for sample in chats(12, turns=2):
        ids, mask = encoder.encode(sample)
        assert len(ids) == len(mask) and ids[0] == tok.bos_id and mask[0] == 0
        learned = tok.decode(
            [t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False
        )
        answers = [m["content"] for m in sample if m["role"] == "assistant"]
        assert learned == "".join(f"{a}<|im_end|>\n" for a in answers)
        whole = tok.decode(ids, skip_special_tokens=False)
        assert whole == "<|bos|>" + ChatTemplate(BUILTIN_TEMPLATE).render(sample)
    # The prompt the model is given at generation time is the encoding's own prefix.
    sample = chats(1)[0]
    ids, mask = encoder.encode(sample)
    prompt = encoder.prompt_ids(sample)
    assert ids[: len(prompt)] == prompt and mask[len(prompt)] == 1 and not any(mask[: len(prompt)])
    # Turn markers are single special tokens; the same text in a message is too (as in
    # transformers' apply_chat_template), but plain `encode` keeps them as text.
    assert tok.encode("<|im_start|>", special_tokens=True) == [tok.token_id("<|im_start|>")]
    assert tok.token_id("<|im_start|>") not in tok.encode("<|im_start|>")


def test_templates_found_next_to_the_tokenizer(tmp_path: Path, tok: Tokenizer) -> None:
    tok.save(tmp_path / "tokenizer.json")
    path = str(tmp_path / "tokenizer.json")
    assert find_template("", path) == ("builtin", BUILTIN_TEMPLATE)
    assert find_template("", None)[0] == "builtin"
    jinja = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (tmp_path / "chat_template.jinja").write_text(jinja)
    assert find_template("", path) == (str(tmp_path / "chat_template.jinja"), jinja)
    config = {
        "chat_template": [
            {"name": "tool_use", "template": "x"},
            {"name": "default", "template": jinja + "!"},
        ]
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert find_template("", path)[1] == jinja + "!"
    assert find_template("builtin", path)[0] == "builtin"
    (tmp_path / "mine.jinja").write_text(jinja)
    assert find_template(str(tmp_path / "mine.jinja"), path)[1] == jinja
    with pytest.raises(FileNotFoundError, match="DataConfig.chat_template"):
        find_template(str(tmp_path / "missing.jinja"), path)


def test_a_template_without_special_markers_still_masks(tok: Tokenizer) -> None:
    jinja = (
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    enc = ChatEncoder(tok, ChatTemplate(jinja, bos_token="<|bos|>", eos_token="<|eos|>"))
    assert enc.stop_ids == {tok.eos_id}  # no special end-of-turn token to stop at
    ids, mask = enc.encode(chats(1)[0])
    assert ids.count(tok.bos_id) == 1  # the template wrote BOS; none added
    learned = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert learned == chats(1)[0][-1]["content"] + "\n\n"


def test_templates_that_cannot_render_fail_clearly(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="does not compile: line 1"):
        ChatTemplate("{% for m in messages %}{{ m.content }")
    strict = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn first') }}"
        "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    with pytest.raises(ValueError, match="cannot render a probe conversation.*system turn first"):
        ChatTemplate(strict, name="strict").check()
    with pytest.raises(ValueError, match="cannot render"):
        ChatEncoder(tok, ChatTemplate("{{ messages[0].content.nope() }}"))
    # A template that rewrites earlier turns cannot have its assistant turns marked.
    rewriting = (
        "{% for m in messages %}{% if loop.last %}{{ m.content }}{% else %}...{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    with pytest.raises(ValueError, match="not a prefix"):
        ChatEncoder(tok, ChatTemplate(rewriting, name="rewriting"))


# ---------------------------------------------------------------------------------------------
# Packing whole samples into rows


def test_rows_hold_whole_samples_and_pad() -> None:
    lengths = [5, 3, 4, 8, 2, 9]  # 9 is longer than a row and is cut to 8
    tokens, mask, starts, pos = [], [], [], 0
    for n in lengths:
        starts.append(pos)
        tokens += [0] + [10 + n] * (n - 1)  # BOS, then the sample's own id
        mask += [0] + [1] * (n - 1)
        pos += n
    split = PackedSplit(
        tokens=np.array(tokens, dtype=np.uint16),
        doc_starts=np.array(starts),
        loss_mask=np.array(mask, dtype=np.uint8),
    )
    rows, cut = pack_rows(split, 8, pad_id=1)
    assert cut == 1
    grid = rows.tokens[:-1].reshape(-1, 8).tolist()
    assert grid == [
        [0, 15, 15, 15, 15, 0, 13, 13],
        [0, 14, 14, 14, 1, 1, 1, 1],
        [0, 18, 18, 18, 18, 18, 18, 18],
        [0, 12, 1, 1, 1, 1, 1, 1],
        [0, 19, 19, 19, 19, 19, 19, 19],
    ]
    assert rows.tokens[-1] == 1 and rows.loss_mask is not None
    assert rows.loss_mask[rows.tokens == 1].sum() == 0  # padding is never a target
    assert np.all(np.diff(rows.doc_starts) > 0) and rows.doc_starts[0] == 0


def test_chat_pipeline_masks_packs_splits_and_resumes(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", chats(300))
    cfg = DataConfig(
        dataset="jsonl",
        path=str(path),
        format="chat",
        vocab_size=400,
        val_fraction=0.1,
        cache_dir=str(tmp_path / "cache"),
    )
    logs: list[str] = []
    data = build_data(cfg, seq_len=128, batch_size=4, seed=0, log=logs.append)
    assert data.chat is not None and data.val is not None
    assert any("270 train / 30 val chat samples" in line for line in logs)
    tok = data.tokenizer
    im_start = tok.token_id("<|im_start|>")
    for b in [next(data.train) for _ in range(5)]:
        for row_ids, row_labels in zip(b.input_ids.tolist(), b.labels.tolist(), strict=True):
            assert row_ids[0] == tok.bos_id and row_ids[1] == im_start  # rows start a sample
            text = tok.decode(
                [t for t in row_labels if t != IGNORE_INDEX], skip_special_tokens=False
            )
            assert "user" not in text and "<|im_start|>" not in text and text.endswith("\n")
            turns = tok.decode(row_ids, skip_special_tokens=False).count("<|im_start|>assistant")
            assert text.count("<|im_end|>") == turns  # every answer whole, none cut
        assert (b.labels != IGNORE_INDEX).any()

    def samples(loader) -> set[str]:
        text = tok.decode(np.asarray(loader.tokens).tolist(), skip_special_tokens=False)
        return {s.replace("<|eos|>", "") for s in text.split("<|bos|>")} - {""}

    assert len(samples(data.train)) == 270 and len(samples(data.val)) == 30
    assert not samples(data.train) & samples(data.val)  # never the same sample in both

    # Resuming from a (JSON round-tripped) state gives the same batches.
    for _ in range(2):
        next(data.train)
    state = json.loads(json.dumps(data.train.state_dict()))
    expected = [next(data.train) for _ in range(3)]
    again = build_data(cfg, seq_len=128, batch_size=4, seed=0, log=lambda _: None)
    again.train.load_state_dict(state)
    for e in expected:
        got = next(again.train)
        assert torch.equal(got.input_ids, e.input_ids) and torch.equal(got.labels, e.labels)


def test_chat_records_without_an_assistant_turn_are_named(tmp_path: Path) -> None:
    good = chats(5)
    bad = [*good[:3], [{"role": "user", "content": "and the answer?"}], *good[3:]]
    path = write_jsonl(tmp_path / "bad.jsonl", bad)
    cfg = DataConfig(
        dataset="jsonl", path=str(path), format="chat", cache_dir=str(tmp_path / "cache")
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl:4: the sample has no assistant turn"):
        build_data(cfg, seq_len=32, batch_size=1, seed=0, log=lambda _: None)
    wrong_field = DataConfig(
        dataset="jsonl",
        path=str(path),
        format="chat",
        messages_field="conversation",
        cache_dir=str(tmp_path / "cache"),
    )
    with pytest.raises(ValueError, match=r"no field 'conversation' \(DataConfig.messages_field\)"):
        build_data(wrong_field, seq_len=32, batch_size=1, seed=0, log=lambda _: None)


def test_a_bad_template_fails_before_any_data_is_read(tmp_path: Path) -> None:
    template = tmp_path / "bad.jinja"
    template.write_text("{{ raise_exception('unsupported roles') }}")
    cfg = DataConfig(
        dataset="jsonl",
        path=str(tmp_path / "not-there.jsonl"),
        format="chat",
        chat_template=str(template),
        cache_dir=str(tmp_path / "cache"),
    )
    with pytest.raises(ValueError, match="bad.jinja cannot render a probe.*unsupported roles"):
        build_data(cfg, seq_len=32, batch_size=1, seed=0, log=lambda _: None)


def test_chat_from_parquet_and_hf_and_a_tokenizer_file(tmp_path: Path, tok: Tokenizer) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pytest.importorskip("datasets")
    samples = chats(120)
    pq.write_table(pa.table({"messages": samples}), tmp_path / "chat.parquet")
    tok.save(tmp_path / "tokenizer.json")
    jinja = (
        "{% for m in messages %}<|im_start|>{{ m.role }}: {{ m.content }}<|im_end|>"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": jinja}))
    for dataset in ("parquet", "hf"):
        cfg = DataConfig(
            dataset=dataset,
            path=str(tmp_path / "chat.parquet"),
            format="chat",
            tokenizer=str(tmp_path / "tokenizer.json"),
            val_fraction=0.1,
            cache_dir=str(tmp_path / "cache"),
        )
        logs: list[str] = []
        data = build_data(cfg, seq_len=64, batch_size=2, seed=0, log=logs.append)
        assert any("tokenizer_config.json" in line for line in logs)
        assert data.chat is not None and data.chat.template.source == jinja
        labels = next(data.train).labels
        text = data.tokenizer.decode([t for t in labels.flatten().tolist() if t != IGNORE_INDEX])
        assert "user" not in text and "assistant" not in text and text


def test_tokenizers_without_chat_markers_render_them_as_text(tmp_path: Path) -> None:
    t = tokenizers.Tokenizer(tokenizers.models.BPE())
    t.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    t.train_from_iterator(["hello there"], trainer=trainer)
    t.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    enc = build_encoder(tok, "", str(tmp_path / "tokenizer.json"))
    assert enc.template.name == "builtin" and enc.stop_ids == {tok.eos_id}
    ids, mask = enc.encode(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    )
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "hello<|im_end|>\n"


def test_a_sample_the_template_cannot_render_is_named(tok: Tokenizer) -> None:
    """The template renders the probe conversation but refuses one sample: the error names
    that sample's file and line."""
    picky = (
        "{% for m in messages %}{% if 'forbidden' in m.content %}"
        "{{ raise_exception('no forbidden words') }}{% endif %}{{ m.role }}: {{ m.content }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    enc = ChatEncoder(tok, ChatTemplate(picky, name="picky"))
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    bad = [{"role": "user", "content": "a forbidden word"}, {"role": "assistant", "content": "x"}]
    with pytest.raises(ValueError, match=r"picky cannot render data.jsonl:2: .*no forbidden words"):
        enc.encode_many([good, bad], ["data.jsonl:1", "data.jsonl:2"])
