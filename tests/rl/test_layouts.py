"""Generators in layouts of their own (tidal/rl/distributed/generator_ranks.py): the config of
each generator's layout, the checks that refuse a layout before anything starts, and one job in
three layouts (the trainer FSDP on 2 ranks, generator 0 tensor parallel on 2 ranks, generator
1 on one) whose generators hold the trainer's weights bit for bit at every version."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.rl._cli import NO_PLOT, records, run_rl
from tests.rl.loop_configs import tiny
from tidal.models import get_flavor
from tidal.parallel.launch import DistInfo
from tidal.rl.distributed.generator_ranks import (
    check_generator_layouts,
    generator_command,
    join_generator_group,
)
from tidal.train.config_parse import apply_overrides, help_text

LAYOUTS = "tests/rl/loop_configs.py:layouts"


def test_generator_tp_is_one_degree_for_all_or_one_per_generator():
    cfg = apply_overrides(tiny(), ["--generator.count", "2", "--generator.tp", "2"])
    assert cfg.generator.tp == 2 and [cfg.generator.tp_of(i) for i in (0, 1)] == [2, 2]
    cfg = apply_overrides(tiny(), ["--generator.count", "2", "--generator.tp", "2,1"])
    assert cfg.generator.tp == (2, 1) and [cfg.generator.tp_of(i) for i in (0, 1)] == [2, 1]
    assert "--generator.tp INT|INT,INT,..." in help_text(cfg, "tiny")
    with pytest.raises(
        ValueError,
        match=r"generator.tp lists 3 degree\(s\) 2,1,1 for "
        r"generator.count=2",
    ):
        apply_overrides(tiny(), ["--generator.count", "2", "--generator.tp", "2,1,1"])
    with pytest.raises(ValueError, match="generator.tp degrees must be integers >= 1, got 0"):
        apply_overrides(tiny(), ["--generator.tp", "0"])
    with pytest.raises(ValueError, match="--generator.tp: cannot read '2;1'"):
        apply_overrides(tiny(), ["--generator.count", "2", "--generator.tp", "2;1"])


def test_a_layout_that_cannot_hold_the_model_is_refused_naming_what_fits():
    args = get_flavor("tiny")  # 4 query heads, 2 kv heads, MLP 192, vocabulary 512
    two = apply_overrides(tiny(), ["--generator.count", "2"])
    check_generator_layouts(apply_overrides(two, ["--generator.tp", "2,1"]), args)  # fits

    with pytest.raises(ValueError) as e:
        check_generator_layouts(apply_overrides(two, ["--generator.tp", "1,3"]), args)
    msg = str(e.value)
    assert msg.startswith("generator.tp=3 (generator 1) cannot hold the policy")
    assert "query heads (4), key/value heads (2), MLP hidden width (192), vocabulary (512)" in msg
    assert "3 does not divide the query heads, key/value heads, vocabulary." in msg
    assert msg.endswith("Degrees that fit: 1, 2 (at most 2 ranks)")

    four = r"generator.tp=4 \(generators 0, 1\) .* 4 does not divide the key/value heads\. "
    with pytest.raises(ValueError, match=four + ".*at most 2"):
        check_generator_layouts(apply_overrides(two, ["--generator.tp", "4"]), args)

    tied = get_flavor("debug_qwen3")
    assert tied.tie_embeddings
    with pytest.raises(ValueError, match="ties its embeddings"):
        check_generator_layouts(apply_overrides(two, ["--generator.tp", "2,1"]), tied)
    check_generator_layouts(two, tied)  # on one rank each, tied embeddings are fine

    with pytest.raises(ValueError, match=r"needs 2 GPUs, one per rank, but 1 are visible"):
        check_generator_layouts(
            apply_overrides(two, ["--generator.tp", "2,1"]), args, cuda_devices=1
        )


def test_each_generator_starts_in_its_layout_and_refuses_another_world_size():
    cfg = apply_overrides(tiny(), ["--generator.count", "2", "--generator.tp", "2,1"])
    tp2, one = generator_command(cfg, 0, ["--x"]), generator_command(cfg, 1, ["--x"])
    assert tp2[:5] == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
    ]
    assert tp2[5:] == ["-m", "tidal", "rl", "generator", "--index", "0", "--x"]
    assert one == [sys.executable, "-m", "tidal", "rl", "generator", "--index", "1", "--x"]
    cpu = torch.device("cpu")
    with pytest.raises(
        ValueError,
        match=r"generator 0 has generator.tp=2 but runs on 1 rank"
        r"\(s\); start it under torchrun: `torchrun "
        r"--nproc_per_node 2",
    ):
        join_generator_group(cfg, 0, DistInfo(), cpu)
    with pytest.raises(ValueError, match="start it as one process"):
        join_generator_group(cfg, 1, DistInfo(rank=1, world_size=2), cpu)
    assert join_generator_group(cfg, 1, DistInfo(), cpu) is None  # no process group for one


def test_tidal_rl_refuses_a_generator_layout_before_any_role_starts(tmp_path):
    r = run_rl(tmp_path / "run", "--generator.tp", "3,1", config=LAYOUTS, timeout=60)
    assert r.returncode == 2, r.stdout
    assert "tidal rl: error: generator.tp=3 (generator 0) cannot hold the policy's" in r.stdout
    assert "Degrees that fit: 1, 2" in r.stdout
    assert "trainer:" not in r.stdout and "generator 1:" not in r.stdout  # nothing started


@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_three_layouts_hold_the_trainers_full_weights_bitwise_at_every_version(
    tmp_path, monkeypatch, mode
):
    """Trainer FSDP on 2 ranks (fp32, publishing bf16), generator 0 TP on 2 ranks, generator
    1 on one (both bf16): every generator rank's parameters at each version it holds,
    gathered from its shards, equal the trainer's full parameters cast to bf16 at that
    version, bit for bit. Sync mode: seen at each batch and evaluation. Async mode: also
    where the generator starts and at each swap (at a batch start or between decode steps,
    `_write_weights` in tests/rl/loop_configs.py), and the two ranks of generator 0 switch
    versions together."""
    weights = tmp_path / "weights"
    weights.mkdir()
    monkeypatch.setenv("TIDAL_TEST_WEIGHTS", str(weights))
    out = tmp_path / "run"
    steps = 2 if mode == "sync" else 3
    extra = ["--rl.mode", "async", "--loss.tis_cap", "2"] if mode == "async" else []
    r = run_rl(
        out,
        "--nproc",
        "2",
        "--rl.steps",
        str(steps),
        *NO_PLOT,
        *extra,
        config=LAYOUTS,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout
    assert "world 2 (dp_shard=2)" in r.stdout
    assert "generator 0: on 2 ranks (tp) on cpu (torch.bfloat16)" in r.stdout
    assert "generator 1: on cpu (torch.bfloat16)" in r.stdout
    records_, evals = records(out)
    assert len(records_) == steps
    assert sum(sum(s["samples_per_generator"]) for s in records_) == steps * 32
    assert [e["step"] for e in evals] == [0, steps]  # generator 0 (TP) evaluated

    trainer = {v: torch.load(weights / f"trainer-v{v}.pt")["params"] for v in range(steps + 1)}
    wq = "layers.0.attention.wq.weight"
    assert not torch.equal(trainer[0][wq], trainer[steps][wq])  # training moved them
    total = sum(t.numel() for t in trainer[0].values())
    held: dict[str, list[int]] = {}
    for path in weights.glob("generator*.pt"):
        name, _, v = path.stem.rpartition("-v")
        held.setdefault(name, []).append(int(v))
    held = {name: sorted(vs) for name, vs in held.items()}
    assert sorted(held) == ["generator0-rank0", "generator0-rank1", "generator1-rank0"]
    assert held["generator0-rank0"] == held["generator0-rank1"]  # the TP ranks in lockstep
    assert {0, steps} <= set(held["generator0-rank0"]) and 0 in held["generator1-rank0"]
    by = {
        (name, v): torch.load(weights / f"{name}-v{v}.pt")["by"]
        for name, versions in held.items()
        for v in versions
    }
    if mode == "sync":
        assert held == {
            "generator0-rank0": [0, 1, 2],
            "generator0-rank1": [0, 1, 2],
            "generator1-rank0": [0, 1],
        }
        assert set(by.values()) == {"generate"}
    else:  # each generator starts from version 0; versions between the evaluated ones are
        # seen only where they are swapped in
        assert all(by[name, 0] == "start" for name in held), by
        swapped = {v for (_, v), b in by.items() if b in ("batch start", "in flight")}
        assert swapped & set(range(1, steps)), by
        # The TP ranks take each version at the same kind of point (they swap in lockstep).
        assert all(
            by["generator0-rank0", v] == by["generator0-rank1", v] for v in held["generator0-rank0"]
        ), by
    for name, versions in held.items():
        for v in versions:
            got = torch.load(weights / f"{name}-v{v}.pt")
            assert got["version"] == v
            assert got["params"].keys() == trainer[v].keys()
            for k, t in trainer[v].items():
                g = got["params"][k]
                assert g.dtype == torch.bfloat16 and torch.equal(g, t), (name, v, k)
            if name.startswith("generator0"):  # each TP rank holds about half, its own shards
                assert got["world"] == 2 and got["local_numel"] < 0.6 * total, got["local_numel"]
            else:
                assert got["world"] == 1 and got["local_numel"] == total


class _LaggingStore:
    """A store stand-in of one rank: versions of full state dicts, read into DTensor shards;
    `hidden` versions are committed but not listed yet (this rank's view lags)."""

    def __init__(self, versions: dict[int, dict], hidden: set[int]) -> None:
        self.full, self.hidden = versions, hidden

    def versions(self, key: str) -> list[int]:
        return sorted(v for v in self.full if v not in self.hidden)

    def get_state_dict(self, key, *, into, version, wait=None):
        from torch.distributed.tensor import DTensor, distribute_tensor

        for k, dst in into.items():
            src = self.full[version][k].to(dst.dtype)
            if isinstance(dst, DTensor):  # this rank's shard, sliced locally (no collective)
                src = distribute_tensor(src, dst.device_mesh, dst.placements, src_data_rank=None)
                dst.to_local().copy_(src.to_local())
            else:
                dst.copy_(src)
        return into


def _stagers_agree(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from tests.generate.conftest import tiny_model
    from tidal.models import Transformer
    from tidal.rl.distributed.prefetch import Stager

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = Transformer(get_flavor("tiny", max_seq_len=128))
    from tidal.rl.distributed.generator_ranks import shard_model

    shard_model(model, mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    full = {v: tiny_model(seed=v).state_dict() for v in (0, 1, 2)}
    # Rank 1 sees version 2 late: its prefetch stages 1 while rank 0's stages 2.
    store = _LaggingStore(full, hidden={2} if rank == 1 else set())
    stager = Stager(store, "policy", model.state_dict(), held=0, last=2, slice_s=0.05)
    stager.start()
    try:
        first = stager.wait_staged(30)
        disagreed = stager.swap()  # staged 2 and 1: nobody swaps, rank 1 fetches 2
        store.hidden = set()
        second = stager.wait_staged(30)
        agreed = stager.swap()
    finally:
        stager.close()
    sd = model.state_dict()
    equal = all(
        torch.equal(sd[k].full_tensor() if isinstance(sd[k], DTensor) else sd[k], full[2][k])
        for k in full[2]
    )
    return first, disagreed, second, agreed, stager.held, stager.swaps, equal


def test_the_ranks_of_a_tp_generator_swap_the_same_version_at_the_same_point(tmp_path):
    from tests.parallel._launch import run_ranks

    (f0, d0, s0, a0, h0, n0, e0), (f1, d1, s1, a1, h1, n1, e1) = run_ranks(
        2, _stagers_agree, tmp_path=tmp_path
    )
    assert (f0, f1) == (2, 1)  # rank 0 staged the newest version, rank 1 an older one
    assert (d0, d1) == (None, None)  # they disagreed: neither swapped
    assert (s0, s1) == (2, 2)  # rank 1 dropped its version and fetched rank 0's
    assert (a0, a1) == (2, 2) and (h0, h1) == (2, 2) and (n0, n1) == (1, 1)
    assert e0 and e1  # every shard holds version 2
