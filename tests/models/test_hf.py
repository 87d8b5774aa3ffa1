"""Hugging Face checkpoints: config mapping, logits against transformers, byte-identical round
trips, sharded files, and errors raised before any tensor data is read.

The tiny models under data/ were made by transformers (tests/models/make_hf_references.py);
transformers is not needed here (test_transformers_loads_tidal.py loads save_hf's output
with it).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tidal.models import FLAVORS, RopeScaling, load_hf, save_hf
from tidal.models.hf import ADAPTERS, adapter_for, hf_model_args, load_hf_state_dict
from tidal.models.hf.common import ConfigFields

DATA = Path(__file__).parent / "data"
# Made with transformers by make_hf_references.py: Qwen 3 untied and tied, Llama 3.2-style (tied,
# llama3 RoPE scaling), and Llama 2 (config.json in Llama-2-7b-hf's transformers-4 form).
TINY = ["tiny_qwen3", "tiny_qwen3_tied", "tiny_llama", "tiny_llama2"]


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("model*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


@pytest.fixture
def no_data_reads(monkeypatch):
    """Fail if any tensor data is read: checks must fire on headers alone."""
    import safetensors

    def refuse(*args, **kwargs):
        raise AssertionError("tensor data was read before the checks failed")

    monkeypatch.setattr(safetensors, "safe_open", refuse)


def copy_model(name: str, dst: Path) -> Path:
    shutil.copytree(DATA / name, dst, ignore=shutil.ignore_patterns("reference_*"))
    return dst


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


# ---------------------------------------------------------------------------------------
# configs


def test_tiny_configs_map_to_model_args():
    q = hf_model_args(DATA / "tiny_qwen3")
    assert (q.family, q.dim, q.n_heads, q.n_kv_heads, q.k, q.vocab_size) == (
        "qwen3",
        32,
        4,
        2,
        16,
        99,
    )
    assert q.qk_norm and not q.tie_embeddings and q.rope_scaling is None
    assert (q.norm_eps, q.rope_theta, q.max_seq_len) == (1e-6, 10_000.0, 64)
    llama = hf_model_args(DATA / "tiny_llama")  # transformers 5's rope_parameters style
    assert llama.family == "llama3" and llama.tie_embeddings and not llama.qk_norm
    assert llama.head_dim is None and llama.k == 8
    assert llama.rope_scaling == RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=16
    )
    assert llama.extra["hf"] == {"bos_token_id": 1, "eos_token_id": 2}
    tied = hf_model_args(DATA / "tiny_qwen3_tied")
    assert tied == dataclasses.replace(q, tie_embeddings=True)
    llama2 = hf_model_args(DATA / "tiny_llama2")  # Llama-2-7b-hf's form: no rope_theta
    assert (llama2.family, llama2.n_heads, llama2.n_kv_heads, llama2.k) == ("llama3", 4, 4, 8)
    assert not llama2.tie_embeddings and not llama2.qk_norm and llama2.rope_scaling is None
    assert (llama2.rope_theta, llama2.norm_eps, llama2.max_seq_len) == (10_000.0, 1e-5, 64)


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_every_flavor_survives_config_json(flavor):
    args = FLAVORS[flavor]
    adapter = adapter_for(args)
    config = adapter.hf_config(args)
    back = adapter.model_args(ConfigFields(json.loads(json.dumps(config)), "config.json"))
    assert back == args


def test_transformers_4_style_and_llama2_defaults(tmp_path):
    """rope_theta + rope_scaling at the top level (transformers 4); a Llama 2 config without
    num_key_value_heads or rope_theta."""
    v4 = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    args = ADAPTERS["llama"].model_args(ConfigFields(v4, "config.json"))
    assert args.rope_theta == 500000.0 and args.rope_scaling == FLAVORS["llama3_8b"].rope_scaling
    llama2 = {k: v for k, v in v4.items() if k not in ("num_key_value_heads", "rope_theta")}
    llama2 |= {"rope_scaling": None, "max_position_embeddings": 4096}
    args = ADAPTERS["llama"].model_args(ConfigFields(llama2, "config.json"))
    assert (args.n_kv_heads, args.rope_theta, args.rope_scaling) == (4, 10_000.0, None)


@pytest.mark.parametrize(
    "name, changes, message",
    [
        (
            "tiny_llama",
            {"model_type": "mistral"},
            r"'model_type' = 'mistral'.*\['llama', 'qwen2', 'qwen3', 'qwen3_moe'\]",
        ),
        ("tiny_qwen3", {"model_type": None}, r"'model_type' = None"),
        ("tiny_llama", {"attention_bias": True}, r"'attention_bias' = True"),
        ("tiny_llama", {"mlp_bias": True}, r"'mlp_bias' = True"),
        ("tiny_qwen3", {"hidden_act": "gelu"}, r"'hidden_act' = 'gelu'"),
        (
            "tiny_qwen3",
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
            r"'rope_parameters.rope_type' = 'yarn'",
        ),
        (
            "tiny_llama",
            {"rope_scaling": {"type": "linear", "factor": 2.0}},
            r"'rope_scaling.rope_type' = 'linear'",
        ),
        ("tiny_qwen3", {"use_sliding_window": True}, r"'use_sliding_window' = True"),
        (
            "tiny_qwen3",
            {"layer_types": ["full_attention", "sliding_attention"]},
            r"'layer_types' = \['full_attention', 'sliding_attention'\]",
        ),
        (
            "tiny_llama",
            {"quantization_config": {"quant_method": "gptq"}},
            r"'quantization_config'.*unquantized",
        ),
        (
            "tiny_llama",
            {"architectures": ["LlamaForSequenceClassification"]},
            r"'architectures' = \['LlamaForSequenceClassification'\]",
        ),
        ("tiny_qwen3", {"partial_rotary_factor": 0.5}, r"'partial_rotary_factor' = 0.5"),
        ("tiny_qwen3", {"hidden_size": ...}, r"required field 'hidden_size' is missing"),
        ("tiny_qwen3", {"num_hidden_layers": "2"}, r"'num_hidden_layers' = '2'.*positive integer"),
        ("tiny_llama", {"num_key_value_heads": 3}, r"n_heads=4 must be divisible by n_kv_heads=3"),
    ],
)
def test_unsupported_config_fields_are_named(name, changes, message, tmp_path, no_data_reads):
    folder = copy_model(name, tmp_path / name)
    edit_config(folder, **changes)
    with pytest.raises(ValueError, match=message) as err:
        load_hf(folder)
    assert str(folder / "config.json") in str(err.value)


def test_attention_dropout_is_ignored_with_a_warning(tmp_path):
    folder = copy_model("tiny_qwen3", tmp_path / "m")
    edit_config(folder, attention_dropout=0.1)
    with pytest.warns(UserWarning, match="attention_dropout=0.1 is ignored"):
        hf_model_args(folder)


def test_missing_folder_or_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_hf(tmp_path)


# ---------------------------------------------------------------------------------------
# numerics and round trips


@pytest.mark.parametrize("name", TINY)
def test_logits_match_transformers(name):
    model = load_hf(DATA / name)
    ref = load_file(str(DATA / name / "reference_logits.safetensors"))
    with torch.no_grad():
        got = model(ref["tokens"])
    diff = (got - ref["logits"]).abs().max().item()
    assert diff < 1e-4, f"max |tidal - transformers| = {diff}"
    assert ref["logits"].abs().max() > 1  # logits large enough to mean something


@pytest.mark.parametrize("name", TINY)
def test_hf_tidal_hf_is_byte_identical(name, tmp_path):
    save_hf(load_hf(DATA / name), tmp_path / "fp32")
    original, written = tensors(DATA / name), tensors(tmp_path / "fp32")
    assert original.keys() == written.keys()
    for k in original:
        assert same_bytes(original[k], written[k]), k
    assert hf_model_args(tmp_path / "fp32") == hf_model_args(DATA / name)
    # A bf16 checkpoint keeps its dtype through tidal (dtype=None) and its bytes.
    save_hf(load_hf(DATA / name), tmp_path / "bf16", dtype=torch.bfloat16)
    model = load_hf(tmp_path / "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope.dtype == torch.float32
    save_hf(model, tmp_path / "again")
    bf16, again = tensors(tmp_path / "bf16"), tensors(tmp_path / "again")
    assert bf16.keys() == again.keys() and all(same_bytes(bf16[k], again[k]) for k in bf16)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["torch_dtype"] == (
        "bfloat16"
    )


def test_load_dtype_and_device():
    model = load_hf(DATA / "tiny_qwen3", dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ref = load_file(str(DATA / "tiny_qwen3" / "reference_logits.safetensors"))
    with torch.no_grad():
        got = model(ref["tokens"]).float()
    torch.testing.assert_close(got, ref["logits"], atol=0.15, rtol=0.05)


def test_sharded_save_writes_an_index_and_loads_back(tmp_path):
    model = load_hf(DATA / "tiny_qwen3")
    written = tensors(DATA / "tiny_qwen3")
    save_hf(model, tmp_path, max_shard_size=30_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["weight_map"].keys() == written.keys()
    total = sum(t.numel() * t.element_size() for t in written.values())
    assert index["metadata"]["total_size"] == total
    for s in shards:  # a shard grows past the limit only by holding a single tensor
        with safe_open(str(tmp_path / s), "pt") as h:
            keys = list(h.keys())
            size = sum(h.get_tensor(k).numel() * 4 for k in keys)
        assert size <= 30_000 or len(keys) == 1
    back = load_hf(tmp_path)
    for (k, a), b in zip(model.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    save_hf(model, tmp_path)  # one file now: the old shards and index go
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_load_into_a_state_dict_and_pipeline_stage(tmp_path):
    """load_hf_state_dict fills plain tensors; a stage's subset loads with strict=False."""
    full = load_hf(DATA / "tiny_llama").state_dict()
    args = hf_model_args(DATA / "tiny_llama")
    from tidal.models import Transformer

    model = Transformer(args)
    stage = {k: v for k, v in model.state_dict().items() if k.startswith("layers.1.")}
    with pytest.raises(ValueError, match="tensor\\(s\\) the llama model of its config.json"):
        load_hf_state_dict(DATA / "tiny_llama", stage)
    load_hf_state_dict(DATA / "tiny_llama", stage, strict=False)
    for k, v in stage.items():
        assert torch.equal(v, full[k]), k
    wrapped = {f"layers.1._checkpoint_wrapped_module.{k[9:]}": v for k, v in stage.items()}
    load_hf_state_dict(DATA / "tiny_llama", wrapped, strict=False)  # wrapper names are fine
    with pytest.raises(ValueError, match="'layers.9.ffn_norm.weight' is not a tensor"):
        load_hf_state_dict(DATA / "tiny_llama", {"layers.9.ffn_norm.weight": torch.empty(32)})


