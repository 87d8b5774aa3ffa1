"""Checkpoints across ranks: exact resume under FSDP, and resharding a checkpoint saved by 2
FSDP ranks into tensor parallel, one process and a 2-stage pipeline (one and two stages a
rank).

The FSDP resume is the real thing: 2 ranks train, a Ctrl-C during step 10 stops them after it
(saving step-10), and the same command again resumes to step 20; that run reproduces the
straight 20-step run bitwise. Every run trains the `tiny` flavor in fp32 on CPU (gloo) on the
same global batch of 4 rows (data-parallel ranks take disjoint rows whose union is the
one-process batch; the loader's position carries over between layouts). The resharded
continuations sum the same products in other orders (other shards, other reductions): over
the ten steps after the load, losses and grad norms stayed within 5e-7 of the FSDP run's
(measured); 2e-5, as in test_parity.py, leaves a margin of ~40x.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.parallel._launch import run_ranks
from tests.train.test_checkpoint import (
    interrupt_after,
    random_data,
    records,
    run_config,
    step_records,
)

FSDP = ["--parallelism.dp_shard", "2"]
LAYOUTS = {
    # name: (overrides, per-rank batch)
    "fsdp2": (FSDP, 2),
    "tp2": (["--parallelism.tp", "2", "--parallelism.dp_shard", "1"], 4),
    "pp2_1f1b": (["--parallelism.pp", "2", "--parallelism.dp_shard", "1"], 4),
    "pp2_interleaved": (
        [
            "--parallelism.pp",
            "2",
            "--parallelism.dp_shard",
            "1",
            "--parallelism.pp_schedule",
            "Interleaved1F1B",
        ],
        4,
    ),
}
ATOL = 2e-5


Run = tuple[str, list[str], int, int | None]


def _train_runs(rank: int, world: int, runs: list[Run]) -> None:
    """Train each (output dir, overrides, per-rank batch, step to Ctrl-C during or None) in
    turn on these ranks."""
    from tidal.parallel.launch import DistInfo
    from tidal.train.trainer import Trainer

    for i, (out, extra, batch, stop_at) in enumerate(runs):
        trainer = Trainer(
            run_config(Path(out), *extra),
            data=lambda r, w, b=batch: random_data(r, w, b),
            dist_info=DistInfo.from_env(),
            log=lambda *a: None,
        )
        if stop_at is not None:
            interrupt_after(trainer, stop_at)  # on every rank, as a terminal's Ctrl-C
        last = trainer.train()
        assert last["step"] == stop_at or stop_at is None, last
        if i == len(runs) - 1:
            trainer.close()  # leaves the process group
        else:
            trainer.release_run_folder()  # the process group stays for the next run


@pytest.fixture(scope="module")
def fsdp_straight(tmp_path_factory) -> Path:
    """20 steps on 2 FSDP ranks, saving at steps 10 and 20."""
    out = tmp_path_factory.mktemp("fsdp_straight")
    run_ranks(2, _train_runs, [(str(out), FSDP, 2, None)], tmp_path=out)
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict[str, Path]:
    """2 FSDP ranks stopped by a Ctrl-C during step 10; then the same run resumed to step 20,
    and each other layout resuming that step-10 checkpoint to step 20."""
    root = tmp_path_factory.mktemp("resumed")
    outs = {name: root / name for name in [*LAYOUTS, "one_process"]}
    run_ranks(2, _train_runs, [(str(outs["fsdp2"]), FSDP, 2, 10)], tmp_path=root)
    saved = sorted(p.name for p in (outs["fsdp2"] / "checkpoint").iterdir())
    assert saved == ["step-10"], saved
    for name in [*LAYOUTS, "one_process"]:
        if name != "fsdp2":
            shutil.copytree(
                outs["fsdp2"] / "checkpoint" / "step-10", outs[name] / "checkpoint" / "step-10"
            )
    runs = [(str(outs[name]), extra, batch, None) for name, (extra, batch) in LAYOUTS.items()]
    run_ranks(2, _train_runs, runs, tmp_path=root)
    torch.set_num_threads(1)
    from tidal.train.trainer import Trainer

    trainer = Trainer(run_config(outs["one_process"]), data=random_data(), log=lambda *a: None)
    trainer.train()
    trainer.close()
    return outs


def test_fsdp_resume_is_bitwise_exact(fsdp_straight, resumed):
    ref, got = step_records(fsdp_straight), step_records(resumed["fsdp2"])
    assert sorted(got) == list(range(1, 21))
    assert [got[s] for s in range(1, 21)] == [ref[s] for s in range(1, 21)]
    events = [r for r in records(resumed["fsdp2"]) if "event" in r]
    assert events == [{"event": "resume", "step": 10}]


@pytest.mark.parametrize("name", ["tp2", "pp2_1f1b", "pp2_interleaved", "one_process"])
def test_fsdp_checkpoint_reshards(name, fsdp_straight, resumed):
    ref, got = step_records(fsdp_straight), step_records(resumed[name])
    assert sorted(got) == list(range(11, 21))
    want = torch.tensor([ref[s] for s in range(11, 21)], dtype=torch.float64)
    have = torch.tensor([got[s] for s in range(11, 21)], dtype=torch.float64)
    torch.testing.assert_close(have[:, 0], want[:, 0], atol=ATOL, rtol=0)  # loss
    torch.testing.assert_close(have[:, 1], want[:, 1], atol=ATOL, rtol=0)  # grad norm
    assert torch.equal(have[:, 2], want[:, 2])  # the learning rate continues exactly
    assert have[-1, 0] < want[0, 0] + 0.5  # it went on training, not from scratch


def test_fsdp_pinned_async_saves_match_the_synchronous_ones(fsdp_straight, tmp_path):
    """2 FSDP ranks, each with its writer process writing its DTensor shards from the
    shared staging segment: the same losses and the same checkpoint contents."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "pinned"
    out.mkdir()
    pinned = [*FSDP, "--checkpoint.async_mode", "async_with_pinned_mem"]
    run_ranks(2, _train_runs, [(str(out), pinned, 2, None)], tmp_path=out)
    assert step_records(out) == step_records(fsdp_straight)
    for step in (10, 20):
        dcp_to_torch_save(fsdp_straight / f"checkpoint/step-{step}", tmp_path / "a.pt")
        dcp_to_torch_save(out / f"checkpoint/step-{step}", tmp_path / "b.pt")
        a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
        assert sorted(a) == sorted(b)
        for k, v in a.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, b[k]), (step, k)
            else:
                assert v == b[k], (step, k)
