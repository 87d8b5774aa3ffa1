"""The training loop end to end on CPU: loss goes down, metrics are written, bad input fails
early, accumulation and determinism hold."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tidal.train.config_parse import apply_overrides
from tidal.train.configs import get_config
from tidal.train.data import Batch, DataBundle, PackedLoader
from tidal.train.trainer import Trainer


def small_config(tmp_path, text_corpus, cache_dir, *extra):
    return apply_overrides(
        get_config("debug"),
        [
            "--job.output_dir",
            str(tmp_path / "out"),
            "--data.dataset",
            "jsonl",
            "--data.path",
            str(text_corpus),
            "--data.cache_dir",
            str(cache_dir),
            "--data.vocab_size",
            "512",
            "--model.vocab_size",
            "512",
            "--training.steps",
            "30",
            "--training.batch_size",
            "4",
            "--training.seq_len",
            "64",
            "--lr_scheduler.warmup_steps",
            "5",
            "--optimizer.lr",
            "3e-3",
            "--metrics.log_every",
            "5",
            "--metrics.val_every",
            "15",
            "--metrics.val_batches",
            "2",
            "--sample.max_new_tokens",
            "12",
            *extra,
        ],
    )


def test_training_lowers_loss_and_writes_metrics(tmp_path, text_corpus, cache_dir, capsys):
    from tidal.cli import end_of_run_sample  # what `tidal train` runs after the loop

    cfg = small_config(tmp_path, text_corpus, cache_dir)
    trainer = Trainer(cfg)
    last = trainer.train()
    end_of_run_sample(trainer, last)
    records = [json.loads(x) for x in open(tmp_path / "out" / "metrics.jsonl")]
    steps = [r for r in records if "loss" in r]
    vals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in steps] == [5, 10, 15, 20, 25, 30]
    for key in (
        "step",
        "loss",
        "tokens_per_s",
        "mfu",
        "peak_memory_gib",
        "grad_norm",
        "lr",
        "tflops",
        "data_wait_s",
    ):
        assert key in steps[-1], key
    assert steps[-1]["mfu"] is None  # no peak FLOP/s for a CPU
    assert steps[-1]["tokens_per_s"] > 0 and steps[-1]["peak_memory_gib"] > 0
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    assert [r["step"] for r in vals] == [15, 30] and vals[1]["val_loss"] < vals[0]["val_loss"]
    assert last["step"] == 30
    out = capsys.readouterr().out
    assert "step     30/30 loss" in out and "sample:" in out
    assert (tmp_path / "out" / "sample.txt").read_text().startswith("ROMEO:")


def fixed_batch_data(vocab=64, batch=4, seq=32, seed=0):
    """A loader whose every batch holds the same `batch` windows."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(2, vocab, batch * seq + 1)
    loader = PackedLoader(
        tokens, np.array([0]), seq_len=seq, batch_size=batch, seed=0, shuffle=False
    )
    tok = SimpleNamespace(vocab_size=vocab, bos_id=0, eos_id=1)
    return DataBundle(tokenizer=tok, train=loader, val=None)


def tiny_trainer(tmp_path, *extra):
    cfg = apply_overrides(
        get_config("debug"),
        [
            "--job.output_dir",
            str(tmp_path),
            "--model.vocab_size",
            "64",
            "--training.batch_size",
            "4",
            "--training.seq_len",
            "32",
            "--training.steps",
            "60",
            "--optimizer.lr",
            "3e-3",
            "--optimizer.weight_decay",
            "0",
            "--lr_scheduler.warmup_steps",
            "0",
            "--lr_scheduler.decay_fraction",
            "0",
            "--metrics.log_every",
            "60",
            "--metrics.val_every",
            "0",
            "--sample.max_new_tokens",
            "0",
            *extra,
        ],
    )
    return Trainer(cfg, data=fixed_batch_data(), log=lambda *a: None)


def test_overfits_a_fixed_batch(tmp_path):
    trainer = tiny_trainer(tmp_path)
    first = float(trainer.train_step(*trainer.next_batches()[:2]).loss)
    last = trainer.train()
    assert first > 3.5  # about ln(64) at init
    assert last["loss"] < 0.1 * first


def test_same_seed_gives_bitwise_identical_runs(tmp_path):
    losses = []
    for run in range(2):
        t = tiny_trainer(
            tmp_path / str(run), "--training.steps", "5", "--training.deterministic", "true"
        )
        losses.append([float(t.train_step(*t.next_batches()[:2]).loss) for _ in range(5)])
    assert losses[0] == losses[1]


