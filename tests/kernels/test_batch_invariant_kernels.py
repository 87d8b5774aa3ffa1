"""The Triton batch-invariant kernels (tidal/kernels/batch_invariant.py): on CPU under
Triton's interpreter, and on CUDA under the `gpu` marker, against torch and the torch path of
batch-invariant mode.

The interpreter must be switched on before triton is first imported, which another test of
the session may have done: the CPU checks (tests/kernels/_cases.py) run in a subprocess with
TRITON_INTERPRET=1, on tiny shapes and blocks (every program runs in Python).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
CASES = ("matmul", "rows", "attention")


def test_kernels_under_the_triton_interpreter():
    """Values close to torch's; every row's bits the same in a batch of 1 and of many (matmul,
    RMSNorm, log-softmax, token log-probs); a TP rank's half of the K parts adds up to the
    whole's bits; attention's decode rows bitwise its prefill rows, alone or beside other
    sequences of other lengths. About 20 s on a loaded 2-core machine."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "kernels" / "_cases.py"), *CASES],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


@pytest.mark.slow
def test_the_mode_runs_the_kernels_under_the_interpreter():
    """Batch-invariant mode's Triton path wired into the tiny model (on CPU tensors under the
    interpreter): each row's log-probs bitwise the same in a batch and alone, and close to
    the torch path's."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "kernels" / "_cases.py"), "model"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_on_cuda(case):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter is on in this process")
    from tests.kernels import _cases

    getattr(_cases, case)("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_path_against_the_torch_path(dtype):
    """The tiny model's log-probs in batch-invariant mode with the Triton kernels: close to
    the torch path's, bitwise equal to the generator's with the same kernels, and each row's
    bits the same in a batch of 3 and alone."""
    from tests.generate.conftest import tiny_model
    from tidal.generate import (
        Generator,
        GeneratorConfig,
        SamplingParams,
        completion_logprobs,
        logprobs,
    )
    from tidal.models import batch_invariant as bi

    model = tiny_model().to("cuda", dtype)
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        torch_path = logprobs(model, ids, batch_invariant=True)
        bi.use_triton(True)
        try:
            triton_path = logprobs(model, ids, batch_invariant=True)
            for b in range(3):
                alone = logprobs(model, ids[b : b + 1], batch_invariant=True)
                assert torch.equal(alone[0], triton_path[b]), b
            gen = Generator(
                model,
                config=GeneratorConfig(
                    max_batch=3, max_seq_len=96, batch_invariant=True, compile=False,
                    cuda_graphs=False,
                ),
            )  # fmt: skip
            params = [
                SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=i) for i in range(3)
            ]
            samples = [
                s for g in gen.generate([[1, 5, 7], [4], list(range(2, 30))], params) for s in g
            ]
            trainer = completion_logprobs(model, samples, batch_invariant=True)
            for s, lp in zip(samples, trainer, strict=True):
                assert torch.equal(torch.tensor(s.logprobs, device=lp.device), lp)
        finally:
            bi.use_triton(False)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(triton_path, torch_path, atol=tol, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_inside_torch_compile():
    """The kernels are custom ops (torch.library.triton_op, `torch.ops.tidal.bi_*`): a
    compiled function calling them gives the eager bits, without a graph break."""
    from tidal.kernels import batch_invariant as tk

    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 256, generator=g).cuda().bfloat16()
    w = torch.randn(512, 256, generator=g).cuda().bfloat16()
    scale = torch.rand(256, generator=g).cuda().bfloat16()

    def f(x):
        h, _ = tk.rms_norm(x, scale, 1e-5)
        return tk.log_softmax(tk.matmul(h, w.t(), parts=8), dtype=torch.float32)

    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(x), f(x))
    assert torch.equal(compiled(x[:5]), f(x)[:5])
