"""benchmarks/generate.py's timing on CPU, with the Generator's CUDA path (compiled prefill
and decode) run through dynamo's `eager` backend, which traces as torch.compile does but
makes no kernels: a Generator's second call compiles (its first prefill runs eagerly), so
warming up by calls needs several; `Generator.warm_up` pays every first use at once, and no
call after it compiles, ragged rows (every bucket, other prompt widths) included.

This is how an H200 run reported batch-1 greedy at 5 new tokens/s with 1.46 ms decode steps:
one warm-up call left the prefill's compile inside the timed call."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo

from tidal.generate import Generator, GeneratorConfig, SamplingParams
from tidal.models import Transformer, get_flavor

BENCHMARK = Path(__file__).parents[2] / "benchmarks" / "generate.py"


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("benchmark_generate", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered while it runs, as an import would: its dataclasses look their module up.
    monkeypatch.setitem(sys.modules, spec.name, module)
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
        gen.compile_for_testing()  # what compile=None gives on CUDA
        return gen

    yield make
    torch._dynamo.reset()


def test_the_timed_call_compiles_nothing(bench, compiled_generator):
    """After the benchmark's warm-up (Generator.warm_up, then one untimed call), neither the
    untimed call nor later ones compile: uniform rows, and ragged ones that run buckets 2
    and 1 with other prompt widths. (Warming up by calls instead took three: call 1 compiled
    the decode step, call 2 the prefill, which call 1 ran eagerly.)"""
    prompts = [[1, 5, 9, 3, 7, 2, 8, 4], [1, 6, 2, 2, 9, 4, 3, 3]]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(), seed=1)

    gen = compiled_generator()
    call_prompts, call_params = bench.ragged(params, prompts, 8)
    assert [len(p) for p in call_prompts] == [4, 8]
    assert [p.max_new_tokens for p in call_params] == [4, 8]
    warm = bench.warm_up(gen, params, call_prompts, call_params)
    assert warm["warmup_graphs"] > 0 and warm["compiles_after_warmup"] == 0, warm
    before = bench.compiles()
    for p in (params, call_params):
        gen.generate(prompts, p)
    assert bench.compiles() == before


def test_variants_follow_the_flags_in_run_order(bench):
    from argparse import Namespace

    every = Namespace(plain_sampler=True, fuse_projections=True, no_batch_invariant=False)
    assert bench.variants(every) == [
        bench.Variant("tidal"),
        bench.Variant("plain_sampler", sampler="plain"),
        bench.Variant("fused", fuse=True),
        bench.Variant("batch_invariant", batch_invariant=True),
    ]
    fewest = Namespace(plain_sampler=False, fuse_projections=False, no_batch_invariant=True)
    assert [v.name for v in bench.variants(fewest)] == ["tidal"]


def test_the_plain_sampler_is_the_one_decode_steps_call(bench, monkeypatch):
    """`--plain-sampler` swaps the sampler where the decode steps look it up (it once patched
    a module that no longer used it, and the run failed)."""
    monkeypatch.syspath_prepend(str(BENCHMARK.parent))
    import sampler as baseline  # benchmarks/sampler.py

    calls = []
    real = baseline.plain_sample
    monkeypatch.setattr(baseline, "plain_sample", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.device("meta"):
        model = Transformer(get_flavor("tiny"))
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    gen = Generator(model, config=GeneratorConfig(max_batch=2, max_seq_len=48))
    import tidal.generate.steps as steps

    own = steps.sample
    with bench.sampler_in_generator("plain"):
        ((s,),) = gen.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
    assert s.completion_ids and len(calls) >= len(s.completion_ids)
    assert steps.sample is own  # put back after the block
