"""Generator on CUDA: compiled decode in CUDA graphs (the whole step, or one block shared by
every layer: compile_scope="blocks"), weight updates under captured graphs, batch-invariant
bf16 parity. Skipped without CUDA (`pytest -m gpu tests/generate/test_gpu.py`)."""

import pytest
import torch
from torch._dynamo.utils import counters

from tests.generate._cuda import (
    MAX_GAP_BF16,
    MEAN_GAP_BF16,
    PROMPTS,
    SCOPES,
    check_graphs_follow_weight_loads,
    completion_ids,
    cuda_model,
)
from tidal.generate import (
    Generator,
    GeneratorConfig,
    SamplingParams,
    completion_logprobs,
    logprobs,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("fresh_dynamo"),
]

EAGER = dict(compile=False, cuda_graphs=False)


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize(
    "kw",
    [{}, {"tune_kernels": True}, {"compile_scope": "blocks"}],
    ids=["default", "tune_kernels", "compiled_blocks"],
)
def test_compiled_graph_decode_matches_eager(kw):
    model = cuda_model()
    params = SamplingParams(temperature=0, max_new_tokens=40)
    fast = Generator(model, config=GeneratorConfig(max_batch=8, max_seq_len=256, **kw))
    assert fast.compiles and fast.captures
    assert (fast.blocks is not None) == (kw.get("compile_scope") == "blocks")
    got = fast.generate(PROMPTS, params)
    assert fast.stats.graphs_captured >= 1
    ref = Generator(model, config=GeneratorConfig(max_batch=8, max_seq_len=256, **EAGER))
    want = ref.generate(PROMPTS, params)
    assert completion_ids(got) == completion_ids(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(
            torch.tensor(g[0].logprobs), torch.tensor(w[0].logprobs), atol=1e-3, rtol=0
        )
    # Sampled with truncation: a second sampler variant, the same seeded tokens as eager.
    sampled = SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=24)
    assert completion_ids(fast.generate(PROMPTS, sampled)) == completion_ids(
        ref.generate(PROMPTS, sampled)
    )


@SCOPES
def test_graphs_stay_valid_across_load_weights(scope):
    check_graphs_follow_weight_loads(scope)


@pytest.mark.parametrize("precision", ["bf16 weights", "fp32 weights + bf16 autocast"])
def test_batch_invariant_bf16_logprobs_are_bitwise_the_trainers(precision):
    autocast = precision.startswith("fp32")
    model = cuda_model(dtype=torch.float32 if autocast else torch.bfloat16)
    config = GeneratorConfig(
        max_batch=4,
        max_seq_len=256,
        check_every=4,
        batch_invariant=True,
        amp_dtype="bf16" if autocast else None,
    )
    gen = Generator(model, config=config)
    assert gen.captures and not gen.compiles  # graphs of the eager kernels
    params = [SamplingParams(n=2, temperature=1.0, max_new_tokens=48, seed=i) for i in range(5)]
    samples = [s for g in gen.generate(PROMPTS, params) for s in g]
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else torch.no_grad()
    with torch.no_grad(), ctx:
        batched = completion_logprobs(model, samples, batch_invariant=True)
        for s, lp in zip(samples, batched, strict=True):
            assert torch.equal(torch.tensor(s.logprobs), lp.cpu()), (s.prompt_index, s.sample_index)
            (alone,) = completion_logprobs(model, [s], batch_invariant=True)
            assert torch.equal(alone, lp)
    # Another batch composition gives the same tokens and log-probs.
    other = Generator(
        model,
        config=GeneratorConfig(
            max_batch=2, max_seq_len=256, batch_invariant=True, amp_dtype=config.amp_dtype
        ),
    )
    again = [s for g in other.generate(PROMPTS, params) for s in g]
    assert [s.completion_ids for s in again] == [s.completion_ids for s in samples]
    assert [s.logprobs for s in again] == [s.logprobs for s in samples]


@SCOPES
def test_normal_mode_bf16_logprob_gap_is_bounded(record_property, scope):
    """Documented bound outside batch-invariant mode, bf16 on CUDA: max |diff| < 0.09 and
    mean |diff| < 0.018 between generator and trainer log-probs (compiled decode)."""
    model = cuda_model(dtype=torch.bfloat16)
    gen = Generator(
        model, config=GeneratorConfig(max_batch=8, max_seq_len=256, compile_scope=scope)
    )
    samples = [s for g in gen.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=64)) for s in g]
    with torch.no_grad():
        trainer = completion_logprobs(model, samples)
    diff = torch.cat(
        [torch.tensor(s.logprobs) - t.cpu() for s, t in zip(samples, trainer, strict=True)]
    )
    diff = diff.abs()
    record_property("max_abs_diff", float(diff.max()))
    record_property("mean_abs_diff", float(diff.mean()))
    print(
        f"bf16 generator ({scope}) vs trainer log-probs: max {diff.max():.4g}, "
        f"mean {diff.mean():.4g}"
    )
    assert diff.max() < MAX_GAP_BF16 and diff.mean() < MEAN_GAP_BF16


