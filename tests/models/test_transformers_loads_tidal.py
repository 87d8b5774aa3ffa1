"""transformers' `AutoModelForCausalLM.from_pretrained` loads what `save_hf` writes and computes
the same logits: models that came from Hugging Face (the tiny Llama 3.1 with RoPE scaling and
tied embeddings, the tiny Llama 2, the tiny Qwen 3 with QK-norm and head_dim != dim / heads,
untied and tied), in one file and
sharded, and a model tidal built itself (its config.json made from ModelArgs alone).

transformers is a test dependency (the dev extra); tidal never imports it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tidal.models import Transformer, get_flavor, load_hf, save_hf

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def auto_model(tmp_path_factory):
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only, never the hub
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM


def hf_logits(auto_model, folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = auto_model.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_llama2", "tiny_qwen3", "tiny_qwen3_tied"])
@pytest.mark.parametrize("shard", [None, 20_000])
def test_transformers_loads_a_round_tripped_hf_model(auto_model, tmp_path, name, shard):
    ref = load_file(str(DATA / name / "reference_logits.safetensors"))
    save_hf(load_hf(DATA / name), tmp_path, **({} if shard is None else {"max_shard_size": shard}))
    assert (len(list(tmp_path.glob("*.safetensors"))) > 1) == (shard is not None)
    got = hf_logits(auto_model, tmp_path, ref["tokens"])
    torch.testing.assert_close(got, ref["logits"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("flavor", ["tiny", "debug_qwen3"])
def test_transformers_loads_a_model_tidal_built(auto_model, tmp_path, flavor):
    torch.manual_seed(0)
    model = Transformer(get_flavor(flavor, vocab_size=96)).eval()
    model.init_weights(seed=1)
    save_hf(model, tmp_path)
    tokens = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(hf_logits(auto_model, tmp_path, tokens), ours, atol=1e-5, rtol=0)
