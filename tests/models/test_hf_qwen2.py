"""Qwen 2 / 2.5 (`model_type: qwen2`, biases on q/k/v): tiny random models written by transformers
load to its logits, save back byte-identical, and transformers loads what tidal writes; the
released configs map to the flavors; unsupported fields are refused by name; the KV cache, the
generator (bitwise in batch-invariant mode) and fused projections carry the biases.

Unlike test_hf.py (committed references), the tiny models are made here with transformers
(a test dependency), in a temporary folder, from a fixed seed: no network.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

from tests.models.make_hf_references import TINY_TOKENS, _perturb
from tests.models.test_hf import edit_config, same_bytes, tensors
from tidal.models import FLAVORS, KVCache, Transformer, get_flavor, load_hf, save_hf
from tidal.models.hf import ADAPTERS, hf_model_args
from tidal.models.hf.common import ConfigFields

# The untied model's config.json as the released Qwen2.5-7B has it (transformers 4: rope_theta
# at the top level, an inactive sliding window, use_mrope), at the tiny size.
RELEASED_STYLE = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 99,
}


@pytest.fixture(scope="module")
def transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only, never the hub
    return pytest.importorskip("transformers")


def hf_logits(transformers, folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(tokens).logits


@pytest.fixture(scope="module", params=["tied", "untied"])
def tiny_qwen2(request, transformers, tmp_path_factory):
    """(folder, tokens, transformers' logits): tied (0.5B/1.5B style, transformers 5's
    config.json), or untied with the released 7B's config.json form."""
    tied = request.param == "tied"
    config = transformers.Qwen2Config(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=1_000_000.0,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _perturb(model, seed=7 if tied else 8)  # biases too: values around 1
    folder = tmp_path_factory.mktemp(f"qwen2_{request.param}")
    model.save_pretrained(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    tokens = torch.tensor(TINY_TOKENS)
    with torch.no_grad():
        logits = model(tokens).logits
    if not tied:
        (folder / "config.json").write_text(json.dumps(RELEASED_STYLE, indent=2) + "\n")
        assert torch.equal(hf_logits(transformers, folder, tokens), logits)
    assert logits.abs().max() > 1  # logits large enough to mean something
    return folder, tokens, logits


def test_config_maps_to_model_args(tiny_qwen2):
    folder, _, _ = tiny_qwen2
    args = hf_model_args(folder)
    assert (args.family, args.dim, args.n_heads, args.n_kv_heads, args.k) == ("qwen2", 32, 4, 2, 8)
    assert args.qkv_bias and not args.qk_norm and args.head_dim is None
    assert (args.norm_eps, args.rope_theta, args.rope_scaling, args.max_seq_len) == (
        1e-6,
        1e6,
        None,
        64,
    )
    tied = json.loads((folder / "config.json").read_text())["tie_word_embeddings"]
    assert args.tie_embeddings == tied
    # Both configs carry max_window_layers (transformers 5 writes its default, 28); only the
    # released form has a n inactive sliding_window value.
    window = {"max_window_layers": 28} | ({} if tied else {"sliding_window": 131072})
    assert args.extra["hf"] == {"bos_token_id": 1, "eos_token_id": 2} | window
    with torch.device("meta"):
        sd = Transformer(args).state_dict()
    assert (
        sd["layers.0.attention.wk.bias"].shape == (16,) and "layers.0.attention.wo.bias" not in sd
    )


def test_logits_match_transformers(tiny_qwen2):
    folder, tokens, logits = tiny_qwen2
    with torch.no_grad():
        got = load_hf(folder)(tokens)
    torch.testing.assert_close(got, logits, atol=1e-5, rtol=0)


def test_hf_tidal_hf_is_byte_identical(tiny_qwen2, tmp_path):
    folder, _, _ = tiny_qwen2
    save_hf(load_hf(folder), tmp_path / "fp32")
    original, written = tensors(folder), tensors(tmp_path / "fp32")
    assert original.keys() == written.keys()
    assert any(k.endswith("q_proj.bias") for k in written)
    for k in original:
        assert same_bytes(original[k], written[k]), k
    assert hf_model_args(tmp_path / "fp32") == hf_model_args(folder)
    config = json.loads((tmp_path / "fp32" / "config.json").read_text())
    source = json.loads((folder / "config.json").read_text())
    for key in ("sliding_window", "max_window_layers", "use_sliding_window", "bos_token_id"):
        if source.get(key) is not None:  # the inactive window's settings come back
            assert config[key] == source[key], key
    # bf16 keeps its dtype and bytes through tidal.
    save_hf(load_hf(folder), tmp_path / "bf16", dtype=torch.bfloat16)
    model = load_hf(tmp_path / "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    save_hf(model, tmp_path / "again")
    bf16, again = tensors(tmp_path / "bf16"), tensors(tmp_path / "again")
    assert bf16.keys() == again.keys() and all(same_bytes(bf16[k], again[k]) for k in bf16)


@pytest.mark.parametrize("shard", [None, 20_000])
def test_transformers_loads_what_tidal_writes(tiny_qwen2, transformers, tmp_path, shard):
    folder, tokens, logits = tiny_qwen2
    save_hf(load_hf(folder), tmp_path, **({} if shard is None else {"max_shard_size": shard}))
    assert (len(list(tmp_path.glob("*.safetensors"))) > 1) == (shard is not None)
    torch.testing.assert_close(hf_logits(transformers, tmp_path, tokens), logits, atol=1e-5, rtol=0)


def test_transformers_loads_a_qwen2_tidal_built(transformers, tmp_path):
    """A model tidal made itself (config.json from ModelArgs alone), its zero-initialized
    biases set to random values so that a lost bias would show."""
    model = Transformer(get_flavor("debug_qwen2", vocab_size=96, n_layers=2)).eval()
    model.init_weights(seed=1)
    assert all(
        torch.equal(b, torch.zeros_like(b)) for n, b in model.named_parameters() if "bias" in n
    )
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g))
    save_hf(model, tmp_path)
    tokens = torch.randint(0, 96, (2, 12), generator=g)
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(hf_logits(transformers, tmp_path, tokens), ours, atol=1e-5, rtol=0)


# Released config.json fields (Qwen/Qwen2.5-0.5B, -1.5B, -7B) that decide the shape.
RELEASED = {
    "qwen2_5_0_5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        sliding_window=32768,
        max_window_layers=24,
        tie_word_embeddings=True,
    ),
    "qwen2_5_1_5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        sliding_window=32768,
        max_window_layers=21,
        tie_word_embeddings=True,
    ),
    "qwen2_5_7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=131072,
        sliding_window=131072,
        max_window_layers=28,
        tie_word_embeddings=False,
    ),
}


