"""A save killed by SIGKILL at any instant never leaves the newest loadable checkpoint corrupt.

A forked child saves full checkpoints of a tiny model in a loop (every parameter filled with
the step number, keep_latest_k=2 so deletions are cut short too); the test kills it at a
random instant, then starts from the newest complete checkpoint the way a restarted run does
(`plan_load` + `Checkpointer.load`) and checks it holds its step's values. The next child
continues from there, over the leftovers of the killed save.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import random
import time
from pathlib import Path

import numpy as np
import torch

from tidal.models import Transformer, get_flavor
from tidal.train.checkpoint import Checkpointer, layout, model_info, plan_load
from tidal.train.config import CheckpointConfig
from tidal.train.data import PackedLoader

KILLS = 24
ARGS = get_flavor("tiny", vocab_size=64)


def build(folder: Path) -> tuple[Transformer, Checkpointer]:
    with torch.device("meta"):
        model = Transformer(ARGS)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    opt.step()  # the optimizer state exists and is saved
    loader = PackedLoader(np.arange(4096) % 64, np.array([0]), seq_len=32, batch_size=2, seed=0)
    ckpt = Checkpointer(
        CheckpointConfig(enable=True, keep_latest_k=2),
        folder=folder,
        modules=[model],
        optimizer=opt,
        loader=loader,
        device=torch.device("cpu"),
        args=ARGS,
        info={"model": model_info(ARGS, "tiny"), "parallelism": {"world_size": 1}},
        lr_settings={},
        log=lambda *a: None,
    )
    return model, ckpt


def saver(folder: Path, first_step: int, conn) -> None:
    """Child: save steps first_step, first_step + 1, ... until killed."""
    torch.set_num_threads(1)
    model, ckpt = build(folder)
    conn.send("ready")
    for step in itertools.count(first_step):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        ckpt.save(step)
        conn.send(step)


def test_sigkill_during_saves_never_corrupts_the_newest_checkpoint(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _kill_and_reload(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _kill_and_reload(tmp_path: Path) -> None:
    out = tmp_path / "run"
    folder = out / "checkpoint"
    ctx = mp.get_context("fork")  # fork: no interpreter start per child, so 24 kills are cheap
    rng = random.Random(0)
    model, ckpt = build(tmp_path / "unused")
    cfg = CheckpointConfig(enable=True)
    newest, per_save, with_leftovers = -1, None, 0
    for kill in range(KILLS + 1):
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=saver, args=(folder, newest + 1, send), daemon=True)
        child.start()
        assert recv.poll(60) and recv.recv() == "ready"
        if per_save is None:  # calibrate once: the child saves three times undisturbed
            t0 = time.perf_counter()
            for _ in range(3):
                assert recv.poll(60)
                recv.recv()
            per_save = (time.perf_counter() - t0) / 3
        # A random instant within the next three saves (a kill time, not a synchronization).
        time.sleep(rng.uniform(0, 3 * per_save))
        child.kill()
        child.join()
        assert child.exitcode == -9

        logs: list[str] = []
        found = layout.scan(folder)
        with_leftovers += bool(found.incomplete)
        plan = plan_load(cfg, out, ARGS, "tiny", total_steps=10**9, log=logs.append)
        if plan is None:  # killed before its first save completed
            assert not found.complete and newest == -1
            continue
        assert plan.step == max(found.complete) >= newest
        if found.incomplete:
            assert "skipped incomplete: " + found.describe_incomplete() in logs[-1]
        assert ckpt.load(plan) == plan.step
        for name, p in model.named_parameters():
            assert torch.all(p == plan.step), f"kill {kill}: {name} of step-{plan.step}"
        newest = plan.step
    print(f"{KILLS} kills, newest step {newest}, {with_leftovers} left an incomplete save")
    assert newest > KILLS // 2  # the children made progress between kills
    assert with_leftovers >= KILLS // 4, with_leftovers  # many kills landed inside a save
