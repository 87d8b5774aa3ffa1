"""Checkpoints in one process: exact resume, async saves, the folder layout, clear errors.

Runs train the `tiny` flavor in fp32 on random tokens (about 20 ms a step); the parallel
resume and resharding tests are in tests/parallel/test_checkpoint_parallel.py, the SIGKILL
test in test_checkpoint_crash.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tidal.train.checkpoint import CheckpointError, checksum, load_model, read_metadata
from tidal.train.config_parse import apply_overrides
from tidal.train.configs import get_config
from tidal.train.data import DataBundle, PackedLoader
from tidal.train.run_folder import RunFolderError
from tidal.train.trainer import Trainer

VOCAB = 64


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """A tiny model gains nothing from intra-op threads; on a shared 2-core machine they
    make every step several times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def run_config(out: Path, *extra: str, steps: int = 20):
    return apply_overrides(
        get_config("debug"),
        [
            "--job.output_dir",
            str(out),
            "--job.device",
            "cpu",
            "--model.flavor",
            "tiny",
            "--model.vocab_size",
            str(VOCAB),
            "--training.steps",
            str(steps),
            "--training.batch_size",
            "4",
            "--training.seq_len",
            "32",
            "--training.deterministic",
            "true",
            "--training.mixed_precision",
            "fp32",
            "--lr_scheduler.warmup_steps",
            "3",
            "--lr_scheduler.decay_fraction",
            "0.3",
            "--optimizer.lr",
            "3e-3",
            "--metrics.log_every",
            "1",
            "--metrics.val_every",
            "0",
            "--sample.max_new_tokens",
            "0",
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "10",
            *extra,
        ],
    )


def random_data(dp_rank: int = 0, dp_world: int = 1, batch: int = 4) -> DataBundle:
    """Random tokens, cut the same way for every layout: the union of the data-parallel
    ranks' batches is the one-process batch of `batch * dp_world` rows."""
    tokens = np.random.default_rng(0).integers(2, VOCAB, 16 * 33 * 12)
    loader = PackedLoader(
        tokens,
        np.array([0]),
        seq_len=32,
        batch_size=batch,
        seed=0,
        dp_rank=dp_rank,
        dp_world=dp_world,
    )
    tok = SimpleNamespace(vocab_size=VOCAB, bos_id=0, eos_id=1)
    return DataBundle(tokenizer=tok, train=loader, val=None)


def interrupt_after(trainer: Trainer, step: int) -> None:
    """Send this process SIGINT (Ctrl-C) during step `step`."""
    real = trainer.train_step

    def train_step(batches, n_tokens):
        if trainer.step == step:
            os.kill(os.getpid(), signal.SIGINT)
        return real(batches, n_tokens)

    trainer.train_step = train_step  # type: ignore[method-assign]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def step_records(out: Path) -> dict[int, tuple[float, float, float]]:
    """(loss, grad norm, lr) by step; records after a resume event replace earlier ones."""
    return {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in records(out) if "loss" in r}


def train(out: Path, *extra: str, steps: int = 20, stop_at: int | None = None) -> dict:
    trainer = Trainer(run_config(out, *extra, steps=steps), data=random_data(), log=lambda *a: None)
    if stop_at is not None:
        interrupt_after(trainer, stop_at)
    try:
        return trainer.train()
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """20 steps in one go, saving at steps 10 and 20."""
    out = tmp_path_factory.mktemp("straight")
    train(out)
    return out


def test_resume_is_bitwise_exact(straight, tmp_path):
    out = tmp_path / "run"
    last = train(out, stop_at=10)  # Ctrl-C during step 10: stops after it, saves step-10
    assert last["interrupted"] and last["step"] == 10
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["step-10"]
    train(out)  # the same command again resumes
    ref, got = step_records(straight), step_records(out)
    assert [got[s] for s in range(11, 21)] == [ref[s] for s in range(11, 21)]
    events = [r for r in records(out) if "event" in r]
    assert events == [{"event": "resume", "step": 10}]
    assert [r["step"] for r in records(out)] == [*range(1, 11), 10, *range(11, 21)]