def test_tied_checkpoint_with_an_lm_head_copy_warns(tmp_path):
    folder = copy_model("tiny_llama", tmp_path / "m")
    sd = load_file(str(folder / "model.safetensors"))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="lm_head.weight is ignored"):
        load_hf(folder)


def test_save_refuses_bad_state_dicts(tmp_path):
    model = load_hf(DATA / "tiny_qwen3")
    from tidal.models.hf import save_hf_state_dict

    sd = model.state_dict()
    del sd["norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        save_hf_state_dict(sd, model.args, tmp_path)
    sd = model.state_dict() | {"extra.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"unknown \['extra.weight'\]"):
        save_hf_state_dict(sd, model.args, tmp_path)
    sd = model.state_dict() | {"norm.weight": torch.empty(32, device="meta")}
    with pytest.raises(TypeError, match="'norm.weight' is a torch.float32 tensor on meta"):
        save_hf_state_dict(sd, model.args, tmp_path)
    with pytest.raises(TypeError, match="floating-point dtype, got torch.int8"):
        save_hf(model, tmp_path, dtype=torch.int8)
    with pytest.raises(ValueError, match="max_shard_size must be a positive byte count"):
        save_hf(model, tmp_path, max_shard_size=0)
    assert not list(tmp_path.iterdir())  # nothing written


# ---------------------------------------------------------------------------------------
# safetensors errors, all raised from the headers alone


def rewrite(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    sd = load_file(str(path))
    edit(sd)
    save_file(sd, str(path), metadata={"format": "pt"})


K_NORM = "model.layers.1.self_attn.k_norm.weight"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda sd: sd.pop(K_NORM), rf"checkpoint has no tensor '{K_NORM}'"),
        (
            lambda sd: sd.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(64, 32)}),
            r"1 tensor\(s\) the qwen3 model .* does not: \['model.layers.2.mlp.up_proj.weight'\]",
        ),
        (
            lambda sd: sd.update({"model.embed_tokens.weight": torch.zeros(98, 32)}),
            r"'model.embed_tokens.weight' has shape \[98, 32\], but tidal's "
            r"'tok_embeddings.weight' has shape \[99, 32\]",
        ),
        (
            lambda sd: sd.update({K_NORM: torch.ones(16, dtype=torch.int32)}),
            rf"'{K_NORM}' has dtype I32; expected one of",
        ),
    ],
)
def test_tensor_mismatches_are_named(edit, message, tmp_path, no_data_reads):
    folder = copy_model("tiny_qwen3", tmp_path / "m")
    rewrite(folder, edit)
    with pytest.raises(ValueError, match=message):
        load_hf(folder)


