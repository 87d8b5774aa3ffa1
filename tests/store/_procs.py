"""Workers for multi-process concurrency tests (imported by spawned processes)."""

from __future__ import annotations

import torch

import tidal.store
from tidal.store import VersionNotFoundError

N = 1 << 18  # int64 elements: 2 MiB per tensor
VERSIONS = 150


def payload(v: int) -> dict[str, torch.Tensor]:
    return {"a": torch.arange(N, dtype=torch.int64) + v * N, "b": torch.full((1000,), v)}


def version_of(sd: dict[str, torch.Tensor]) -> int:
    """The version a state dict came from; asserts its bytes all belong to that version."""
    v = int(sd["b"][0])
    assert torch.equal(sd["b"], torch.full((1000,), v)), "tensor b mixes versions"
    assert torch.equal(sd["a"], torch.arange(N, dtype=torch.int64) + v * N), (
        f"tensor a is not whole version {v}"
    )
    return v


def writer_or_reader(rank: int, address: str) -> None:
    if rank == 0:
        store = tidal.store.connect(address)
        for v in range(1, VERSIONS):
            store.put_state_dict(payload(v), "c", version=v)
        store.close()
        return
    store = tidal.store.connect(address, transport="shm" if rank == 1 else "tcp")
    into = {"a": torch.empty(N, dtype=torch.int64), "b": torch.empty(1000, dtype=torch.int64)}
    seen, reads, evicted = -1, 0, 0
    while seen < VERSIONS - 1:
        v = version_of(store.get_state_dict("c", into=into))
        assert v >= seen, f"latest went backwards: {seen} -> {v}"
        seen, reads = v, reads + 1
        old = max(0, v - 3)
        try:
            assert version_of(store.get_state_dict("c", version=old)) == old
        except VersionNotFoundError as e:
            assert "evicted" in str(e), str(e)
            evicted += 1
    assert reads > 1
    store.close()
