"""Qwen 3 MoE checkpoints (tidal/models/hf/qwen3_moe.py): tiny random models that
transformers writes (its per-expert layout) load into tidal to transformers' logits, save back
byte-identical, load into transformers from what tidal writes, and unsupported routing fields
are refused with the field named before any tensor is read.

The models are made here by transformers (a test dependency) with a fixed seed, no network.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from tidal.models import Transformer, get_flavor, load_hf, save_hf
from tidal.models.hf import check_hf, hf_model_args, load_hf_state_dict, save_hf_state_dict
from tidal.models.moe import MoEArgs

from .test_hf import edit_config, same_bytes, tensors

TOKENS = torch.tensor(
    [[1, 5, 17, 42, 3, 77, 8, 64, 90, 12, 33, 2], [1, 60, 61, 62, 2, 9, 9, 9, 40, 41, 0, 95]]
)


@pytest.fixture(scope="module")
def transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only, never the hub
    return pytest.importorskip("transformers")


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough for O(1) logits, norm scales away from one (as
    make_hf_references.py does for the dense models)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def hf_model(transformers, folder: Path, **kw) -> torch.Tensor:
    """Write a tiny Qwen3MoeForCausalLM to `folder`; returns its fp32 logits of TOKENS."""
    fields = dict(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = transformers.Qwen3MoeConfig(**(fields | kw))
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    perturb(model, seed=7)
    model.save_pretrained(folder)
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "no_norm_topk"])
def tiny(request, transformers, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    folder = tmp_path_factory.mktemp("tiny_qwen3_moe")
    return folder, hf_model(transformers, folder, norm_topk_prob=request.param)


def test_config_maps_to_model_args(tiny):
    folder, _ = tiny
    args = hf_model_args(folder)
    assert (args.family, args.dim, args.n_layers, args.k, args.ffn_dim) == (
        "qwen3_moe",
        32,
        2,
        16,
        64,
    )
    norm = json.loads((folder / "config.json").read_text())["norm_topk_prob"]
    assert args.moe == MoEArgs(n_experts=8, top_k=2, ffn_dim=16, norm_topk_prob=norm)
    assert args.qk_norm and not args.tie_embeddings
    assert args.extra["hf"] == {"bos_token_id": 1, "eos_token_id": 2, "router_aux_loss_coef": 0.001}


def test_logits_match_transformers(tiny):
    folder, ref = tiny
    assert ref.abs().max() > 1  # logits large enough to mean something
    model = load_hf(folder)
    with torch.no_grad():
        got = model(TOKENS)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_hf_tidal_hf_is_byte_identical(tiny, tmp_path):
    folder, _ = tiny
    save_hf(load_hf(folder), tmp_path / "fp32")
    original, written = tensors(folder), tensors(tmp_path / "fp32")
    assert original.keys() == written.keys()
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in written
    for k in original:
        assert same_bytes(original[k], written[k]), k
    assert hf_model_args(tmp_path / "fp32") == hf_model_args(folder)
    save_hf(load_hf(folder), tmp_path / "bf16", dtype=torch.bfloat16)
    save_hf(load_hf(tmp_path / "bf16"), tmp_path / "again")
    bf16, again = tensors(tmp_path / "bf16"), tensors(tmp_path / "again")
    assert bf16.keys() == again.keys() and all(same_bytes(bf16[k], again[k]) for k in bf16)
    # Sharded: the experts of one layer may land in different files.
    save_hf(load_hf(folder), tmp_path / "sharded", max_shard_size=20_000)
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    back = load_hf(tmp_path / "sharded")
    for k, v in load_hf(folder).state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k


def test_transformers_loads_what_tidal_writes(transformers, tiny, tmp_path):
    folder, ref = tiny
    save_hf(load_hf(folder), tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(TOKENS).logits, ref, atol=1e-5, rtol=0)
    # A model tidal built itself, its config.json made from ModelArgs alone.
    torch.manual_seed(0)
    ours = Transformer(get_flavor("debug_moe", vocab_size=96, n_layers=2)).eval()
    ours.init_weights(seed=1)
    save_hf(ours, tmp_path / "ours")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", dtype=torch.float32
    )
    tokens = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens).logits, ours(tokens), atol=1e-5, rtol=0)


def test_state_dict_subset_and_check(tiny):
    folder, _ = tiny
    full = load_hf(folder).state_dict()
    args = check_hf(folder)
    layer = {k: v for k, v in Transformer(args).state_dict().items() if k.startswith("layers.1.")}
    load_hf_state_dict(folder, layer, strict=False)
    assert layer["layers.1.feed_forward.experts.w2"].shape == (8, 32, 16)
    for k, v in layer.items():
        assert torch.equal(v, full[k]), k


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"mlp_only_layers": [1]}, r"'mlp_only_layers' = \[1\]"),
        ({"decoder_sparse_step": 2}, r"'decoder_sparse_step' = 2"),
        ({"num_experts": 4}, r"'num_local_experts' = 8 .*num_experts=4"),
        ({"use_sliding_window": True}, r"'use_sliding_window' = True"),
        ({"num_experts_per_tok": 9}, r"moe.top_k=9 exceeds moe.n_experts=8"),
        ({"norm_topk_prob": "yes"}, r"'norm_topk_prob' = 'yes'"),
        ({"architectures": ["Qwen3ForCausalLM"]}, r"'architectures' = \['Qwen3ForCausalLM'\]"),
    ],
)
def test_unsupported_fields_are_named(tiny, tmp_path, changes, message, monkeypatch):
    import shutil

    import safetensors

    folder = tmp_path / "m"
    shutil.copytree(tiny[0], folder)
    edit_config(folder, **changes)

    def refuse(*args, **kwargs):
        raise AssertionError("tensor data was read before the checks failed")

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    with pytest.raises(ValueError, match=message) as err:
        load_hf(folder)
    assert str(folder / "config.json") in str(err.value)


def test_missing_expert_and_shapes_are_named(tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    shutil.copytree(tiny[0], folder)
    path = folder / "model.safetensors"
    sd = load_file(str(path))
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    sd[name] = sd[name][:8]
    save_file(sd, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"'{name}' has shape \[8, 32\], but a slice of tidal's"):
        load_hf(folder)
    del sd[name]
    save_file(sd, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"checkpoint has no tensor '{name}'"):
        load_hf(folder)


def test_save_refuses_what_qwen3_moe_cannot_express(tmp_path):
    args = get_flavor("debug_moe", vocab_size=64, n_layers=1)
    for moe, message in [
        (dataclasses.replace(args.moe, load_balance="bias"), "no expert bias"),
        (dataclasses.replace(args.moe, n_shared_experts=1), "no shared experts"),
    ]:
        model = Transformer(dataclasses.replace(args, moe=moe))
        model.init_weights()
        with pytest.raises(ValueError, match=message):
            save_hf_state_dict(model.state_dict(), model.args, tmp_path)
    assert not list(tmp_path.iterdir())
