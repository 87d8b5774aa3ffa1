"""Resharding matrix across separate multi-process jobs (gloo), checked against the full
tensor and against DCP's result for the same source and destination layouts."""

import tidal.store
from tests.parallel._launch import spawn
from tests.store import _dist


def _run(fn, world, address, tmp_path, name):
    init_file = str(tmp_path / f"init_{name}")
    spawn(fn, (world, address, init_file, str(tmp_path / "ckpt")), world)


def test_reshard_matrix_vs_full_and_dcp(tmp_path):
    with tidal.store.connect(keep=2) as store:
        _run(_dist.job_a, 2, store.address, tmp_path, "a")
        _run(_dist.job_b, 4, store.address, tmp_path, "b")
        _run(_dist.job_c, 2, store.address, tmp_path, "c")
        # Replicated shards were stored once: 2 writers of a Replicate() DTensor, one slot.
        listing = {(e["key"], e["version"]): e for e in store.ls()["entries"]}
        assert listing[("repl2", 0)]["shards"] == 1
        assert listing[("row4", 0)]["shards"] == 4
        assert listing[("tp_sub", 0)]["shards"] == 2  # 4 writers, dp replicas deduplicated
        assert listing[("fsdp_model", 0)]["tensors"] == len(_dist.tiny_full())
