"""The checkpoint writer process (tidal/train/checkpoint/writer_process.py): DCP's own format,
a clear error when it dies or stalls, and no writer left behind by a trainer that dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tidal.train.checkpoint.dcp_io import save_flat
from tidal.train.checkpoint.staging import PinnedStaging
from tidal.train.checkpoint.writer_process import (
    ProcessFileSystemWriter,
    WriterProcess,
    available,
)

pytestmark = pytest.mark.skipif(not available(), reason="the writer process needs memfd")


def _flat() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 33, generator=g),
        "ids": torch.arange(17),
        "half": torch.randn(9, generator=g).half(),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "rng": torch.get_rng_state(),
        "train_state": '{"step": 7}',
    }


def _staged(flat: dict) -> tuple[PinnedStaging, dict]:
    staging = PinnedStaging(torch.device("cpu"), shared=True)
    staged = staging.stage(flat)
    staging.run_host_copy()
    return staging, staged


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # exited, not yet reaped by whoever adopted it


def test_writes_dcp_files_byte_for_byte_and_plain_dcp_load_reads_them(tmp_path):
    flat = _flat()
    staging, staged = _staged(flat)
    writer = WriterProcess()
    assert staging.segment is not None
    writer.start(staging.segment)
    try:
        new = tmp_path / "process"
        save_flat(dict(staged), new, None, ProcessFileSystemWriter(new, writer, staging.segment))
        old = tmp_path / "thread"
        save_flat(dict(flat), old, None)
    finally:
        writer.close()
        staging.close()
    data = sorted(p.name for p in old.iterdir() if p.suffix == ".distcp")
    assert data == sorted(p.name for p in new.iterdir() if p.suffix == ".distcp")
    for name in data:  # .metadata differs only in DCP's random save id
        assert (new / name).read_bytes() == (old / name).read_bytes(), name
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else "" for k, v in flat.items()}
    dcp.load(out, checkpoint_id=str(new), no_dist=True)
    for k, v in flat.items():
        assert torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v, k


def test_a_dead_writer_is_a_clear_error_and_the_next_start_replaces_it(tmp_path):
    staging, staged = _staged(_flat())
    writer = WriterProcess()
    assert staging.segment is not None
    writer.start(staging.segment)
    try:
        pid = writer.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert writer.proc is not None
        writer.proc.wait(timeout=30)
        partial = tmp_path / "step-1.partial"
        sw = ProcessFileSystemWriter(partial, writer, staging.segment)
        with pytest.raises(
            Exception, match=r"writer process \(pid \d+\) died \(killed by signal 9\)"
        ):
            save_flat(dict(staged), partial, None, sw)
        assert not (partial / ".metadata").exists()  # incomplete: never loaded
        writer.start(staging.segment)  # a new child
        assert writer.pid != pid
        save_flat(
            dict(staged), partial, None, ProcessFileSystemWriter(partial, writer, staging.segment)
        )
        assert (partial / ".metadata").is_file()
    finally:
        writer.close()
        staging.close()


def test_a_stalled_writer_times_out_and_is_killed(tmp_path):
    staging, staged = _staged(_flat())
    writer = WriterProcess(item_timeout_s=1.0)
    assert staging.segment is not None
    writer.start(staging.segment)
    pid = writer.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        partial = tmp_path / "step-1.partial"
        sw = ProcessFileSystemWriter(partial, writer, staging.segment)
        with pytest.raises(Exception, match="reported no progress for 1s"):
            save_flat(dict(staged), partial, None, sw)
        assert _gone(pid)
    finally:
        writer.close()
        staging.close()


TRAINER = textwrap.dedent(
    """
    import sys, time, torch
    from tidal.train.checkpoint.staging import PinnedStaging
    from tidal.train.checkpoint.writer_process import WriterProcess
    staging = PinnedStaging(torch.device("cpu"), shared=True)
    staging.stage({"w": torch.ones(1000)})
    writer = WriterProcess()
    writer.start(staging.segment)
    print(writer.pid, flush=True)
    time.sleep(600)
    """
)


def test_the_writer_exits_when_its_trainer_is_killed():
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE, env=env)
    try:
        assert trainer.stdout is not None
        child = int(trainer.stdout.readline())
        assert not _gone(child)
        trainer.kill()
        trainer.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child), f"writer {child} outlived its trainer"
    finally:
        trainer.kill()
        trainer.wait()


def test_a_pinned_checkpointer_saves_through_the_writer_and_survives_its_death(tmp_path):
    from tests.train.test_checkpoint_crash import ARGS
    from tidal.models import Transformer
    from tidal.train.checkpoint import Checkpointer, layout, model_info
    from tidal.train.config import CheckpointConfig

    model = Transformer(ARGS)
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    folder = tmp_path / "checkpoint"
    ckpt = Checkpointer(
        CheckpointConfig(enable=True, async_mode="async_with_pinned_mem"),
        folder=folder,
        modules=[model],
        optimizer=opt,
        loader=None,
        device=torch.device("cpu"),
        args=ARGS,
        info={"model": model_info(ARGS, "tiny"), "parallelism": {"world_size": 1}},
        lr_settings={},
        log=lambda *a: None,
    )
    try:
        ckpt.save(1)
        ckpt.wait()
        assert ckpt.writer is not None and ckpt.writer.pid is not None
        first = ckpt.writer.pid
        os.kill(first, signal.SIGKILL)
        assert ckpt.writer.proc is not None
        ckpt.writer.proc.wait(timeout=30)  # dead before the next save looks
        with torch.no_grad():
            model.output.weight.fill_(3.0)
        ckpt.save(2)  # a new writer process
        ckpt.wait()
        assert ckpt.writer.pid != first
    finally:
        ckpt.close()
    assert ckpt.writer.proc is None  # close() stopped it
    path = folder / "step-2"
    layout.verify(path)
    out = {"output.weight": torch.zeros_like(model.output.weight)}
    dcp.load(out, checkpoint_id=str(path), no_dist=True)  # plain DCP reads it
    assert torch.equal(out["output.weight"], torch.full_like(out["output.weight"], 3.0))