@SCOPES
def test_continuous_batching_on_cuda_finishes_everything(scope):
    model = cuda_model(dtype=torch.bfloat16)
    gen = Generator(
        model, config=GeneratorConfig(max_batch=4, max_seq_len=256, compile_scope=scope)
    )
    params = [
        SamplingParams(n=2, temperature=1.0, max_new_tokens=n, seed=n) for n in (5, 60, 17, 3, 33)
    ]
    before = _graphs()
    groups = gen.generate(PROMPTS, params)
    groups = gen.generate(PROMPTS, params)  # the second call compiles the prefill
    graphs = _graphs() - before
    print(f"{scope}: {graphs} dynamo graphs for buckets 4, 2, 1 and the prefill")
    if scope == "blocks":
        # The block (6 layers): bucket 4, then one graph dynamic in the batch, bucket 1 (size
        # 1 is specialized), and 1-2 for the prefill (batch and time dynamic); the sampler:
        # the same 3 as the block's decode. One graph per layer would be >= 18.
        assert graphs <= 10, graphs
    assert [len(s.completion_ids) for g in groups for s in g] == [
        5,
        5,
        60,
        60,
        17,
        17,
        3,
        3,
        33,
        33,
    ]


@SCOPES
def test_warm_up_leaves_nothing_to_compile_or_capture(scope):
    """`Generator.warm_up` compiles and captures every bucket and sampler variant asked for:
    afterwards continuous batching through buckets 8, 4, 2, 1, prompts of other counts and
    widths, greedy and sampled, make no dynamo graph and capture no CUDA graph, and give
    eager's tokens (the warm-up leaves the rows as they were)."""
    model = cuda_model()
    gen = Generator(
        model, config=GeneratorConfig(max_batch=8, max_seq_len=256, compile_scope=scope)
    )
    sampled = [
        SamplingParams(n=2, temperature=1.0, max_new_tokens=n, seed=n) for n in (5, 40, 17, 3, 24)
    ]
    greedy = SamplingParams(temperature=0, max_new_tokens=24)
    seconds = gen.warm_up([sampled[0], greedy])
    captured, graphs = gen.stats.graphs_captured, _graphs()
    print(f"{scope}: warm-up {seconds:.1f} s, {graphs} dynamo graphs, {captured} CUDA graphs")
    assert captured == 2 * len(gen.buckets) and gen.stats.prefill_calls == 0
    # The count is not bounded here: dynamo's counters are process-wide, so it holds earlier
    # tests' graphs too (on the H200, 2026-12-02: "blocks" printed 18 after the "step" case
    # and 8 when run alone, as CPU dynamo traces in tests/generate/test_generator.py). What matters
    # is that nothing compiles after the warm-up, checked below.
    ref = Generator(model, config=GeneratorConfig(max_batch=8, max_seq_len=256, **EAGER))
    for prompts, params in [
        (PROMPTS, sampled),
        (PROMPTS, greedy),
        (PROMPTS[1:4], sampled[:3]),
        (PROMPTS[4:], greedy),
        (PROMPTS[:2], sampled[1]),
    ]:
        assert completion_ids(gen.generate(prompts, params)) == completion_ids(
            ref.generate(prompts, params)
        )
    assert (gen.stats.graphs_captured, _graphs()) == (captured, graphs)


def _conversation(gen, params):
    """Three trajectories of three turns from PROMPTS[:3], observations of other lengths;
    each turn's samples, per trajectory."""
    turns = [[g[0]] for g in gen.generate(PROMPTS[:3], params, keep=True)]
    for k in range(2):
        obs = [[7 + k] * (3 + 9 * k * i) for i in range(3)]
        nexts = gen.continue_([t[-1].conversation for t in turns], obs, params, keep=k == 0)
        for t, s in zip(turns, nexts, strict=True):
            t.append(s)
    assert not gen.conversations  # the last turn's keep=False freed the rows
    return turns


@SCOPES
def test_conversations_continue_from_the_cache_under_graphs(scope):
    """Continuations prefilled at their rows' offsets (the compiled prefill) and decoded in
    captured graphs give eager's tokens, turn by turn."""
    model = cuda_model()
    params = SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=())
    fast = Generator(
        model, config=GeneratorConfig(max_batch=4, max_seq_len=256, compile_scope=scope)
    )
    ref = Generator(model, config=GeneratorConfig(max_batch=4, max_seq_len=256, **EAGER))
    got, want = _conversation(fast, params), _conversation(ref, params)
    assert [[s.completion_ids for s in t] for t in got] == [
        [s.completion_ids for s in t] for t in want
    ]


def test_batch_invariant_bf16_conversation_is_bitwise_the_trainers():
    """Every turn of a conversation continued from the cache (captured decode, bf16) has
    bitwise the log-probs of the whole conversation scored in one trainer forward."""
    model = cuda_model(dtype=torch.bfloat16)
    gen = Generator(
        model,
        config=GeneratorConfig(max_batch=4, max_seq_len=256, check_every=4, batch_invariant=True),
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=3, stop_token_ids=())
    for t in _conversation(gen, params):
        whole = t[-1].prompt_ids + t[-1].completion_ids
        with torch.no_grad():
            lp = logprobs(model, torch.tensor([whole], device="cuda"), batch_invariant=True)[0]
        for s in t:
            start = len(s.prompt_ids) - 1
            want = lp[start : start + len(s.completion_ids)].cpu()
            assert torch.equal(torch.tensor(s.logprobs), want)
