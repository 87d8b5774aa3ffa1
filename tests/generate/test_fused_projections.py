"""GeneratorConfig.fuse_projections on CPU: Q|K|V and W1|W3 as one product each over stacked
weights that hold the model's own parameters (tidal/generate/fused.py). The same greedy
tokens and log-probs as the unfused generator (Llama, Qwen 2 with q/k/v biases, Qwen 3 with
QK-norm, an MoE model whose attention alone fuses), weight loads that reach the fused
weights with no copy, the compiled block function over the fused copies, and the refused
combinations. The CUDA graph path: tests/generate/test_gpu_fused_projections.py."""

import pytest
import torch

from tests.generate.conftest import moe_tiny, qwen_tiny, tiny_model
from tidal.generate import Generator, GeneratorConfig, SamplingParams
from tidal.generate.fused import FusedAttention, FusedFeedForward

PROMPTS = [[1, 5, 7], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [4], [9] * 5]
GREEDY = SamplingParams(temperature=0, max_new_tokens=12)
SAMPLED = SamplingParams(n=2, temperature=0.9, top_p=0.9, max_new_tokens=10, seed=3)
FUSED = GeneratorConfig(max_batch=8, max_seq_len=64, fuse_projections=True)
PLAIN = GeneratorConfig(max_batch=8, max_seq_len=64, fuse_projections=False)
LOGPROB_ATOL = 1e-5
"""fp32 on CPU: measured exactly equal (max |diff| 0.0) for every model here; a GEMM over a
stacked weight is not promised to round as the separate ones do, hence a tolerance."""


def qwen2_tiny(seed: int = 0):
    """A small Qwen 2 (q/k/v biases, tied embeddings) with nonzero biases (init zeroes them)."""
    model = tiny_model(
        "debug_qwen2",
        seed,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        vocab_size=384,
    )
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


MODELS = {
    "llama": lambda seed=0: tiny_model(seed=seed),
    "qwen2_bias": qwen2_tiny,
    "qwen3_qk_norm": qwen_tiny,
}


def ids(groups):
    return [[s.completion_ids for s in g] for g in groups]


def assert_same(got, want):
    """Same tokens; log-probs within LOGPROB_ATOL. Returns the largest log-prob difference."""
    assert ids(got) == ids(want)
    diff = 0.0
    for g, w in zip(got, want, strict=True):
        for s, t in zip(g, w, strict=True):
            a, b = torch.tensor(s.logprobs), torch.tensor(t.logprobs)
            torch.testing.assert_close(a, b, atol=LOGPROB_ATOL, rtol=0)
            diff = max(diff, float((a - b).abs().max()))
    return diff


@pytest.mark.parametrize("name", list(MODELS))
def test_fused_generator_matches_the_unfused_one(name, record_property):
    model = MODELS[name]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    ref = Generator(model, config=PLAIN)
    assert ref.fused == 0
    want_greedy, want_sampled = ref.generate(PROMPTS, GREEDY), ref.generate(PROMPTS, SAMPLED)

    gen = Generator(model, config=FUSED)
    n = model.args.n_layers
    assert gen.fused == 2 * n  # every attention block and every MLP
    diff = max(
        assert_same(gen.generate(PROMPTS, GREEDY), want_greedy),
        assert_same(gen.generate(PROMPTS, SAMPLED), want_sampled),
    )
    record_property("max_abs_logprob_diff", diff)
    print(f"{name}: fused vs unfused log-probs, max |diff| {diff:.3g}")
    # The model is left as the trainer uses it: the same Parameter objects, values and keys,
    # now views into the stacked tensors the fused copies read.
    assert dict(model.named_parameters()) == params
    state = model.state_dict()
    assert state.keys() == before.keys()
    assert all(torch.equal(state[k], before[k]) for k in before)
    att = model.layers["0"].attention
    blocks = gen.steps.fused_blocks
    assert blocks is not None
    block = blocks[0]
    assert isinstance(block.attention, FusedAttention)
    assert isinstance(block.feed_forward, FusedFeedForward)
    assert type(att).__name__ == "Attention" and not hasattr(att, "wqkv")
    stacked = block.attention.wqkv.weight
    rows = att.wq.out_features
    assert att.wq.weight.data_ptr() == stacked.data_ptr()
    assert att.wk.weight.data_ptr() == stacked[rows:].data_ptr()
    assert block.attention.wo is att.wo and block.ffn_norm is model.layers["0"].ffn_norm
    if model.args.qkv_bias:
        assert (
            att.wv.bias.data_ptr() == block.attention.wqkv.bias[-att.wv.out_features :].data_ptr()
        )


def test_the_trainer_forward_is_bitwise_unchanged():
    """The training forward over the laid-out parameters gives the bits it gave before."""
    model = qwen2_tiny()
    tokens = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        want = model(tokens)
        Generator(model, config=FUSED)
        assert torch.equal(model(tokens), want)


@pytest.mark.parametrize("name", list(MODELS))
def test_in_place_loads_reach_the_fused_weights(name):
    """RL loads copy into the parameters in place: a state dict (`load_weights`), the store
    (`load_from_store` writes `model.state_dict()`'s tensors), a prefetcher's swap (copies
    into that same state dict). The fused generator then decodes as a fresh unfused one over
    the new weights, with no copy to refresh and no parameter moved."""
    make = MODELS[name]
    gen = Generator(make(seed=0), config=FUSED)
    ptrs = [p.data_ptr() for p in gen.model.parameters()]
    for seed in (1, 2):
        gen.load_weights(make(seed=seed).state_dict(), version=seed)
        want = Generator(make(seed=seed), config=PLAIN).generate(PROMPTS, GREEDY)
        assert_same(gen.generate(PROMPTS, GREEDY), want)
    live = gen.model.state_dict()  # what a prefetcher keeps and copies into
    new = make(seed=3).state_dict()
    with torch.no_grad():
        for k, t in live.items():
            t.copy_(new[k])
    assert_same(
        gen.generate(PROMPTS, GREEDY),
        Generator(make(seed=3), config=PLAIN).generate(PROMPTS, GREEDY),
    )
    assert [p.data_ptr() for p in gen.model.parameters()] == ptrs