def test_grad_accumulation_matches_one_big_batch(tmp_path):
    big = tiny_trainer(tmp_path / "a")
    acc = tiny_trainer(
        tmp_path / "b", "--training.batch_size", "2", "--training.grad_accum_steps", "2"
    )
    acc.model.load_state_dict(big.model.state_dict())
    batch = big.next_batches()[0][0]
    halves = [
        Batch(
            input_ids=batch.input_ids[i : i + 2],
            labels=batch.labels[i : i + 2],
            document_ids=batch.document_ids[i : i + 2],
        )
        for i in (0, 2)
    ]
    r_big, r_acc = big.train_step([batch], 128), acc.train_step(halves, 128)
    torch.testing.assert_close(r_acc.loss, r_big.loss)
    torch.testing.assert_close(r_acc.grad_norm, r_big.grad_norm)
    # One AdamW step (lr 3e-3) later the weights agree to a few percent of an update: Adam's
    # m / sqrt(v) amplifies fp32 summation-order noise on near-zero gradients.
    for p, q in zip(big.model.parameters(), acc.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=0)


def test_batches_are_pinned_only_for_cuda(tmp_path, monkeypatch):
    trainer = tiny_trainer(tmp_path)
    expected = next(iter(fixed_batch_data().train))
    calls = []

    def pin_memory(self):
        calls.append("pin")
        return self

    monkeypatch.setattr(Batch, "pin_memory", pin_memory)
    # CPU: the loader's tensors, unpinned and uncopied.
    (batch,), n_tokens, _ = trainer.next_batches()
    assert calls == [] and n_tokens == expected.labels.numel()
    assert torch.equal(batch.input_ids, expected.input_ids) and not batch.input_ids.is_pinned()
    # CUDA (faked: no GPU needed): pinned first, then copied without blocking the host.
    real_to = Batch.to

    def to(self, device, non_blocking=False):
        calls.append((torch.device(device).type, non_blocking))
        return real_to(self, "cpu")

    monkeypatch.setattr(Batch, "to", to)
    trainer.device = torch.device("cuda", 0)
    trainer.next_batches()
    assert calls == ["pin", ("cuda", True)]


def test_ctrl_c_stops_after_the_current_step(tmp_path):
    import os
    import signal

    trainer = tiny_trainer(tmp_path, "--metrics.log_every", "2")
    real_step = trainer.train_step
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when pytest runs in the background

    def step(batches, n_tokens):
        if trainer.step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of step 3
        return real_step(batches, n_tokens)

    trainer.train_step = step
    last = trainer.train()
    assert last["interrupted"] and last["step"] == 3  # finished and logged off the interval
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [2, 3]
    assert signal.getsignal(signal.SIGINT) is before  # the trainer's handler removed


def test_tokenizer_larger_than_embedding_fails_before_training(tmp_path, text_corpus, cache_dir):
    cfg = small_config(tmp_path, text_corpus, cache_dir, "--model.vocab_size", "300")
    with pytest.raises(
        ValueError,
        match="data.vocab_size=512 .* does not fit the 300-token embedding of model.flavor 'debug'",
    ):
        Trainer(cfg)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_missing_data_file_is_a_clear_error(tmp_path, cache_dir):
    cfg = apply_overrides(
        get_config("debug"),
        [
            "--data.dataset",
            "jsonl",
            "--data.path",
            str(tmp_path / "nope.jsonl"),
            "--data.cache_dir",
            str(cache_dir),
        ],
    )
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        Trainer(cfg)


def test_sample_is_reproducible(tmp_path):
    # The end-of-run sample goes through tidal.generate.Generator (tests/generate cover it).
    from tidal.generate import Generator, GeneratorConfig, SamplingParams

    model = tiny_trainer(tmp_path).model.eval()
    gen = Generator(model, config=GeneratorConfig(max_batch=1, max_seq_len=32))
    sampled = SamplingParams(temperature=0.8, top_k=50, max_new_tokens=10, seed=1)
    a, b = (gen.generate([[5, 6, 7]], sampled)[0][0].completion_ids for _ in range(2))
    greedy = gen.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=10))
    assert a == b and len(a) == 10 and len(greedy[0][0].completion_ids) == 10


def test_tensorboard_events_are_written(tmp_path):
    pytest.importorskip("tensorboard")
    trainer = tiny_trainer(
        tmp_path,
        "--metrics.tensorboard",
        "true",
        "--training.steps",
        "2",
        "--metrics.log_every",
        "1",
    )
    trainer.train()
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


@pytest.mark.slow
def test_compiled_blocks_match_eager(tmp_path):
    # Cold inductor compiles take 15-30 s on CPU: slow-marked (pytest -m slow).
    eager = tiny_trainer(tmp_path / "eager", "--training.steps", "3")
    compiled = tiny_trainer(
        tmp_path / "compiled", "--training.steps", "3", "--training.compile", "true"
    )
    for _ in range(3):
        a = eager.train_step(*eager.next_batches()[:2])
        b = compiled.train_step(*compiled.next_batches()[:2])
        torch.testing.assert_close(b.loss, a.loss, atol=1e-4, rtol=1e-4)
