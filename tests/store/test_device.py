"""Device volumes (put(..., memory="cuda")): the controller's bookkeeping, on any machine.

The writer side is driven through the protocol with made-up IPC handles, so these run
without a GPU; tests/store/test_gpu.py moves real bytes through CUDA IPC.
"""

import pytest
import torch

import tidal.store
from tidal.store import ProtocolError, StoreError, VolumeLostError, ops, testing

HANDLE = bytes(range(64))
GPU = "GPU-00000000-fake"
EVENT = bytes(range(64, 128))


def _handle(slot: int, handle: bytes = HANDLE) -> dict:
    return {
        "slot": slot,
        "uuid": GPU,
        "handle": handle,
        "offset": 512,
        "span": 4096,
        "event": EVENT,
    }


class Writer:
    """A writer driving the protocol by hand on one connection (as a store handle's writer
    connection does), with plans per (key, shape, volume)."""

    def __init__(self, store, name: str = "w") -> None:
        self.conn = testing.raw(store.address)
        self.host = testing.host(store)
        self.name = name
        self.plans: dict = {}

    def register(self, vid: str) -> None:
        self.conn.request(ops.DEVICE_VOLUME, volume_id=vid, host=self.host)

    def begin(self, key, version, shape, volume):
        sizes = list(shape)
        if (key, tuple(shape), volume) not in self.plans:
            decl = {
                "name": [],
                "shape": sizes,
                "dtype": "float32",
                "offsets": [0] * len(sizes),
                "sizes": sizes,
            }
            d = self.conn.request(
                ops.PUT_DECLARE,
                key=key,
                kind="tensor",
                writers=1,
                keep=None,
                host=self.host,
                volume=volume,
                tensors=[decl],
            )
            self.plans[key, tuple(shape), volume] = d
        d = self.plans[key, tuple(shape), volume]
        r = self.conn.request(
            ops.PUT_BEGIN,
            key=key,
            plan=d["plan"],
            version=version,
            writer=self.name,
            reservation=None,
            objects=[],
        )
        return d["volume"], r

    def commit(self, key, version) -> dict:
        return self.conn.request(
            ops.PUT_COMMIT, key=key, version=version, writer=self.name, reserve=False
        )


def test_device_volume_bookkeeping(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with tidal.store.connect(keep=1) as store:
        writer = Writer(store)
        writer.register("cuda.w")
        vol, r = writer.begin("w", 0, (4, 4), "cuda.w")
        assert vol["id"] == "cuda.w" and vol["kind"] == "cuda" and r["freed"] == []
        slot = r["slots"][0]
        assert r["fresh"] == [slot]  # the owner allocates it
        with pytest.raises(ValueError, match="not a slot of volume"):
            writer.conn.request(ops.PUT_HANDLES, volume_id="cuda.w", handles=[_handle(slot + 99)])
        writer.conn.request(ops.PUT_HANDLES, volume_id="cuda.w", handles=[_handle(slot)])
        writer.commit("w", 0)
        # A reader learns where the bytes are, and their handles; without CUDA it cannot read.
        reader = testing.raw(store.address)
        got = reader.request(ops.SLOT_HANDLES, volume_id="cuda.w", slots=[slot])
        assert got["handles"] == [_handle(slot)]
        with pytest.raises(StoreError, match="needs CUDA in this process"):
            store.get("w")
        with pytest.raises(StoreError, match="GPU memory .* needs CUDA in this process"):
            store.get("w", copy=False)  # zero-copy views of GPU memory need CUDA too
        assert testing.leases(store) == 0  # the failed read's lease is released
        # Nobody else writes into a writer's GPU memory, and automatic placement skips it.
        other = Writer(store, "other")
        with pytest.raises(ValueError, match="GPU memory of another writer"):
            other.begin("x", 0, (2,), "cuda.w")
        with pytest.raises(ValueError, match="GPU memory of another writer"):
            other.conn.request(ops.PUT_HANDLES, volume_id="cuda.w", handles=[_handle(slot)])
        assert writer.begin("plain", 0, (2,), None)[0]["id"] == "v0"
        # The ring reuses the slot; a new layout destroys it and the owner is told to free it.
        writer.commit("plain", 0)
        _, r1 = writer.begin("w", 1, (4, 4), "cuda.w")
        writer.commit("w", 1)
        _, r2 = writer.begin("w", 2, (4, 4), "cuda.w")
        assert r2["slots"] == [slot] and r2["freed"] == [] and r2["fresh"] == []  # the ring
        writer.commit("w", 2)
        writer.begin("w", 3, (8,), "cuda.w")  # another shape: old slots go
        freed = writer.commit("w", 3)["freed"]
        _, r4 = writer.begin("w", 4, (8,), "cuda.w")
        assert sorted(freed + r4["freed"]) == sorted([slot, r1["slots"][0]])
        listing = {v["volume"]: v for v in store.ls()["volumes"]}
        assert listing["cuda.w"]["kind"] == "cuda" and listing["cuda.w"]["alive"]
        # The writer's connection goes: its GPU memory and the versions in it are lost.
        writer.conn.close(graceful=True)  # "bye": the server cleans up before answering
        with pytest.raises(VolumeLostError, match="GPU memory of a writer"):
            store.get("w", version=3)
        assert torch.equal(store.get("plain"), torch.zeros(2))  # host volumes unaffected
        with pytest.raises(VolumeLostError):
            reader.request(ops.SLOT_HANDLES, volume_id="cuda.w", slots=[slot])
        # Nothing of the dead writer is left: no record piles up per writer process.
        assert "cuda.w" not in {v["volume"] for v in store.ls()["volumes"]}
        assert testing.controller(store).counts()["slots"] == 1  # "plain" alone
        reader.close()
        other.conn.close()


def test_device_memory_needs_cuda_and_well_formed_handles(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with tidal.store.connect() as store:
        with pytest.raises(ValueError, match="needs a CUDA device"):
            store.put("w", torch.ones(3), memory="cuda")
        with pytest.raises(ValueError, match="memory must be"):
            store.put("w", torch.ones(3), memory="gpu")
        assert store.keys() == []
        writer = Writer(store)
        writer.register("cuda.s")
        with pytest.raises(ProtocolError, match="64 bytes"):
            writer.conn.request(ops.PUT_HANDLES, volume_id="cuda.s", handles=[_handle(1, b"short")])
        with pytest.raises(ValueError, match="already registered"):
            writer.register("cuda.s")
        store.put("w", torch.ones(3))  # the store still serves
        assert torch.equal(store.get("w"), torch.ones(3))
        writer.conn.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_warm_up_cuda_needs_cuda():
    with pytest.raises(StoreError, match="needs a CUDA device"):
        tidal.store.warm_up_cuda()


@pytest.mark.parametrize(("offset", "span"), [(4096, 4096), (1024, 1000), (0, 8)])
def test_a_slot_outside_its_allocation_is_refused_before_anything_is_opened(offset, span):
    """A reader opens a slot only if its bytes lie inside the allocation the writer named:
    a wrong offset or span must not become an out-of-bounds view of GPU memory."""
    from tidal.store.transports.cuda.memory import Imports

    imports = Imports()
    h = {**_handle(3), "offset": offset, "span": span}
    with pytest.raises(StoreError, match="slot 3 .* do not fit its allocation"):
        imports.add("cuda.w", h, 16)
    assert imports.volumes() == set()
