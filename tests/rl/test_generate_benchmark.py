"""benchmarks/generate.py's timing on CPU, with the Generator's CUDA path (compiled prefill
and decode) run through dynamo's `eager` backend, which traces as torch.compile does but
makes no kernels: a Generator's second call compiles (its first prefill runs eagerly), so the
benchmark warms up until a call compiles nothing, and its timed call then compiles nothing.

This is how an H200 run reported batch-1 greedy at 5 new tokens/s with 1.46 ms decode steps:
one warm-up call left the prefill's compile inside the timed call."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest
import torch
import torch._dynamo

from tidal.models import Transformer, get_flavor
from tidal.rl import Generator, GeneratorConfig, SamplingParams

BENCHMARK = Path(__file__).parents[2] / "benchmarks" / "generate.py"


@pytest.fixture
def bench():
    spec = importlib.util.spec_from_file_location("benchmark_generate", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def compiled_generator(monkeypatch):
    """A Generator compiling its prefill and decode steps as on CUDA (no CUDA graphs)."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))

    def make() -> Generator:
        with torch.device("meta"):
            model = Transformer(get_flavor("tiny"))
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
        gen = Generator(model, config=GeneratorConfig(max_batch=2, max_seq_len=48))
        gen._compile_on = True  # what compile=None gives on CUDA
        gen._setup_compile()
        return gen

    yield make
    torch._dynamo.reset()


def test_the_timed_call_compiles_nothing(bench, compiled_generator):
    prompts = [[1, 5, 9, 3, 7, 2, 8, 4], [1, 6, 2, 2, 9, 4, 3, 3]]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(), seed=1)

    gen = compiled_generator()
    counts = [bench.compiles()]
    for _ in range(3):
        gen.generate(prompts, params)
        counts.append(bench.compiles())
    # Call 1 compiles the decode step, call 2 the prefill (call 1 ran it eagerly), call 3
    # nothing: a single warm-up call left a compile in the timed one.
    assert counts[1] > counts[0] and counts[2] > counts[1] and counts[3] == counts[2]

    torch._dynamo.reset()  # dynamo's caches would serve a second Generator of the same shapes
    gen = compiled_generator()
    assert bench.warm_up(lambda: gen.generate(prompts, params), gen.stats) == 3
    before = bench.compiles()
    gen.generate(prompts, params)
    assert bench.compiles() == before
