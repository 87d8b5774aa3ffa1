"""A reader process for the CUDA IPC tests (imported by the spawned process), and the
tests' helpers around it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

import tidal.store
from tidal.store import VolumeLostError, ops, testing


def payload(v: int) -> dict[str, torch.Tensor]:
    return {
        "emb": torch.full((4096, 512), float(v), device="cuda", dtype=torch.bfloat16),
        "layers": [torch.arange(1000, device="cuda") * (v + 1) for _ in range(3)],
    }


@contextlib.contextmanager
def reader_process(address: str) -> Iterator[Any]:
    """:func:`start_reader`, yielding the parent's end of the pipe. When the block ends
    without an error, the reader is told to stop and must exit 0; it is killed if it is
    still alive after the block either way."""
    proc, parent = start_reader(address)
    try:
        yield parent
        parent.send(None)
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def progress_reports(writer: tidal.store.Store) -> list[list[int]]:
    """A list that gathers the slots of every progress report ``writer`` sends (made only
    while a reader waits for the version being put)."""
    reports: list[list[int]] = []
    testing.on_request(
        writer, lambda c, op, f: reports.append(f["slots"]) if op is ops.PUT_PROGRESS else None
    )
    return reports


def start_reader(address: str):
    """A spawned process running :func:`reader` on the store at ``address``, and the parent's
    end of its pipe."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=reader, args=(child, address))
    proc.start()
    child.close()
    return proc, parent


def reader(conn, address: str) -> None:
    store = tidal.store.connect(address)
    into = {
        "emb": torch.zeros(4096, 512, device="cuda", dtype=torch.bfloat16),
        "layers": [torch.zeros(1000, device="cuda", dtype=torch.int64) for _ in range(3)],
    }
    while (msg := conn.recv()) is not None:
        op, key, v = msg
        try:
            if op == "view":  # zero-copy: views of the writer's GPU memory, checked, dropped
                got = store.get_state_dict(key, version=v, copy=False)
                want = payload(v)
                ok = torch.equal(got["emb"], want["emb"]) and all(
                    torch.equal(a, b) for a, b in zip(got["layers"], want["layers"], strict=True)
                )
                assert ok and got["emb"].is_cuda, f"version {v}: wrong views"
                del got
                conn.send(("ok", v))
                continue
            if op == "wait":
                conn.send("waiting")
                store.get_state_dict(key, into=into, version=v, wait=60)
            else:
                store.get_state_dict(key, into=into, version=v)
        except VolumeLostError as e:
            conn.send(("VolumeLostError", str(e)))
            continue
        want = payload(v)
        assert torch.equal(into["emb"], want["emb"]), f"version {v}: wrong bytes"
        assert all(torch.equal(a, b) for a, b in zip(into["layers"], want["layers"], strict=True))
        conn.send(("ok", v))
    store.close()
