"""Device volumes (put(..., memory="cuda")): the controller's bookkeeping, on any machine.

The writer side is driven through the protocol with made-up IPC handles, so these run
without a GPU; tests/store/test_gpu.py moves real bytes through CUDA IPC.
"""

import pytest
import torch

import tidal.store
from tidal.store import ProtocolError, StoreError, VolumeLostError

HANDLE = bytes(range(64))
GPU = "GPU-00000000-fake"


def _register(client, vid: str) -> None:
    client._ctrl.request({"op": "device_volume", "volume_id": vid, "host": client._host})


def _put_begin(client, key, version, shape, volume):
    sizes = list(shape)
    return client._ctrl.request(
        {"op": "put_begin", "key": key, "version": version, "writers": 1, "keep": None,
         "host": client._host, "volume": volume, "kind": "tensor", "writer": client._writer,
         "tensors": [[[], sizes, "float32", [0] * len(sizes), sizes]]}
    )  # fmt: skip


def _commit(client, key, version):
    client._ctrl.request(
        {"op": "put_commit", "key": key, "version": version, "writer": client._writer}
    )


def test_device_volume_bookkeeping(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with tidal.store.connect(keep=1) as store, tidal.store.connect(store.address) as writer:
        _register(writer, "cuda.w")
        r = _put_begin(writer, "w", 0, (4, 4), "cuda.w")
        assert r["volume"][0] == "cuda.w" and r["volume"][4] == "cuda" and r["freed"] == []
        slot = r["slots"][0]
        with pytest.raises(ValueError, match="not a slot of volume"):
            writer._ctrl.request(
                {"op": "put_handles", "volume_id": "cuda.w", "handles": [[slot + 99, GPU, HANDLE]]}
            )
        writer._ctrl.request(
            {"op": "put_handles", "volume_id": "cuda.w", "handles": [[slot, GPU, HANDLE]]}
        )
        _commit(writer, "w", 0)
        # A reader learns where the bytes are, and their handles; without CUDA it cannot read.
        got = store._ctrl.request({"op": "slot_handles", "volume_id": "cuda.w", "slots": [slot]})
        assert got["handles"] == [[slot, GPU, HANDLE]]
        with pytest.raises(StoreError, match="needs CUDA in this process"):
            store.get("w")
        with pytest.raises(ValueError, match="GPU memory"):
            store.get("w", copy=False)
        # Nobody else writes into a writer's GPU memory, and automatic placement skips it.
        with pytest.raises(ValueError, match="GPU memory of another writer"):
            _put_begin(store, "x", 0, (2,), "cuda.w")
        assert _put_begin(writer, "plain", 0, (2,), None)["volume"][0] == "v0"
        # The ring reuses the slot; a new layout destroys it and the owner is told to free it.
        _commit(writer, "plain", 0)
        r1 = _put_begin(writer, "w", 1, (4, 4), "cuda.w")
        _commit(writer, "w", 1)
        r2 = _put_begin(writer, "w", 2, (4, 4), "cuda.w")
        assert r2["slots"] == [slot] and r2["freed"] == []  # back from the ring
        _commit(writer, "w", 2)
        r3 = _put_begin(writer, "w", 3, (8,), "cuda.w")  # another shape: old slots go
        _commit(writer, "w", 3)
        r4 = _put_begin(writer, "w", 4, (8,), "cuda.w")
        assert sorted(r4["freed"]) == sorted([slot, r1["slots"][0]]), (r3, r4)
        listing = {v["volume"]: v for v in store.ls()["volumes"]}
        assert listing["cuda.w"]["kind"] == "cuda" and listing["cuda.w"]["alive"]
        # The writer's connection goes: its GPU memory and the versions in it are lost.
        writer._ctrl.close(graceful=True)  # "bye": the server cleans up before answering
        with pytest.raises(VolumeLostError, match="GPU memory of a writer"):
            store.get("w", version=3)
        assert torch.equal(store.get("plain"), torch.zeros(2))  # host volumes unaffected
        with pytest.raises(VolumeLostError):
            store._ctrl.request({"op": "slot_handles", "volume_id": "cuda.w", "slots": [slot]})
        # Nothing of the dead writer is left: no record piles up per writer process.
        assert "cuda.w" not in {v["volume"] for v in store.ls()["volumes"]}
        assert all(owner[0] != "cuda.w" for owner in store._server.controller._slot_owner.values())


def test_device_memory_needs_cuda_and_well_formed_handles(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with tidal.store.connect() as store:
        with pytest.raises(ValueError, match="needs a CUDA device"):
            store.put("w", torch.ones(3), memory="cuda")
        with pytest.raises(ValueError, match="memory must be"):
            store.put("w", torch.ones(3), memory="gpu")
        assert store.keys() == []
        _register(store, "cuda.s")
        with pytest.raises(ProtocolError, match="64 bytes"):
            store._ctrl.request(
                {"op": "put_handles", "volume_id": "cuda.s", "handles": [[1, GPU, b"short"]]}
            )
        with pytest.raises(ValueError, match="already registered"):
            _register(store, "cuda.s")
        store.put("w", torch.ones(3))  # the connection still serves
        assert torch.equal(store.get("w"), torch.ones(3))
