"""Training a mixture-of-experts model on CPU: the loss goes down, the routing metrics are
logged, the router's auxiliary loss enters the gradient with its coefficient, the
aux-loss-free expert bias is updated after each step toward balance and resumes exactly from
a checkpoint, and a Hugging Face Qwen 3 MoE folder converts to DCP and back and starts a run."""

from __future__ import annotations

import json

import pytest
import torch

from tests.train.test_checkpoint import VOCAB, random_data, step_records, train
from tests.train.test_hf_checkpoint import assert_bytes_equal, tensors
from tidal.models import Transformer, get_flavor, save_hf
from tidal.models.moe import moe_layers
from tidal.train.checkpoint.hf import dcp_to_hf, hf_to_dcp, read_model
from tidal.train.config_parse import apply_overrides
from tidal.train.configs import get_config

from .test_trainer import tiny_trainer


def moe_trainer(tmp_path, *extra):
    return tiny_trainer(tmp_path, "--model.flavor", "debug_moe", *extra)


def test_moe_training_lowers_loss_and_logs_routing(tmp_path):
    trainer = moe_trainer(tmp_path, "--training.steps", "12", "--metrics.log_every", "4")
    first = trainer.train_step(*trainer.next_batches()[:2])
    assert {"moe_aux_loss", "moe_load_max", "moe_load_min", "moe_dropped_tokens"} <= set(
        first.metrics
    )
    assert 0.9 < float(first.metrics["moe_aux_loss"]) < 8
    assert float(first.metrics["moe_load_max"]) >= 1 >= float(first.metrics["moe_load_min"])
    counts = trainer.path.moe_counts
    assert counts is not None and counts.shape == (4, 8)
    assert counts.sum(1).tolist() == [4 * 32 * 2] * 4  # every token at its 2 experts
    last = trainer.train()
    assert last["loss"] < float(first.loss) - 1.0
    records = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert all("moe_load_max" in r and "moe_aux_loss" in r for r in records)


def test_aux_loss_coefficient_enters_the_gradient(tmp_path):
    updates = {}
    for coef in ("0", "1"):
        trainer = moe_trainer(tmp_path / coef, "--training.moe_aux_loss_coef", coef)
        router = trainer.model.layers["0"].feed_forward.router.weight
        before = router.detach().clone()
        result = trainer.train_step(*trainer.next_batches()[:2])
        updates[coef] = (router.detach() - before, float(result.loss))
    # The reported loss is the cross entropy alone; the router's step differs.
    assert updates["0"][1] == updates["1"][1]
    assert not torch.allclose(updates["0"][0], updates["1"][0])


def test_aux_loss_free_bias_follows_the_load(tmp_path):
    trainer = moe_trainer(tmp_path, "--model.moe_load_balance", "bias")
    assert trainer.args.moe.load_balance == "bias"
    assert trainer.path.moe_aux_coef == 0.0  # aux_loss is reported, not trained on
    layers = moe_layers(trainer.model)
    assert all(float(m.expert_bias.abs().sum()) == 0 for m in layers)
    trainer.train_step(*trainer.next_batches()[:2])
    counts = trainer.path.moe_counts.float()
    for m, c in zip(layers, counts, strict=True):  # over-loaded experts down, under-loaded up
        want = 1e-3 * torch.sign(c.mean() - c)
        torch.testing.assert_close(m.expert_bias, want)
    # The bias is model state: saved with the weights.
    assert "layers.0.feed_forward.expert_bias" in trainer.model.state_dict()


def test_moe_options_are_refused_where_they_mean_nothing(tmp_path):
    with pytest.raises(ValueError, match="model.moe_load_balance=bias needs a mixture-of-experts"):
        tiny_trainer(tmp_path / "a", "--model.moe_load_balance", "bias")
    with pytest.raises(ValueError, match="moe_load_balance: cannot read 'sinkhorn'"):
        apply_overrides(get_config("debug"), ["--model.moe_load_balance", "sinkhorn"])
    with pytest.raises(ValueError, match="training.moe_aux_loss_coef must be >= 0"):
        apply_overrides(get_config("debug"), ["--training.moe_aux_loss_coef", "-1"])


MOE_BIAS = ("--model.flavor", "debug_moe", "--model.moe_load_balance", "bias")


def test_a_moe_run_resumes_exactly_with_its_expert_bias(tmp_path):
    """The expert bias is saved with the model: a run stopped at step 4 and resumed gives the
    straight run's losses and bias, bit for bit (8 steps, saving every 4: the bias moves at
    every step, so 4 resumed steps show any difference)."""
    moe_bias = (*MOE_BIAS, "--checkpoint.interval", "4")

    def bias(out):
        sd = read_model(out / "checkpoint" / "step-8", log=lambda _: None)[1]
        return sd["layers.2.feed_forward.expert_bias"]

    train(tmp_path / "straight", *moe_bias, steps=8)
    train(tmp_path / "run", *moe_bias, steps=8, stop_at=4)
    train(tmp_path / "run", *moe_bias, steps=8)
    ref, got = step_records(tmp_path / "straight"), step_records(tmp_path / "run")
    assert [got[s] for s in range(5, 9)] == [ref[s] for s in range(5, 9)]
    assert bias(tmp_path / "run").abs().sum() > 0
    assert torch.equal(bias(tmp_path / "run"), bias(tmp_path / "straight"))


def test_a_hugging_face_moe_converts_and_trains(tmp_path):
    """A Qwen 3 MoE folder: HF -> DCP -> HF byte-identical (stacked experts through the
    per-expert tensors), and a run starts from its weights."""
    model = Transformer(get_flavor("debug_moe", vocab_size=VOCAB, n_layers=2))
    model.init_weights(seed=4)
    save_hf(model, tmp_path / "hf")
    dcp = hf_to_dcp(tmp_path / "hf", tmp_path / "dcp", log=lambda _: None)
    dcp_to_hf(dcp, tmp_path / "back", log=lambda _: None)
    assert_bytes_equal(tensors(tmp_path / "hf"), tensors(tmp_path / "back"))
    train(tmp_path / "run", "--checkpoint.initial_load_hf", str(tmp_path / "hf"), steps=3)
    first = step_records(tmp_path / "run")[1][0]
    batch = next(iter(random_data().train))
    with torch.no_grad():
        logits = model(batch.input_ids)
        want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten())
    assert first == pytest.approx(want.item(), abs=1e-5)
