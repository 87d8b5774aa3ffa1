"""Zero-copy reads of GPU memory: get(..., copy=False) of a version put with memory="cuda"
returns views of the writer's slots (tidal/store/views.py, GPU views)."""

import time
import weakref

import pytest
import torch

import tidal.store
from tidal.store import testing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _until_released(store, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while testing.leases(store):
        assert time.monotonic() < deadline, "a dropped view's lease was never released"
        time.sleep(0.01)


def test_gpu_views_alias_the_writers_slots_and_hold_their_version():
    with tidal.store.connect(keep=1) as writer, tidal.store.connect(writer.address) as reader:
        w = torch.randn(512, 256, device="cuda").to(torch.bfloat16)
        writer.put_state_dict({"w": w, "b": [torch.arange(7, device="cuda")]}, "p", memory="cuda")
        allocations = testing.device_allocations(writer)
        got = reader.get_state_dict("p", copy=False)
        assert (
            got["w"].is_cuda and got["w"].dtype == torch.bfloat16 and got["w"].shape == (512, 256)
        )
        assert torch.equal(got["w"], w) and torch.equal(got["b"][0], torch.arange(7, device="cuda"))
        again = reader.get_state_dict("p", version=0, copy=False)
        assert again["w"].data_ptr() == got["w"].data_ptr()  # the slot itself: nothing copied
        del again
        assert testing.leases(writer) == 1  # got's lease
        for v in range(1, 4):  # version 0 is evicted (keep=1), but got pins its slots
            writer.put_state_dict(
                {"w": w + v, "b": [torch.arange(7, device="cuda")]}, "p", memory="cuda"
            )
        assert torch.equal(got["w"], w), "a pinned version's bytes changed"
        assert testing.device_allocations(writer) > allocations  # the ring went around it
        row = got["w"][3]  # a view of a view keeps the version too
        token = weakref.ref(got["w"])
        del got
        assert testing.leases(writer) == 1
        del row
        _until_released(writer)
        assert token() is None


def test_a_gpu_views_lease_outlives_the_kernels_queued_on_it():
    """Dropping views while a kernel reading them is still queued: the lease (and with it
    the slot) is released only after that kernel ran, so the writer's next put cannot
    overwrite the bytes under it."""
    with tidal.store.connect(keep=1) as writer, tidal.store.connect(writer.address) as reader:
        x = torch.full((16 << 20,), 3.0, device="cuda")  # 64 MB
        writer.put("x", x, memory="cuda")
        view = reader.get("x", copy=False)
        busy = torch.randn(4096, 4096, device="cuda")
        _ = (busy @ busy / 64, view * 2)  # load these kernels now: the first launch of a
        torch.cuda.synchronize()  # kernel (lazy module loading) can wait for the device
        for _ in range(50):  # keeps the stream busy for a while (~0.1 s)
            busy = busy @ busy / 64
        doubled = view * 2  # queued behind the matmuls
        probe = torch.cuda.Event()
        probe.record()
        assert not probe.query(), "the stream was not busy: the test proves nothing"
        del view
        assert testing.leases(writer) == 1, "released while a kernel on the view was queued"
        _until_released(writer)
        for _ in range(2):  # the second put reuses the released slot
            writer.put("x", torch.zeros_like(x), memory="cuda")
        assert torch.equal(doubled, torch.full_like(x, 6.0))


def test_gpu_views_in_another_process():
    from tests.store import _gpu_procs

    with (
        tidal.store.connect(keep=1) as store,
        tidal.store.connect(store.address) as writer,
        _gpu_procs.reader_process(store.address) as parent,
    ):
        for v in range(5):
            torch.cuda._sleep(100_000_000)  # the writer's copies run after its commit
            writer.put_state_dict(_gpu_procs.payload(v), "p", version=v, memory="cuda")
            parent.send(("view", "p", v))
            assert parent.recv() == ("ok", v)
        _until_released(store)
        assert testing.device_allocations(writer) == 2 * 4  # the ring of keep + 1 only


def test_a_versions_slots_share_a_few_allocations():
    """Slots are carved from large allocations (tidal/store/transports/cuda/memory.py), so the
    views of one read share one storage per allocation; a big tensor gets its own."""
    from tidal.store.transports.cuda import memory

    big = memory.ARENA_BYTES // 4 // 4  # float32 elements: an allocation of its own
    sd = {f"w{i}": torch.full((1000 + i,), float(i), device="cuda") for i in range(20)}
    sd["big"] = torch.ones(big, device="cuda")
    with tidal.store.connect(keep=1) as writer, tidal.store.connect(writer.address) as reader:
        writer.put_state_dict(sd, "p", memory="cuda")
        got = reader.get_state_dict("p", copy=False)
        assert all(torch.equal(got[k], t) for k, t in sd.items())
        storages = {got[k].untyped_storage().data_ptr() for k in sd if k != "big"}
        assert len(storages) == 1, "small slots of one version were not carved together"
        assert got["big"].untyped_storage().data_ptr() not in storages
        ptrs = sorted(got[k].data_ptr() for k in sd if k != "big")
        assert all(p % memory.ALIGN == 0 for p in ptrs)
        del got
        _until_released(writer)
