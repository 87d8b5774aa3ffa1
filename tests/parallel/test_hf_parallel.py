"""A run started from Hugging Face weights (`checkpoint.initial_load_hf`) on two gloo ranks,
under FSDP2, tensor parallel and a 2-stage pipeline, against one process; and its
`checkpoint.last_save_in_hf` export, written by rank 0 from the checkpoint all ranks saved.

Each rank reads only its shards' slices of the safetensors file (tests/models/
test_hf_sharded.py counts the bytes); here the losses of the runs that follow must match the
one-process run's within fp32 tolerance (2e-5, as tests/parallel/test_checkpoint_parallel.py
measures for resharded runs), and so must the exported weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parallel._launch import run_ranks
from tests.train.test_checkpoint import random_data, run_config, step_records
from tests.train.test_hf_checkpoint import tensors, tiny_model

LAYOUTS = {
    # name: (overrides, per-rank batch)
    "fsdp2": (["--parallelism.dp_shard", "2"], 2),
    "tp2": (["--parallelism.tp", "2", "--parallelism.dp_shard", "1"], 4),
    "pp2": (["--parallelism.pp", "2", "--parallelism.dp_shard", "1"], 4),
}
ATOL = 2e-5
STEPS = 4


def _hf_runs(rank: int, world: int, hf: str, runs: list[tuple[str, list[str], int]]) -> None:
    from tidal.parallel.launch import DistInfo
    from tidal.train.trainer import Trainer

    for out, extra, batch in runs:
        cfg = run_config(
            Path(out),
            "--checkpoint.initial_load_hf",
            hf,
            "--checkpoint.last_save_in_hf",
            *extra,
            steps=STEPS,
        )
        trainer = Trainer(
            cfg,
            data=lambda r, w, b=batch: random_data(r, w, b),
            dist_info=DistInfo.from_env(),
            log=lambda *a: None,
        )
        trainer.train()
        trainer.release_run_folder()  # the process group stays for the next run


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    from tidal.models import save_hf
    from tidal.train.trainer import Trainer

    root = tmp_path_factory.mktemp("hf_parallel")
    hf = root / "hf"
    save_hf(tiny_model(), hf)
    outs = {name: root / name for name in [*LAYOUTS, "one_process"]}
    run_ranks(
        2,
        _hf_runs,
        str(hf),
        [(str(outs[n]), extra, batch) for n, (extra, batch) in LAYOUTS.items()],
        tmp_path=root,
    )
    torch.set_num_threads(1)
    cfg = run_config(
        outs["one_process"],
        "--checkpoint.initial_load_hf",
        str(hf),
        "--checkpoint.last_save_in_hf",
        steps=STEPS,
    )
    trainer = Trainer(cfg, data=random_data(), log=lambda *a: None)
    trainer.train()
    trainer.close()
    return outs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_hf_load_trains_as_one_process(name, runs):
    ref, got = step_records(runs["one_process"]), step_records(runs[name])
    assert sorted(got) == list(range(1, STEPS + 1))
    want = torch.tensor([ref[s] for s in sorted(ref)], dtype=torch.float64)
    have = torch.tensor([got[s] for s in sorted(got)], dtype=torch.float64)
    # Step 1's loss is the loaded weights' (before any update): a wrong or missing shard shows.
    torch.testing.assert_close(have[:, 0], want[:, 0], atol=ATOL, rtol=0)
    torch.testing.assert_close(have[:, 1], want[:, 1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_last_save_in_hf_from_every_layout(name, runs):
    want = tensors(runs["one_process"] / "checkpoint" / f"step-{STEPS}-hf")
    got = tensors(runs[name] / "checkpoint" / f"step-{STEPS}-hf")
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=ATOL, rtol=0, msg=k)
