"""Ranks free their process groups before the interpreter exits.

A ProcessGroup still alive at interpreter shutdown (a DeviceMesh keeps its groups, FSDP2 the
ones it shards over) is destroyed during that shutdown, where gloo now and then aborts the
process ("terminate called without an active exception", SIGABRT at exit: how multi-rank
tests flaked in CI). `Trainer.close()` drops everything that holds them, and
`tidal.parallel.launch.destroy_process_group()` empties the meshes that torch's own caches
keep of their groups, so after `close()` nothing holds a group any more.
"""

from __future__ import annotations

import gc

import pytest

from tests.parallel._launch import run_ranks
from tests.parallel.test_parity import CASES, make_config


def _close_and_count(rank, world, cfg):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from tidal.parallel.launch import DistInfo
    from tidal.train.trainer import Trainer

    trainer = Trainer(cfg, dist_info=DistInfo.from_env(), log=lambda *a: None)
    trainer.step += 1
    batches, n_tokens, _ = trainer.next_batches()
    trainer.train_step(batches, n_tokens)
    trainer.close()
    holding = sum(
        bool(getattr(o, "_pg_registry", None))
        for o in gc.get_objects()
        if isinstance(o, DeviceMesh)
    )
    fsdp_states = sum(type(o).__name__ == "FSDPState" for o in gc.get_objects())
    return holding, fsdp_states, dist.is_initialized()


@pytest.mark.parametrize("name", ["fsdp2", "pp2_1f1b"])
def test_closed_trainer_holds_no_process_group(name, tmp_path, text_corpus, cache_dir):
    world, extra = CASES[name]
    cfg = make_config(tmp_path, text_corpus, cache_dir, *extra)
    for result in run_ranks(world, _close_and_count, cfg, tmp_path=tmp_path):
        assert result == (0, 0, False)  # no mesh holding groups, no FSDP state, no group


def test_teardown_survives_dead_weak_proxies():
    """gc.get_objects() hands the teardown dead weak proxies, on which isinstance raises."""
    import weakref

    from tidal.parallel.launch import destroy_process_group

    class Thing:
        pass

    thing = Thing()
    proxy = weakref.proxy(thing)
    del thing
    held = [proxy]  # a dead proxy the teardown will see
    destroy_process_group()
    assert len(held) == 1
