"""The sampler's row reductions in chunks (`row_stats`) against whole-row torch ops, and
`tidal.generate.sample` against the plain formulation it replaced (benchmarks/sampler.py's
baseline): the same tokens, log-probs at fp32 rounding, bitwise in batch-invariant mode."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tidal.generate.sampler import ROW_CHUNK, row_stats, sample

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plain_sample():
    path = ROOT / "benchmarks" / "sampler.py"
    spec = importlib.util.spec_from_file_location("benchmark_sampler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.plain_sample


def rows_with_ties(B: int, V: int, seed: int = 0) -> torch.Tensor:
    """fp32 rows of bf16 values (many ties), with ties of the max across chunk boundaries,
    a row whose max is its last entry, and long runs of -inf."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, V, generator=g) * 3).bfloat16().float()
    x[0, [V // 3, V - 1]] = x[0].max() + 1  # the first of two equal maxima wins
    x[1, -1] = x[1].max() + 1
    x[2, : V // 2] = -math.inf  # whole chunks of -inf
    x[3] = x[3].round()
    return x


@pytest.mark.parametrize("V", [7, 1000, 2049, 5000])
@pytest.mark.parametrize("chunks", [None, 1, 2, 3, "default"])
def test_row_stats_are_argmax_max_and_logsumexp(V, chunks):
    x = rows_with_ties(5, V)
    noise = torch.rand(5, V, generator=torch.Generator().manual_seed(1))
    noise[4] = 0.0
    c = -(-V // ROW_CHUNK) if chunks == "default" else chunks
    for n in (None, noise):
        arg, top, lse = row_stats(x, n, chunks=c)
        y = x if n is None else x + n
        assert torch.equal(arg, y.argmax(-1))  # exact, first index on ties
        assert torch.equal(top, x.amax(-1))
        torch.testing.assert_close(lse, torch.logsumexp(x.double(), -1).float())


def test_row_stats_chunk_in_compiled_code():
    """Inside torch.compile the rows are cut into chunks of at most ROW_CHUNK entries (what
    the GPU's step runs; here traced by dynamo and run by its eager backend)."""
    x = rows_with_ties(4, 3 * ROW_CHUNK + 5)
    seen = []

    def stats(x):
        seen.append(torch.compiler.is_compiling())
        return row_stats(x)

    got = torch.compile(stats, backend="eager", fullgraph=True)(x)
    assert seen == [True]
    for a, b in zip(got, row_stats(x, chunks=4), strict=True):
        assert torch.equal(a, b)


def batch_params(B: int, greedy: bool) -> dict:
    temperature = torch.tensor([0.0, 0.7, 1.3, 1.0, 0.0, 2.0, 0.5, 1.0][:B])
    return dict(
        temperature_B=torch.zeros(B) if greedy else temperature,
        top_k_B=torch.tensor([0, 5, 0, 50, 3, 0, 0, 7][:B]),
        top_p_B=torch.tensor([1.0, 0.9, 1.0, 0.5, 0.3, 1.0, 0.99, 1.0][:B]),
        min_p_B=torch.tensor([0.0, 0.05, 0.1, 0.0, 0.5, 0.0, 0.2, 1.0][:B]),
        keys_B=torch.arange(B) * 7919 + 3,
        steps_B=torch.arange(B),
    )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("variant", ["greedy", "sampled", "truncated"])
def test_sample_matches_the_plain_formulation(plain_sample, variant, compiled):
    """Same tokens (greedy rows of a sampled batch included), log-probs at fp32 rounding;
    in batch-invariant mode bitwise the same."""
    x = rows_with_ties(8, 2 * ROW_CHUNK + 77).bfloat16()
    x[2] = x[5]  # the -inf row would leave nothing to sample from
    kw = dict(sampled=variant != "greedy", truncate=variant == "truncated")
    fn = torch.compile(sample, backend="eager") if compiled else sample
    params = batch_params(8, variant == "greedy")
    # Batch-invariant mode is never compiled (its dispatch mode would break the graph).
    for batch_invariant in (False,) if compiled else (False, True):
        want = plain_sample(x, **params, **kw, batch_invariant=batch_invariant)
        got = fn(x, **params, **kw, batch_invariant=batch_invariant)
        assert torch.equal(got[0], want[0])
        for g, w in zip(got[1:], want[1:], strict=True):
            if batch_invariant:
                assert torch.equal(g, w)
            else:
                torch.testing.assert_close(g, w, rtol=0, atol=2e-5)
    torch._dynamo.reset()


def test_sampler_benchmark_smoke():
    p = subprocess.run(
        [
            sys.executable,
            "benchmarks/sampler.py",
            "--device",
            "cpu",
            "--batches",
            "1",
            "3",
            "--vocab",
            "3000",
            "--iters",
            "2",
        ],
        cwd=ROOT,
        env={
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "TIDAL_CACHE_DIR": os.environ["TIDAL_CACHE_DIR"],
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("tokens equal True") == 4, p.stdout
