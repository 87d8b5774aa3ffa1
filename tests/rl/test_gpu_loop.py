"""A whole `tidal rl` job on one CUDA device (tests/rl/loop_configs.py:cuda_async): the
trainer publishes each policy version into its own GPU memory, the generator reads it device
to device (CUDA IPC) and, in async mode, into GPU staging slots that it swaps into its live
parameters at batch starts and between decode steps. Every version the generator held equals
the trainer's published weights cast to bf16, bit for bit. Skipped without CUDA
(`pytest -m gpu tests/rl/test_gpu_loop.py`)."""

from __future__ import annotations

import pytest
import torch

from tests.rl._cli import NO_PLOT, records, run_rl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA_ASYNC = "tests/rl/loop_configs.py:cuda_async"
STEPS = 8


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_generator_holds_the_trainers_weights_bitwise_on_one_gpu(tmp_path, monkeypatch, mode):
    """The trainer (bf16 mixed precision, fp32 weights) and one bf16 generator share the GPU;
    the versions live in the trainer's GPU memory (store.policy_memory auto: cuda). The
    generator's parameters are saved where it starts, at every swap (at a batch start or in
    flight) and at every batch and evaluation of the sync loop (`_write_weights` in
    tests/rl/loop_configs.py, which also stalls the trainer's stream before each publish),
    and compared with the trainer's at the same version."""
    weights = tmp_path / "weights"
    weights.mkdir()
    monkeypatch.setenv("TIDAL_TEST_WEIGHTS", str(weights))
    out = tmp_path / "run"
    r = run_rl(
        out,
        "--rl.mode",
        mode,
        "--rl.steps",
        str(STEPS),
        *NO_PLOT,
        config=CUDA_ASYNC,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout
    assert "generator 0: on cuda:0 (torch.bfloat16)" in r.stdout
    steps, evals = records(out)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    evaluated = [e["step"] for e in evals]
    if mode == "sync":
        assert evaluated == [0, 4, 8], evaluated  # rl.eval_every 4
    else:  # the eval versions it holds at a feed point, and the last
        assert {0, STEPS} <= set(evaluated), evaluated

    published = {v: torch.load(weights / f"trainer-v{v}.pt") for v in range(STEPS + 1)}
    assert {t["memory"] for t in published.values()} == {"cuda"}  # read by CUDA IPC
    trainer = {v: t["params"] for v, t in published.items()}
    wq = "layers.0.attention.wq.weight"
    assert not torch.equal(trainer[0][wq], trainer[STEPS][wq])  # training moved them
    names = {p.stem.rpartition("-v")[0] for p in weights.glob("generator*.pt")}
    assert names == {"generator0-rank0"}  # one generator, on one rank
    held = {
        int(p.stem.rpartition("-v")[2]): torch.load(p)
        for p in weights.glob("generator0-rank0-v*.pt")
    }
    by = {v: got["by"] for v, got in sorted(held.items())}
    if mode == "sync":  # each batch's version, and the last one (evaluated)
        assert by == {v: "generate" for v in range(STEPS + 1)}
    else:
        assert by[0] == "start" and held[0]["staging"] == "cuda", by  # GPU staging slots
        assert STEPS in by, by  # evaluated
        # Swapped in between decode steps: seen by the swap hook, and counted in the metrics.
        assert "in flight" in by.values(), by
        assert sum(s["weight_swaps_in_flight"] for s in steps) > 0
    differ = []
    for v, got in sorted(held.items()):
        params = got["params"]
        assert params.keys() == trainer[v].keys()
        assert all(t.dtype == torch.bfloat16 for t in params.values())
        wrong = [k for k, t in trainer[v].items() if not torch.equal(params[k], t)]
        if wrong:  # the versions each wrong tensor equals instead (an older one: stale bytes)
            was = {k: [u for u in trainer if torch.equal(params[k], trainer[u][k])] for k in wrong}
            differ.append(
                f"version {v} ({got['by']}): {len(wrong)} of {len(params)} tensors "
                f"differ, e.g. {list(was.items())[:3]}"
            )
    assert not differ, "the generator held other weights than the trainer's:\n" + "\n".join(differ)