@pytest.mark.parametrize("flavor", sorted(RELEASED))
def test_released_configs_are_the_flavors(flavor):
    fields = RELEASED_STYLE | RELEASED[flavor] | {"bos_token_id": 151643, "eos_token_id": 151643}
    args = ADAPTERS["qwen2"].model_args(ConfigFields(fields, "config.json"))
    assert args == FLAVORS[flavor]


@pytest.fixture
def no_data_reads(monkeypatch):
    """Fail if any tensor data is read: checks must fire on config.json alone."""
    import safetensors

    def refuse(*args, **kwargs):
        raise AssertionError("tensor data was read before the checks failed")

    monkeypatch.setattr(safetensors, "safe_open", refuse)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"use_sliding_window": True}, r"'use_sliding_window' = True"),
        (
            {"layer_types": ["full_attention", "sliding_attention"]},
            r"'layer_types' = \['full_attention', 'sliding_attention'\]",
        ),
        (
            {"rope_scaling": {"type": "yarn", "factor": 4.0}},
            r"'rope_scaling.rope_type' = 'yarn'",
        ),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            r"'rope_parameters.rope_type' = 'dynamic'",
        ),
        ({"use_mrope": True}, r"'use_mrope' = True"),
        ({"attention_bias": False}, r"'attention_bias' = False"),
        ({"mlp_bias": True}, r"'mlp_bias' = True"),
        ({"hidden_act": "gelu"}, r"'hidden_act' = 'gelu'"),
        ({"sliding_window": 0}, r"'sliding_window' = 0.*positive integer"),
        (
            {"quantization_config": {"quant_method": "awq"}},
            r"'quantization_config'.*unquantized",
        ),
        (
            {"architectures": ["Qwen2ForSequenceClassification"]},
            r"'architectures' = \['Qwen2ForSequenceClassification'\]",
        ),
    ],
)
def test_unsupported_fields_are_named(tiny_qwen2, changes, message, tmp_path, no_data_reads):
    import shutil

    folder = shutil.copytree(tiny_qwen2[0], tmp_path / "m")
    edit_config(folder, **changes)
    with pytest.raises(ValueError, match=message) as err:
        load_hf(folder)
    assert str(folder / "config.json") in str(err.value)