def rng_states_across_a_resume(out: Path, *extra: str) -> tuple[dict, dict]:
    """Train with Ctrl-C during step 10, drawing random numbers every step (so the RNG
    states move); return the states at the save and right after the resumed Trainer's load."""
    import random

    def states():
        out = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and "cuda" in extra:
            out["cuda"] = torch.cuda.get_rng_state()
        return out

    trainer = Trainer(run_config(out, *extra), data=random_data(), log=lambda *a: None)
    real_step, real_save = trainer.train_step, trainer.checkpoint.save
    saved: dict = {}

    def train_step(batches, n_tokens):
        random.random(), torch.rand(3)
        if "cuda" in extra:
            torch.rand(3, device="cuda")
        if trainer.step == 10:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(batches, n_tokens)

    def save(step, **kw):
        saved.update(states())
        return real_save(step, **kw)

    trainer.train_step, trainer.checkpoint.save = train_step, save  # type: ignore[method-assign]
    trainer.train()
    trainer.close()
    random.seed(123), torch.manual_seed(123)  # scrambled; seed_everything reseeds anyway
    resumed = Trainer(run_config(out, *extra), data=random_data(), log=lambda *a: None)
    restored = states()
    resumed.train()
    resumed.close()
    return saved, restored


def test_rng_states_are_restored(tmp_path):
    saved, restored = rng_states_across_a_resume(tmp_path / "run")
    assert saved["python"] == restored["python"]
    assert torch.equal(saved["torch"], restored["torch"])
    import random

    random.seed(0)
    assert random.getstate() != saved["python"]  # the states had moved past the seed's


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_saves_change_neither_losses_nor_contents(mode, straight, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / mode
    train(
        out,
        "--checkpoint.async_mode",
        mode,
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
    )
    assert step_records(out) == step_records(straight)
    saved = sorted(int(p.name[5:]) for p in (out / "checkpoint").iterdir())
    assert saved == list(range(2, 21, 2))
    # The background save of step 10 holds exactly what the synchronous one does, though the
    # training thread went on stepping while it was written.
    dcp_to_torch_save(out / "checkpoint/step-10", tmp_path / "a.pt")
    dcp_to_torch_save(straight / "checkpoint/step-10", tmp_path / "b.pt")
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.state.") for k in a)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        elif not k.startswith("rng."):
            assert a[k] == b[k], k
    # The marker's checksums (in the pinned mode made by the writer process as it wrote) are
    # those of the bytes on disk; no side file is left.
    step10 = out / "checkpoint/step-10"
    assert not list(step10.glob("*.crc32"))
    marker = json.loads((step10 / "COMPLETE").read_text())
    assert marker["crc32"] == checksum.compute(step10)


def test_a_save_that_must_wait_for_the_previous_write_says_so(tmp_path, monkeypatch):
    from tidal.train.checkpoint import manager

    logs: list[str] = []
    trainer = Trainer(
        run_config(tmp_path / "run", "--checkpoint.async_mode", "async"),
        data=random_data(),
        log=logs.append,
    )
    ckpt = trainer.checkpoint
    gate = threading.Event()  # holds the background write of step 10 until the next save
    real_save_flat, real_wait = manager.save_flat, ckpt.wait

    def held_save_flat(*args, **kwargs):
        assert gate.wait(timeout=120)
        real_save_flat(*args, **kwargs)

    def wait():
        gate.set()
        real_wait()

    monkeypatch.setattr(manager, "save_flat", held_save_flat)
    monkeypatch.setattr(ckpt, "wait", wait)
    try:
        ckpt.save(10)
        assert ckpt.pending is not None and not ckpt.pending.done()
        ckpt.save(20)  # step 10's write is still going: this save waits for it
        assert ckpt.stats.step == 20 and 0 < ckpt.stats.waited_s <= ckpt.stats.blocked_s
        waited = [line for line in logs if "to finish writing" in line]
        assert len(waited) == 1 and "the save of step 20 waited" in waited[0]
        assert "the save of step 10 to finish writing" in waited[0]
        assert "checkpoint.interval" in waited[0]  # a periodic save: the interval is short
        real_wait()
        assert ckpt.stats.step == 20 and ckpt.stats.total_s > 0 and ckpt.stats.bytes > 0
        ckpt.save(30)  # nothing in flight: no wait, no line
        real_wait()
        assert len([line for line in logs if "to finish writing" in line]) == 1
        assert ckpt.stats.step == 30 and ckpt.stats.waited_s < ckpt.stats.total_s
    finally:
        gate.set()
        trainer.close()


@pytest.mark.parametrize("mode", ["disabled", "async_with_pinned_mem"])
def test_checksums_can_be_turned_off(tmp_path, mode):
    out = tmp_path / "run"
    train(
        out,
        "--checkpoint.checksums",
        "false",
        "--checkpoint.async_mode",
        mode,
        "--checkpoint.interval",
        "1",
        steps=3,
    )
    step2 = out / "checkpoint" / "step-2"  # saved in `mode` (the last save is synchronous)
    marker = json.loads((step2 / "COMPLETE").read_text())
    assert "crc32" not in marker and set(marker["files"]) == {
        p.name for p in step2.iterdir() if p.name != "COMPLETE"
    }


def test_folder_layout_marker_and_info(straight):
    step10 = straight / "checkpoint" / "step-10"
    marker = json.loads((step10 / "COMPLETE").read_text())
    assert marker["step"] == 10
    assert set(marker["files"]) == {".metadata", "__0_0.distcp", "tidal.json"}
    for name, size in marker["files"].items():
        assert (step10 / name).stat().st_size == size
    # A checksum per saved chunk (each small here: one piece each).
    assert marker["crc32"]["piece_bytes"] == 64 << 20
    chunks = marker["crc32"]["files"]["__0_0.distcp"]
    assert len(chunks) == len(read_metadata(step10).storage_data)
    assert all(len(crcs) == 1 for crcs in chunks.values())
    info = json.loads((step10 / "tidal.json").read_text())
    assert info["step"] == 10 and info["dtype"] == "float32"
    assert info["contents"] == [
        "model",
        "optimizer",
        "lr_scheduler",
        "dataloader",
        "train_state",
        "rng",
    ]
    assert info["model"]["flavor"] == "tiny" and info["model"]["args"]["vocab_size"] == VOCAB
    assert info["parallelism"] == {
        "world_size": 1,
        "degrees": {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1},
    }
    keys = read_metadata(step10).state_dict_metadata
    # Model keys at the top level (as torchtitan), the other states under their names.
    assert "layers.0.attention.wq.weight" in keys
    assert "optimizer.state.layers.0.attention.wq.weight.exp_avg" in keys
    assert {"lr_scheduler", "dataloader", "train_state", "rng.rank0.torch"} <= set(keys)
    assert json.loads((straight / ".lock").read_text())["pid"] > 0


def test_keep_latest_k_and_the_last_save_model_only_in_bf16(tmp_path):
    out = tmp_path / "run"
    train(
        out,
        "--checkpoint.interval",
        "3",
        "--checkpoint.keep_latest_k",
        "2",
        "--checkpoint.last_save_model_only",
        "true",
        "--checkpoint.export_dtype",
        "bfloat16",
        steps=10,
    )
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["step-10", "step-9"]
    last = out / "checkpoint" / "step-10"
    info = json.loads((last / "tidal.json").read_text())
    assert info["contents"] == ["model"] and info["dtype"] == "bfloat16"
    md = read_metadata(last).state_dict_metadata
    assert all(not k.startswith(("optimizer", "dataloader")) for k in md)
    assert md["output.weight"].properties.dtype == torch.bfloat16
    # It loads into any fp32 model state dict (here a fresh one), as bf16-rounded weights.
    fresh = Trainer(
        run_config(tmp_path / "other", "--checkpoint.enable", "false"),
        data=random_data(),
        log=lambda *a: None,
    )
    sd = fresh.model.state_dict()
    load_model(sd, last)
    trained = Trainer(
        run_config(tmp_path / "x", "--checkpoint.initial_load_path", str(last)),
        data=random_data(),
        log=lambda *a: None,
    )
    w = trained.model.output.weight
    assert trained.step == 0 and torch.equal(w, w.bfloat16().float())
    assert torch.equal(sd["output.weight"], w)


def test_exclude_from_loading_restarts_data_and_schedule(straight, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight / "checkpoint" / "step-10", out / "checkpoint" / "step-10")
    logs: list[str] = []
    cfg = run_config(
        out,
        "--checkpoint.exclude_from_loading",
        "dataloader,lr_scheduler",
        "--optimizer.weight_decay",
        "0.05",
    )
    trainer = Trainer(cfg, data=random_data(), log=logs.append)
    assert trainer.step == 10
    assert trainer.data.train.state_dict()["batch"] == 0  # the data restarts
    assert any("weight_decay 0.1 -> 0.05" in line for line in logs)  # the config wins
    assert trainer.optimizer.param_groups[0]["weight_decay"] == 0.05
    trainer.train()
    trainer.close()
    logs.clear()
    cfg = run_config(
        out, "--checkpoint.exclude_from_loading", "train_state", "--checkpoint.load_step", "10"
    )
    without_step = Trainer(cfg, data=random_data(), log=logs.append)
    assert without_step.step == 0 and without_step.data.train.state_dict()["batch"] == 10
    assert any(
        "warning: step-20 in" in line and "come from before this resume" in line for line in logs
    )
    without_step.close()
    lrs = {s: r[2] for s, r in step_records(out).items()}
    # A fresh warmup over the remaining 10 steps (3 warmup steps, then decay over the last 3).
    assert lrs[11] == pytest.approx(1e-3) and lrs[13] == pytest.approx(3e-3)
    assert lrs[20] == pytest.approx(0.0)


def test_seed_checkpoint_then_training_starts_from_it(tmp_path):
    out = tmp_path / "run"
    assert train(out, "--checkpoint.create_seed_checkpoint", "true", "--training.seed", "7") == {}
    info = json.loads((out / "checkpoint" / "step-0" / "tidal.json").read_text())
    assert info["contents"] == ["model"] and info["step"] == 0
    seed7 = Trainer(
        run_config(tmp_path / "ref", "--checkpoint.enable", "false", "--training.seed", "7"),
        data=random_data(),
        log=lambda *a: None,
    )
    trainer = Trainer(run_config(out), data=random_data(), log=lambda *a: None)  # seed 0
    assert trainer.step == 0
    for (k, a), b in zip(
        trainer.model.state_dict().items(), seed7.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), k


def test_fine_tune_from_another_runs_checkpoint(straight, tmp_path):
    src = straight / "checkpoint"  # a folder of step-N checkpoints: its newest is taken
    logs: list[str] = []
    trainer = Trainer(
        run_config(tmp_path / "ft", "--checkpoint.initial_load_path", str(src)),
        data=random_data(),
        log=logs.append,
    )
    assert trainer.step == 0 and trainer.data.train.state_dict()["batch"] == 0
    assert any(f"starting from {src / 'step-20'} (model only), step 20" in x for x in logs)


def test_initial_load_of_everything_continues_the_other_run(straight, tmp_path):
    src = straight / "checkpoint" / "step-10"
    logs: list[str] = []
    trainer = Trainer(
        run_config(
            tmp_path / "ft",
            "--checkpoint.initial_load_path",
            str(src),
            "--checkpoint.initial_load_model_only",
            "false",
        ),
        data=random_data(),
        log=logs.append,
    )
    try:
        assert trainer.step == 10 and trainer.data.train.state_dict()["batch"] == 10
        assert trainer.optimizer.state  # AdamW's moments came along
        assert any(f"starting from {src}" in x for x in logs), logs
    finally:
        trainer.close()


def test_load_only_resumes_and_never_saves(straight, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight / "checkpoint", out / "checkpoint")
    trainer = Trainer(
        run_config(out, "--checkpoint.load_only", "true", steps=24),
        data=random_data(),
        log=lambda *a: None,
    )
    try:
        assert trainer.step == 20
        assert trainer.train()["step"] == 24
    finally:
        trainer.close()
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["step-10", "step-20"]


def test_a_dtype_change_loads_cast_and_says_so(straight, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight / "checkpoint" / "step-10", out / "checkpoint" / "step-10")
    logs: list[str] = []
    trainer = Trainer(
        run_config(out, "--optimizer.state_dtype", "bf16"), data=random_data(), log=logs.append
    )
    try:
        assert trainer.step == 10
        state = next(iter(trainer.optimizer.state.values()))
        assert state["exp_avg"].dtype == torch.bfloat16
    finally:
        trainer.close()
    assert any(
        re.search(
            r"checkpoint: \d+ tensor\(s\) saved in float32 load into bfloat16 "
            r"here, cast \(e\.g\. optimizer\.state\..*\.exp_avg",
            x,
        )
        for x in logs
    ), logs


# -- errors before training ------------------------------------------------------------------


def expect_error(out, *extra, match, data=None):
    with pytest.raises(CheckpointError, match=match):
        Trainer(run_config(out, *extra), data=data or random_data(), log=lambda *a: None)


def test_a_wrong_load_step_names_the_steps_there_are(straight, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight / "checkpoint", out / "checkpoint")
    (out / "checkpoint" / "step-15.partial").mkdir()
    expect_error(
        out,
        "--checkpoint.load_step",
        "15",
        match=r"no complete step-15; complete checkpoints: step-10, step-20; skipped "
        r"incomplete: step-15.partial",
    )
    expect_error(tmp_path / "empty", "--checkpoint.load_step", "5", match="does not exist")
    expect_error(
        tmp_path / "x",
        "--checkpoint.initial_load_path",
        str(tmp_path / "nope"),
        match=f"initial_load_path {tmp_path / 'nope'} does not exist",
    )


def test_the_newest_complete_checkpoint_is_chosen_and_incomplete_ones_named(straight, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight / "checkpoint" / "step-10", out / "checkpoint" / "step-10")
    shutil.copytree(straight / "checkpoint" / "step-20", out / "checkpoint" / "step-30")
    (out / "checkpoint" / "step-30" / "COMPLETE").unlink()  # renamed, marker not yet written
    logs: list[str] = []
    trainer = Trainer(run_config(out), data=random_data(), log=logs.append)
    assert trainer.step == 10
    assert any(
        "resuming from" in x and "step-10, step 10; skipped incomplete: step-30" in x for x in logs
    )


def corrupt_copy(straight: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(straight / "checkpoint" / "step-10", out / "checkpoint" / "step-10")
    return out


def corrupt_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_truncated_or_corrupt_files_are_named(straight, tmp_path):
    out = corrupt_copy(straight, tmp_path)
    data_file = out / "checkpoint" / "step-10" / "__0_0.distcp"
    size = data_file.stat().st_size
    with open(data_file, "r+b") as f:
        f.truncate(size // 2)
    expect_error(out, match=rf"{data_file}: {size // 2:,} bytes, the save wrote {size:,}")
    # The same size with one byte changed inside a tensor's data: torch.load would take it;
    # the marker's checksum names the file and the key.
    with open(data_file, "r+b") as f:
        f.truncate(size)
    restore = data_file.read_bytes()
    corrupt_byte(data_file, size // 2)
    expect_error(out, match=rf"{data_file} \(key .+\): bytes 0\.\..* fail their checksum")
    # Garbage where torch.load looks (the end of each record's zip), in a checkpoint whose
    # marker has no checksums (older, or written by hand): named by the reader instead.
    data_file.write_bytes(restore)
    marker = data_file.parent / "COMPLETE"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "crc32": {}}))
    with open(data_file, "r+b") as f:
        f.seek(size - 4096)
        f.write(b"\0" * 4096)
    expect_error(out, match=rf"{data_file}: unreadable .*corrupt")
    meta = out / "checkpoint" / "step-10" / ".metadata"
    meta.write_bytes(b"x" * meta.stat().st_size)
    expect_error(out, match=rf"{meta}: unreadable .*corrupt")


def test_another_flavor_fails_before_any_tensor_is_read(straight, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    def no_reads(*a, **k):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(dcp, "load", no_reads)
    out = corrupt_copy(straight, tmp_path)
    expect_error(
        out,
        "--model.vocab_size",
        "128",
        match=r"tok_embeddings.weight is \[64, 64\] in the checkpoint and \[128, 64\] "
        r"here; output.weight is \[64, 64\] in the checkpoint and \[128, 64\] "
        r"here.*vocab_size 64 in the checkpoint, 128 here \(--model.vocab_size\)",
        data=random_data(),
    )
    expect_error(
        out,
        "--model.flavor",
        "debug",
        "--model.vocab_size",
        "64",
        match=r"layers.0.attention.wq.weight is \[64, 64\] in the checkpoint and "
        r"\[256, 256\] here.*missing from the checkpoint: layers.4.*saved from "
        r"model.flavor 'tiny', this run builds 'debug'; dim 64 in the "
        r"checkpoint, 256 here",
    )


def test_a_model_only_checkpoint_cannot_be_resumed(tmp_path):
    out = tmp_path / "run"
    train(out, "--checkpoint.last_save_model_only", "true", "--checkpoint.interval", "100", steps=4)
    with pytest.raises(CheckpointError, match=r"holds only the model .*initial_load_path"):
        Trainer(run_config(out, steps=8), data=random_data(), log=lambda *a: None)
    # At or past training.steps there is nothing to resume: the run says so and returns.
    logs: list[str] = []
    trainer = Trainer(run_config(out, steps=4), data=random_data(), log=logs.append)
    assert trainer.train() == {} and "nothing to train" in logs[-1]


# -- the run folder --------------------------------------------------------------------------


def test_a_fresh_run_refuses_a_used_folder_and_two_runs_never_share_one(straight, tmp_path):
    with pytest.raises(
        RunFolderError,
        match=r"holds an earlier run \(metrics.jsonl has \d+ "
        r"records\); resume it with --checkpoint.enable",
    ):
        Trainer(run_config(straight, "--checkpoint.enable", "false"), data=random_data())
    out = tmp_path / "run"
    first = Trainer(run_config(out), data=random_data(), log=lambda *a: None)
    with pytest.raises(
        RunFolderError,
        match=rf"{out} is in use by another run \(pid "
        rf"{os.getpid()} on ",
    ):
        Trainer(run_config(out), data=random_data())
    first.close()
    Trainer(run_config(out), data=random_data(), log=lambda *a: None).close()  # free again


def test_names_do_not_depend_on_activation_checkpointing_or_compile_wrappers(tmp_path):
    src = tmp_path / "ac"
    train(src, "--activation_checkpoint.mode", "full", steps=2)
    keys = set(read_metadata(src / "checkpoint" / "step-2").state_dict_metadata)
    assert "layers.0.attention.wq.weight" in keys
    assert not any("_checkpoint_wrapped_module" in k for k in keys)
    plain = Trainer(
        run_config(tmp_path / "plain", "--checkpoint.initial_load_path", str(src / "checkpoint")),
        data=random_data(),
        log=lambda *a: None,
    )
    saved = Trainer(
        run_config(src, "--activation_checkpoint.mode", "full", steps=2),
        data=random_data(),
        log=lambda *a: None,
    )  # resumes its step-2
    for (k, a), b in zip(
        plain.model.state_dict().items(), saved.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), k
