"""Checkpoints on CUDA: pinned staging on a side stream, async saves and exact resume.
Skipped without CUDA (run with `pytest -m gpu tests/train/test_checkpoint_gpu.py`)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.train.test_checkpoint import step_records, train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = ("--job.device", "cuda")


@pytest.mark.parametrize("shared", [False, True], ids=["own_buffers", "shared_segment"])
def test_pinned_staging_copies_the_values_of_the_save_not_later_updates(shared):
    """Shared: the buffers of the writer process's segment, page-locked with
    cudaHostRegister, so the copy is as asynchronous (and as fast) as into pinned tensors."""
    from tidal.train.checkpoint.staging import PinnedStaging

    device = torch.device("cuda", torch.cuda.current_device())
    weights = {f"w{i}": torch.full((4096, 4096), float(i), device=device) for i in range(8)}
    weights["step"] = torch.tensor(3.0, device=device)  # 0-dim, like fused AdamW's step
    flat = {**weights, "train_state": '{"step": 3}'}
    staging = PinnedStaging(device, shared=shared)
    for round_ in range(2):  # the first allocates and pins the buffers, the second reuses them
        # Queued kernels that write the weights: the copy must run after them.
        for w in weights.values():
            w.add_(1.0)
        start = time.perf_counter()
        staged = staging.stage(flat)
        queued_s = time.perf_counter() - start
        staging.wait_before_update()  # the compute stream waits for the copy, the host not
        for w in weights.values():
            w.mul_(100.0)  # an "optimizer step" right after the save
        staging.wait_copied()
        for k, w in weights.items():
            buf = staged[k]
            assert buf.device.type == "cpu" and buf.is_pinned(), k
            expected = (w / 100.0).cpu()
            assert torch.equal(buf, expected), (round_, k)
        assert staged["train_state"] == '{"step": 3}'
        if round_ == 1:
            assert queued_s < 0.05, queued_s  # stage() only queues 512 MB of copies
        for w in weights.values():
            w.div_(100.0)
    if shared:
        assert staging.segment is not None and staging.segment.pinned
    staging.close()


def test_async_pinned_saves_do_not_change_losses_on_cuda(tmp_path):
    sync, pinned = tmp_path / "sync", tmp_path / "pinned"
    common = (*CUDA, "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0")
    train(sync, *common)
    train(pinned, *common, "--checkpoint.async_mode", "async_with_pinned_mem")
    assert step_records(pinned) == step_records(sync)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for step in (2, 10, 20):
        dcp_to_torch_save(sync / f"checkpoint/step-{step}", tmp_path / "a.pt")
        dcp_to_torch_save(pinned / f"checkpoint/step-{step}", tmp_path / "b.pt")
        a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
        for k, v in a.items():
            if isinstance(v, torch.Tensor) and not k.startswith("rng."):
                assert torch.equal(v, b[k]), (step, k)


def test_resume_on_cuda_is_exact_and_restores_the_cuda_rng(tmp_path):
    from tests.train.test_checkpoint import rng_states_across_a_resume

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, *CUDA)
    saved, restored = rng_states_across_a_resume(resumed, *CUDA)
    assert torch.equal(saved["cuda"], restored["cuda"])
    ref, got = step_records(straight), step_records(resumed)
    assert [got[s] for s in range(11, 21)] == [ref[s] for s in range(11, 21)]
