"""A run started from a checkpoint in torchtitan's layout (`checkpoint.initial_load_path` with
`checkpoint.initial_load_layout torchtitan`) on two gloo ranks, under FSDP2, tensor parallel
and a 2-stage pipeline: each rank reads its shards through DCP and the q/k rows are reordered
across the shards (tidal/train/checkpoint/torchtitan.py `to_tidal_sharded`), so the loaded
weights must equal the original model's bitwise.

The torchtitan-layout folder is written by `dcp_to_dcp(..., to_layout="torchtitan")` and
stripped of tidal.json and COMPLETE, as torchtitan writes it; that this layout is torchtitan's
own is tested against torchtitan's model in tests/train/test_torchtitan_checkpoint.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parallel._launch import run_ranks
from tests.train.test_checkpoint import random_data, run_config
from tests.train.test_hf_checkpoint import tiny_model

LAYOUTS = {
    # name: (overrides, per-rank batch)
    "fsdp2": (["--parallelism.dp_shard", "2"], 2),
    "tp2": (["--parallelism.tp", "2", "--parallelism.dp_shard", "1"], 4),
    "pp2": (["--parallelism.pp", "2", "--parallelism.dp_shard", "1"], 4),
}


def _loads(rank: int, world: int, src: str, runs: list[tuple[str, list[str], int]]) -> list:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from tidal.parallel.launch import DistInfo
    from tidal.train.trainer import Trainer

    loaded = []
    for out, extra, batch in runs:
        cfg = run_config(
            Path(out),
            "--checkpoint.initial_load_path",
            src,
            "--checkpoint.initial_load_layout",
            "torchtitan",
            *extra,
            steps=1,
        )
        trainer = Trainer(
            cfg,
            data=lambda r, w, b=batch: random_data(r, w, b),
            dist_info=DistInfo.from_env(),
            log=lambda *a: None,
        )
        full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        loaded.append({k: v.detach().clone() for k, v in full.items()})
    return loaded


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> tuple[dict[str, torch.Tensor], dict[str, list[dict]]]:
    from tests.train.test_checkpoint import VOCAB
    from tidal.models import get_flavor
    from tidal.train.checkpoint import model_info, save_model
    from tidal.train.checkpoint.hf import dcp_to_dcp

    root = tmp_path_factory.mktemp("torchtitan_parallel")
    model = tiny_model()
    args = get_flavor("tiny", vocab_size=VOCAB)
    src = save_model(model.state_dict(), root / "run", 1, info={"model": model_info(args, "t")})
    titan = dcp_to_dcp(src, root / "titan" / "step-1", to_layout="torchtitan", log=lambda _: 0)
    for name in ("tidal.json", "COMPLETE"):  # as torchtitan writes it
        (titan / name).unlink()
    names = list(LAYOUTS)
    per_rank = run_ranks(
        2,
        _loads,
        str(titan.parent),
        [(str(root / n), extra, batch) for n, (extra, batch) in LAYOUTS.items()],
        tmp_path=root,
    )
    return model.state_dict(), {n: [per_rank[r][i] for r in range(2)] for i, n in enumerate(names)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_torchtitan_load_is_exact(name, loaded):
    want, runs = loaded
    seen = set()
    for rank_sd in runs[name]:
        for key, value in rank_sd.items():
            assert torch.equal(value, want[key]), (name, key)
            seen.add(key)
    assert seen == set(want)  # every key on some rank (a pipeline stage holds its own)
