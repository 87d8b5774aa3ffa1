"""CUDA tensors through the store (shared memory registered with CUDA, and TCP)."""

import pytest
import torch

import tidal.store
from tidal.store import testing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_cuda_round_trip(transport):
    with tidal.store.connect(transport=transport) as store:
        x = torch.randn(257, 129, device="cuda", dtype=torch.bfloat16)
        for v in range(4):  # the ring of slots: pinned segments are reused
            store.put("x", x + v)
            into = torch.empty(129, 257, device="cuda", dtype=torch.bfloat16).t()
            store.get("x", into=into)
            assert torch.equal(into, x + v)
        assert torch.equal(store.get("x").cuda(), x + 3)
        sd = {"a": x, "b": {"c": torch.arange(10, device="cuda")}}
        store.put_state_dict(sd, "sd")
        got = {
            "a": torch.empty_like(x),
            "b": {"c": torch.zeros(10, device="cuda", dtype=torch.int64)},
        }
        store.get_state_dict("sd", into=got)
        assert torch.equal(got["a"], x) and torch.equal(got["b"]["c"], sd["b"]["c"])


def test_cuda_tensors_over_several_part_files(monkeypatch):
    """Host slots larger than a part (``PART_BYTES`` made 64 KB): each is one range of
    several file mappings, registered with CUDA as one, and copied to and from by DMA."""
    from tidal.store import volume

    monkeypatch.setattr(volume, "PART_BYTES", 64 << 10)
    with tidal.store.connect(keep=1) as writer, tidal.store.connect(writer.address) as reader:
        x = torch.randn(1000, 257, device="cuda")  # 1028000 bytes: 16 parts, the last short
        sd = {"x": x, "y": torch.arange(3 * 65536 // 8, device="cuda")}  # 3 parts exactly
        for v in range(4):  # fresh slots, then the ring
            writer.put_state_dict({k: t + v for k, t in sd.items()}, "sd")
            got = {k: torch.empty_like(t) for k, t in sd.items()}
            reader.get_state_dict("sd", into=got)
            for k, t in sd.items():
                assert torch.equal(got[k], t + v), (v, k)
            assert torch.equal(writer.get_state_dict("sd")["x"].cuda(), x + v)
        assert testing.pinned_segments(writer) >= 2 and testing.pinned_segments(reader) >= 2


def _sd(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(v)
    return {
        "w": torch.randn(1024, 257, device="cuda", generator=g).to(torch.bfloat16),
        "b": {"c": torch.arange(10, device="cuda") + v},
    }


def test_device_memory_in_one_process():
    with tidal.store.connect(keep=1) as writer, tidal.store.connect(writer.address) as reader:
        into = {
            "w": torch.empty(257, 1024, device="cuda", dtype=torch.bfloat16).t(),
            "b": {"c": torch.zeros(10, device="cuda", dtype=torch.int64)},
        }
        for v in range(5):
            writer.put_state_dict(_sd(v), "policy", memory="cuda")
            reader.get_state_dict("policy", into=into)
            assert torch.equal(into["w"], _sd(v)["w"]) and torch.equal(
                into["b"]["c"], _sd(v)["b"]["c"]
            )
            host = writer.get_state_dict("policy")  # the writer reads its own GPU memory too
            assert host["w"].device.type == "cpu" and torch.equal(host["w"].cuda(), _sd(v)["w"])
        assert writer.ls()["entries"][0]["volumes"][0].startswith("cuda.")
        # keep=1 and the slots reserved for the next put: 2 allocations per tensor.
        assert testing.device_allocations(writer) == 4
        writer.put("other", torch.ones(3, device="cuda"))  # no memory=: host shared memory
        assert writer.ls("other")["entries"][0]["volumes"] == ["v0"]


def test_device_memory_across_processes(monkeypatch):
    from tests.store import _gpu_procs
    from tests.store.conftest import until_waited_for
    from tidal.store import progress

    monkeypatch.setattr(progress, "PROGRESS_BYTES", 1)  # the writer reports every tensor

    with (
        tidal.store.connect(keep=1) as store,
        tidal.store.connect(store.address) as writer,
        _gpu_procs.reader_process(store.address) as parent,
    ):
        reports = _gpu_procs.progress_reports(writer)
        # A reader waiting for a key's first version: every slot is new to it.
        parent.send(("wait", "fresh", 0))
        assert parent.recv() == "waiting"
        until_waited_for(store, "fresh", 0)
        writer.put_state_dict(_gpu_procs.payload(0), "fresh", version=0, memory="cuda")
        assert parent.recv() == ("ok", 0)
        for v in range(4):
            writer.put_state_dict(_gpu_procs.payload(v), "policy", version=v, memory="cuda")
            parent.send(("get", "policy", v))
            assert parent.recv() == ("ok", v)
        # A reader waiting for the next version streams it from the writer's GPU memory.
        parent.send(("wait", "policy", 4))
        assert parent.recv() == "waiting"
        until_waited_for(store, "policy", 4)
        reports.clear()
        writer.put_state_dict(_gpu_procs.payload(4), "policy", version=4, memory="cuda")
        assert parent.recv() == ("ok", 4)
        assert reports, "the writer reported no progress to the waiting reader"
        # The writer goes away: its GPU memory, and the versions in it, are lost.
        writer.close()
        parent.send(("get", "policy", 4))
        kind, msg = parent.recv()
        assert kind == "VolumeLostError" and "GPU memory of a writer" in msg, msg


def test_a_put_of_gpu_memory_is_ordered_on_the_callers_stream():
    """A put of GPU memory returns once its copies are queued: they run after the caller's
    queued work and before its later work (tidal/store/transports/cuda/ipc.py, Ordering)."""
    with tidal.store.connect(keep=1) as writer, tidal.store.connect(writer.address) as reader:
        src = torch.zeros(64 << 20, device="cuda")  # 256 MB
        for v in range(3):
            torch.cuda._sleep(300_000_000)  # keeps the caller's stream busy for ~0.15 s
            src.fill_(float(v))  # queued behind the sleep: the value to store
            writer.put("x", src, memory="cuda")
            src.fill_(-1.0)  # queued after the put: must not reach the stored bytes
            assert torch.equal(reader.get("x", into=torch.empty_like(src)), torch.full_like(src, v))


def test_a_reader_in_another_process_waits_for_the_writers_copies():
    """The writer commits before its copies have run (its stream is busy); the reader's
    copies wait for the writer's interprocess event, so it never sees old bytes."""
    from tests.store import _gpu_procs

    with (
        tidal.store.connect(keep=1) as store,
        tidal.store.connect(store.address) as writer,
        _gpu_procs.reader_process(store.address) as parent,
    ):
        for v in range(4):
            torch.cuda._sleep(300_000_000)  # ~0.15 s: the copies run well after commit
            writer.put_state_dict(_gpu_procs.payload(v), "p", version=v, memory="cuda")
            parent.send(("get", "p", v))  # the reader checks every byte
            assert parent.recv() == ("ok", v)


def test_a_streaming_reader_waits_for_the_writers_copies():
    """A reader already waiting for each next version (a streaming read: an RL generator's
    prefetch) while the writer's stream is busy. From a key's third put on, the writer's
    slots are reserved: it queues every copy, then reports every slot to the waiting reader
    at once, before the copies ran. The reader waits for the writer's event before its first
    copy, so it never sees an older version's bytes (found by the RL generator's GPU test)."""
    from tests.store import _gpu_procs
    from tests.store.conftest import until_waited_for

    with (
        tidal.store.connect(keep=1) as store,
        tidal.store.connect(store.address) as writer,
        _gpu_procs.reader_process(store.address) as parent,
    ):
        reports = _gpu_procs.progress_reports(writer)
        for v in range(5):
            parent.send(("wait", "p", v))
            assert parent.recv() == "waiting"
            until_waited_for(store, "p", v)
            torch.cuda._sleep(300_000_000)  # ~0.15 s: the copies run well after the report
            writer.put_state_dict(_gpu_procs.payload(v), "p", version=v, memory="cuda")
            assert parent.recv() == ("ok", v)  # the reader checks every byte
        assert reports, "the writer reported no progress to the waiting reader"


@pytest.mark.parametrize("memory", ["host", "cuda"])
def test_async_copies_wait_for_the_callers_queued_work(memory):
    """put_async/get_async copy on a side stream, but only after the work the caller queued
    before the call: a value written by a kernel still queued is the one stored."""
    with tidal.store.connect() as store:
        src = torch.zeros(2048, 2048, device="cuda")
        torch.cuda._sleep(200_000_000)  # keeps the caller's stream busy for ~0.1 s
        src.fill_(7.0)  # queued behind the sleep
        store.put_async("x", src, memory=memory).result(timeout=60)
        assert torch.equal(store.get("x"), torch.full((2048, 2048), 7.0))
        dst = torch.empty_like(src)
        torch.cuda._sleep(200_000_000)
        dst.fill_(-1.0)  # the caller's last write before the prefetch lands
        store.get_async("x", into=dst).result(timeout=60)
        assert torch.equal(dst, torch.full_like(src, 7.0))
        sd = {"a": src * 2, "b": [src[:3] + 1]}
        torch.cuda._sleep(200_000_000)
        sd["a"].add_(1.0)
        store.put_state_dict_async(sd, "sd", memory=memory).result(timeout=60)
        got = store.get_state_dict("sd")
        assert torch.equal(got["a"], torch.full((2048, 2048), 15.0))
        assert torch.equal(got["b"][0], torch.full((3, 2048), 8.0))


def _copiers():
    from tidal.store.transports.cuda import ipc
    from tidal.store.transports.cuda.gather import GatherCopier

    chosen = ipc.copier()
    if isinstance(chosen, GatherCopier):
        return {"kernel": chosen, "batch": chosen.fallback}
    return {"batch": chosen}


@pytest.mark.parametrize("path", ["kernel", "batch"])
def test_state_dict_copies_go_as_one_call(path, monkeypatch):
    """A put and a get of a state dict in GPU memory issue one gather kernel
    (tidal/store/transports/cuda/gather.py: Triton) or one cuMemcpyBatchAsync
    (cuda/batch.py) per device, with the same bytes as copies one at a time, also when
    plans are replayed and slots change; pairs the kernel does not take (2-byte sizes) and
    tensors of several chunks included."""
    from tidal.store.transports.cuda import ipc

    copier = _copiers().get(path)
    if copier is None:
        pytest.skip("Triton is not installed: no gather kernel")
    if path == "batch" and not copier.supported:
        pytest.skip("this CUDA driver has no cuMemcpyBatchAsync (12.8 and later)")
    monkeypatch.setattr(ipc, "copier", lambda: copier)
    sd = {f"w{i}": torch.randn(64 + i, 96, device="cuda") for i in range(24)}
    sd["odd"] = torch.randn(3, 5, device="cuda", dtype=torch.bfloat16)  # 30 bytes
    sd["big"] = torch.randn(3 * 262144 + 3, device="cuda")  # 3 MB and 12 bytes: 4 chunks
    into = {k: torch.empty_like(t) for k, t in sd.items()}
    count = (lambda: copier.launches) if path == "kernel" else (lambda: copier.batches)
    with tidal.store.connect(keep=1) as writer, tidal.store.connect(writer.address) as reader:
        writer.put_state_dict(sd, "p", memory="cuda")  # starts building the kernel
        if path == "kernel":
            assert copier.ready(timeout=120), "the kernel did not build (see the warning)"
        before = count()
        for v in range(6):  # ring slots, kept plans replayed
            for t in sd.values():
                t.add_(1.0)
            writer.put_state_dict(sd, "p", memory="cuda")
            reader.get_state_dict("p", into=into)
            for k in sd:
                assert torch.equal(into[k], sd[k]), (v, k)
        assert not getattr(copier, "failed", False), "the kernel failed (see the warning)"
        assert copier.batching or path == "kernel", "a batched copy failed (see the warning)"
        assert count() - before >= 12  # a put and a get each round


def test_warm_up_builds_the_copy_kernel_before_the_first_get():
    """tidal.store.warm_up_cuda: the kernel is built when it returns, so a process's first
    state-dict copies already go as one launch."""
    from tidal.store.transports.cuda import ipc
    from tidal.store.transports.cuda.gather import GatherCopier

    copier = ipc.copier()
    if not isinstance(copier, GatherCopier):
        pytest.skip("Triton is not installed: no gather kernel")
    assert tidal.store.warm_up_cuda(timeout=120) and copier.ready(0)
    sd = {f"w{i}": torch.randn(32, 32, device="cuda") for i in range(8)}
    into = {k: torch.empty_like(t) for k, t in sd.items()}
    with tidal.store.connect() as store:
        before = copier.launches
        store.put_state_dict(sd, "p", memory="cuda")
        store.get_state_dict("p", into=into)
        assert copier.launches - before == 2
    assert all(torch.equal(into[k], sd[k]) for k in sd)