def test_truncated_and_corrupt_files_are_named(tmp_path, no_data_reads):
    folder = copy_model("tiny_qwen3", tmp_path / "m")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=rf"{path}: truncated safetensors file"):
        load_hf(folder)
    path.write_bytes(data[:5])
    with pytest.raises(ValueError, match=rf"{path}: not a safetensors file"):
        load_hf(folder)
    path.write_bytes((10**9).to_bytes(8, "little") + data[8:])
    with pytest.raises(ValueError, match=rf"{path}: truncated or corrupt"):
        load_hf(folder)
    n = int.from_bytes(data[:8], "little")
    path.write_bytes(data[:8] + b"#" * n + data[8 + n :])
    with pytest.raises(ValueError, match=rf"{path}: corrupt safetensors header"):
        load_hf(folder)
    path.unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        load_hf(folder)


def test_index_errors_are_named(tmp_path, request):
    folder = tmp_path / "m"
    save_hf(load_hf(DATA / "tiny_qwen3"), folder, max_shard_size=30_000)
    request.getfixturevalue("no_data_reads")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    second = sorted(set(index["weight_map"].values()))[1]
    (folder / second).unlink()
    with pytest.raises(FileNotFoundError, match=f"names shard {second}, which does not exist"):
        load_hf(folder)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != second}
    index["weight_map"]["model.norm.weight"] = index["weight_map"]["model.embed_tokens.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="disagree on which tensors the shard holds"):
        load_hf(folder)
    index_path.write_text("[]")
    with pytest.raises(ValueError, match="not a safetensors index"):
        load_hf(folder)