def test_inactive_sliding_window_loads(tiny_qwen2, tmp_path):
    """use_sliding_window false with a window that would cover layer 1: full attention, as in
    transformers (which computes layer_types from these fields)."""
    import shutil

    folder, tokens, logits = tiny_qwen2
    folder = shutil.copytree(folder, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config.pop("layer_types", None)  # transformers 5 derives it from the fields below
    config |= {"use_sliding_window": False, "sliding_window": 4, "max_window_layers": 1}
    (folder / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        torch.testing.assert_close(load_hf(folder)(tokens), logits, atol=1e-5, rtol=0)


def test_args_a_qwen2_config_cannot_hold():
    bad = get_flavor("debug_qwen2", qkv_bias=False)
    with pytest.raises(ValueError, match="always has q/k/v biases"):
        ADAPTERS["qwen2"].hf_config(bad)
    with pytest.raises(ValueError, match="a Llama checkpoint has no q/k/v biases"):
        ADAPTERS["llama"].hf_config(get_flavor("tiny", qkv_bias=True))


# ---------------------------------------------------------------------------------------
# the rest of tidal with biases


def test_kv_cache_and_generator_match_the_full_forward(tiny_qwen2):
    """Prefill then one token at a time through the KV cache gives the full forward's logits;
    the generator's greedy tokens are the full forward's argmax, and in batch-invariant mode
    its log-probs are bitwise the trainer's."""
    from tidal.generate import Generator, GeneratorConfig, SamplingParams, completion_logprobs

    model = load_hf(tiny_qwen2[0]).eval()
    tokens = torch.tensor(TINY_TOKENS)
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache.for_model(model, batch_size=2, capacity=16)
        steps = [model.forward_cached(tokens[:, :5], cache)]
        cache.advance(5)
        for t in range(5, tokens.shape[1]):
            steps.append(model.forward_cached(tokens[:, t : t + 1], cache))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)

    prompts = [TINY_TOKENS[0][:4], TINY_TOKENS[1][:7]]
    config = GeneratorConfig(max_batch=2, max_seq_len=32, batch_invariant=True)
    groups = Generator(model, config=config).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=10)
    )
    samples = [s for g in groups for s in g]
    with torch.no_grad():
        for s in samples:
            seq = list(s.prompt_ids) + list(s.completion_ids)
            logits = model(torch.tensor([seq]))[0, len(s.prompt_ids) - 1 : -1]
            assert logits.argmax(-1).tolist() == list(s.completion_ids)
        scored = completion_logprobs(model, samples, batch_invariant=True)
    for s, lp in zip(samples, scored, strict=True):
        assert torch.equal(torch.tensor(s.logprobs), lp)


def test_fused_projections_carry_the_biases(tiny_qwen2):
    model = load_hf(tiny_qwen2[0])
    fused = copy.deepcopy(model)
    assert fused.fuse_projections() == 2 * len(fused.layers)
    tokens = torch.tensor(TINY_TOKENS)
    loss_a, loss_b = model(tokens).square().mean(), fused(tokens).square().mean()
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=0)
    loss_a.backward()
    loss_b.backward()
    grads = {n: p.grad for n, p in fused.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