def test_load_from_store_reaches_the_fused_weights():
    import tidal.store

    store = tidal.store.connect()
    try:
        gen = Generator(qwen2_tiny(seed=0), config=FUSED)
        store.put_state_dict(qwen2_tiny(seed=1).state_dict(), "policy", version=1)
        assert gen.load_from_store(store, "policy") == 1
        want = Generator(qwen2_tiny(seed=1), config=PLAIN).generate(PROMPTS, GREEDY)
        assert_same(gen.generate(PROMPTS, GREEDY), want)
    finally:
        store.close()


def test_a_second_generator_shares_the_layout():
    """A second Generator over the same model finds the parameters laid out and reads the same
    stacked tensors: a load through either reaches both."""
    model = tiny_model()
    first = Generator(model, config=FUSED)
    ptrs = [p.data_ptr() for p in model.parameters()]
    second = Generator(model, config=FUSED)
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    second.load_weights(tiny_model(seed=1).state_dict())
    want = Generator(tiny_model(seed=1), config=PLAIN).generate(PROMPTS, GREEDY)
    assert_same(first.generate(PROMPTS, GREEDY), want)
    assert_same(second.generate(PROMPTS, GREEDY), want)


def test_a_parameter_moved_after_building_is_refused():
    model = tiny_model()
    gen = Generator(model, config=FUSED)
    wk = model.layers["1"].attention.wk
    wk.weight.data = wk.weight.detach().clone()  # what model.to(...) or assign=True do
    with pytest.raises(RuntimeError, match=r"layers\.1\.attention\.wk\.weight was moved"):
        gen.generate(PROMPTS, GREEDY)


def test_moe_layers_fuse_attention_only():
    """The experts are left as they are (the copies share the model's MoE modules, whose
    routing the generator records)."""
    model = moe_tiny()
    record = dict(max_batch=8, max_seq_len=64, record_routing=True)
    want = Generator(model, config=GeneratorConfig(fuse_projections=False, **record))
    gen = Generator(model, config=GeneratorConfig(fuse_projections=True, **record))
    assert gen.fused == model.args.n_layers
    got, ref = gen.generate(PROMPTS, GREEDY), want.generate(PROMPTS, GREEDY)
    assert_same(got, ref)
    for g, w in zip(got, ref, strict=True):
        assert torch.equal(g[0].routed_experts, w[0].routed_experts)


def test_projections_that_are_not_plain_linear_layers_stay_unfused():
    """A projection with a forward hook (as tensor parallelism or float8 layers have) keeps
    its own product; the other modules still fuse."""
    model = tiny_model()
    calls = []
    model.layers["2"].attention.wv.register_forward_hook(lambda *a: calls.append(1))
    want = Generator(model, config=PLAIN).generate(PROMPTS[:1], GREEDY)
    calls.clear()
    gen = Generator(model, config=FUSED)
    assert gen.fused == 2 * model.args.n_layers - 1
    assert_same(gen.generate(PROMPTS[:1], GREEDY), want)
    assert calls  # the hooked layer ran its own product


def test_default_and_refused_combinations():
    model = tiny_model()
    assert Generator(model, config=GeneratorConfig(max_batch=2)).fused == 0  # off by default
    for kw in ({}, {"fuse_projections": False}):
        gen = Generator(model, config=GeneratorConfig(max_batch=2, batch_invariant=True, **kw))
        assert gen.fused == 0
    with pytest.raises(ValueError, match="fuse_projections=True with batch_invariant=True"):
        Generator(model, config=GeneratorConfig(batch_invariant=True, fuse_projections=True))


def test_fused_copies_compile_as_one_block_function(monkeypatch):
    """compile_scope="blocks" with dynamo (a counting backend that runs the traced graphs):
    the fused copies of the blocks compile into one function for every layer, as many graphs
    as the model's own blocks do, and give the eager fused generator's tokens."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    model = tiny_model()
    want = Generator(model, config=FUSED).generate(PROMPTS, GREEDY)
    compile_ = torch.compile
    frames = {}
    for fuse in (False, True):
        torch._dynamo.reset()
        counter = CompileCounter()

        def counting_compile(fn, counter=counter, **kw):
            if fn.__name__ != "run_block":
                return compile_(fn, backend="eager", dynamic=kw.get("dynamic"))
            return compile_(fn, backend=counter, dynamic=kw.get("dynamic"))

        monkeypatch.setattr(torch, "compile", counting_compile)
        cfg = GeneratorConfig(
            max_batch=8, max_seq_len=64, fuse_projections=fuse, compile_scope="blocks"
        )
        with pytest.warns(UserWarning, match="compile_scope='blocks' is ignored"):
            gen = Generator(model, config=cfg)
        gen.compile_for_testing()
        try:
            assert gen.blocks is not None
            assert gen.fused == (2 * model.args.n_layers if fuse else 0)
            assert_same(gen.generate(PROMPTS, GREEDY), want)
            assert_same(gen.generate(PROMPTS[:1], GREEDY), want[:1])  # batch 1: its own graph
            frames[fuse] = counter.frame_count
        finally:
            torch._dynamo.reset()
    assert frames[True] == frames[False] >= 1, frames
