"""Model math: shapes, causality, KV cache, parameter counts, attention kernels."""

import pytest
import torch

from tidal.models import FLAVORS, KVCache, Transformer, get_flavor

# A small shape shared by every test here (overrides on a named flavor).
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97, max_seq_len=64)


def tiny(**kw):
    args = get_flavor("debug", **TINY, **kw)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(seed=0)
    return model.eval()


@pytest.fixture(params=["debug", "debug_qwen3", "debug_moe"])
def model(request):
    args = get_flavor(request.param, **TINY)
    if args.head_dim is not None:
        from dataclasses import replace

        args = replace(args, head_dim=24)
    with torch.device("meta"):
        m = Transformer(args)
    m.to_empty(device="cpu")
    m.init_weights(seed=0)
    return m.eval()


def test_shapes_and_meta_init(model):
    tokens = torch.randint(0, 97, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, 97)
    assert torch.isfinite(logits).all()
    assert model(tokens, head=lambda h_BTD, w_VD: h_BTD).shape == (3, 17, 64)


def test_init_is_seeded(model):
    other = Transformer(model.args)
    other.init_weights(seed=0)
    for (n, p), q in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(p, q), n


def test_causal(model):
    tokens = torch.randint(0, 97, (2, 20))
    changed = tokens.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 97
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_kv_cache_matches_full_forward(model):
    tokens = torch.randint(0, 97, (2, 24))
    full = model(tokens)
    cache = KVCache.for_model(model, batch_size=2, capacity=32)
    steps = [model.forward_cached(tokens[:, :10], cache)]  # prefill
    cache.advance(10)
    for t in range(10, 24):  # one token at a time
        steps.append(model.forward_cached(tokens[:, t : t + 1], cache))
        cache.advance(1)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_kv_cache_rows_at_different_lengths(model):
    """Right-padded prefill into chosen rows, then decode steps where every row is at its own
    position: each row's logits equal its own full forward."""
    seqs = [torch.randint(0, 97, (n,)) for n in (7, 11, 5)]
    cache = KVCache.for_model(model, batch_size=4, capacity=32)
    rows, lengths = torch.tensor([2, 0, 1]), torch.tensor([3, 7, 1])  # prompt lengths
    prompts = torch.zeros(3, 7, dtype=torch.long)
    for i, (s, n) in enumerate(zip(seqs, lengths, strict=True)):
        prompts[i, :n] = s[:n]
    last = model.forward_cached(prompts, cache, rows=rows, logits_at=lengths - 1)
    assert last.shape == (3, 1, 97)
    cache.lengths[rows] = lengths
    outs = [[last[i, 0]] for i in range(3)]
    for step in range(4):  # decode the next 4 tokens of every row (cache rows 0..2 in order)
        order = rows.argsort()  # batch row b of the decode is cache row b
        toks = torch.stack([seqs[i][lengths[i] + step] for i in order.tolist()])
        logits = model.forward_cached(toks[:, None], cache)
        cache.advance(1, rows=torch.arange(3))
        for b, i in enumerate(order.tolist()):
            outs[i].append(logits[b, 0])
    for i, s in enumerate(seqs):
        n = int(lengths[i])
        full = model(s[None, : n + 4])[0, n - 1 : n + 4]
        torch.testing.assert_close(torch.stack(outs[i]), full, atol=1e-5, rtol=1e-5)


def test_compiled_blocks_share_one_graph_across_layers_and_batches(model):
    """`forward_cached(blocks=...)` with one compiled block function for every layer (as a generator
    with compile_scope="blocks" runs it): each block gets its own layer's cache, so dynamo
    traces the block once per shape, not once per layer; the batch dimension turns dynamic at
    its second size. 2 layers x 4 batch sizes: 2 frames, not 8. Logits equal eager."""
    import functools

    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()

    def run_block(block, x_BTD, rope, mask, layer_cache):
        return block(x_BTD, rope, mask, layer_cache)

    compiled = torch.compile(run_block, backend=counter)
    blocks = [functools.partial(compiled, b) for b in model.layers.values()]
    tokens = torch.randint(0, 97, (8, 6))
    eager_cache = KVCache.for_model(model, batch_size=8, capacity=32)
    cache = KVCache.for_model(model, batch_size=8, capacity=32)
    with torch.no_grad():
        for c in (eager_cache, cache):  # prefill eagerly: the first write allocates
            model.forward_cached(tokens[:, :5], c)
            c.advance(5)
        for b in (1, 2, 4, 8):
            positions = cache.lengths[:b, None]
            want = model.forward_cached(tokens[:b, 5:], eager_cache, positions=positions)
            got = model.forward_cached(tokens[:b, 5:], cache, positions=positions, blocks=blocks)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.k[1], eager_cache.k[1], atol=1e-6, rtol=1e-6)
        # MoE blocks on CPU break the graph at the per-expert loop (it reads the counts on
        # the host): equal logits, but more frames. A graph-captured MoE decode is the
        # generator's part of issue 36.
        if model.args.moe is None:
            assert counter.frame_count == 2, counter.frame_count
        with pytest.raises(ValueError, match="blocks has 1 callables, the model 2"):
            model.forward_cached(tokens, cache, blocks=blocks[:1])
    torch._dynamo.reset()


def test_compiled_blocks_marked_dynamic_compile_once_for_every_batch():
    """Decode batches 8, 4, 2, 1 through one compiled block function. Dynamo's automatic
    dynamic shapes alone compile batch 8 static, recompile dynamic at 4 and specialize 1
    (three graphs, the second one inside whatever step first meets a second size). With the
    batch dimension of what a forward hands the blocks marked dynamic (`maybe_mark_dynamic`,
    as tidal/generate/compiled.py's compiled blocks do), the first graph is the dynamic one: two
    graphs, batch 1 the other."""
    import functools

    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    model = tiny()

    def run_block(block, x_BTD, rope, mask, layer_cache):
        return block(x_BTD, rope, mask, layer_cache)

    compiled = torch.compile(run_block, backend=counter)

    def first(block, x_BTD, rope, mask, layer_cache):
        for t in (x_BTD, *rope, mask.positions):  # the batch of what every block gets
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(block, x_BTD, rope, mask, layer_cache)

    blocks = [
        functools.partial(first if i == 0 else compiled, b)
        for i, b in enumerate(model.layers.values())
    ]
    tokens = torch.randint(0, 97, (8, 6))
    cache = KVCache.for_model(model, batch_size=8, capacity=32)
    frames = []
    with torch.no_grad():
        model.forward_cached(tokens[:, :5], cache)  # prefill eagerly: the first write allocates
        cache.advance(5)
        for b in (8, 4, 2, 1):
            model.forward_cached(
                tokens[:b, 5:], cache, positions=cache.lengths[:b, None], blocks=blocks
            )
            frames.append(counter.frame_count)
    assert frames == [1, 1, 1, 2], frames
    torch._dynamo.reset()


def test_positions_argument(model):
    tokens = torch.randint(0, 97, (1, 8))
    torch.testing.assert_close(model(tokens, positions=torch.arange(8)), model(tokens))
    # RoPE sees relative distances only: a constant shift changes nothing, a gap does.
    torch.testing.assert_close(model(tokens, positions=torch.arange(8)[None] + 5), model(tokens))
    gap = torch.tensor([[0, 1, 2, 3, 10, 11, 12, 13]])
    assert not torch.allclose(model(tokens, positions=gap), model(tokens))


def test_tied_embeddings_share_storage():
    m = tiny(tie_embeddings=True)
    assert m.output is None
    names = [n for n, _ in m.named_parameters()]
    assert "tok_embeddings.weight" in names and not any(n.startswith("output") for n in names)


def test_sequence_longer_than_max_raises():
    with pytest.raises(ValueError, match="max_seq_len=64"):
        tiny()(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("name", [n for n, a in FLAVORS.items() if "published_params" in a.extra])
def test_parameter_counts_match_published(name):
    args = FLAVORS[name]
    with torch.device("meta"):
        m = Transformer(args)
    assert sum(p.numel() for p in m.parameters()) == args.extra["published_params"]


def test_flex_single_document_matches_sdpa():
    sdpa = tiny()
    flex = Transformer(get_flavor("debug", **TINY, attention="flex"))
    flex.load_state_dict(sdpa.state_dict())
    flex.eval()
    tokens = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(flex(tokens), sdpa(tokens), atol=1e-5, rtol=1e-5)


def test_flex_document_mask_isolates_documents():
    flex = Transformer(get_flavor("debug", **TINY, attention="flex"))
    flex.init_weights(seed=1)
    flex.eval()
    a, b = torch.randint(0, 97, (1, 6)), torch.randint(0, 97, (1, 10))
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 6 + [1] * 10], dtype=torch.int32)
    # Positions restart per document, as if each were fed alone.
    positions = torch.cat([torch.arange(6), torch.arange(10)])[None]
    with torch.no_grad():
        out = flex(packed, document_ids=doc_ids, positions=positions)
        torch.testing.assert_close(out[:, :6], flex(a), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[:, 6:], flex(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("restart_positions", [True, False])
def test_sdpa_document_mask_isolates_documents_as_flex_does(restart_positions):
    """Packed chat samples under SDPA (a dense mask): each document's logits are those it gets
    alone, with positions restarted or not (RoPE is relative), and equal flex's."""
    sdpa = tiny()
    flex = Transformer(get_flavor("debug", **TINY, attention="flex"))
    flex.load_state_dict(sdpa.state_dict())
    flex.eval()
    a, b = torch.randint(0, 97, (1, 6)), torch.randint(0, 97, (1, 10))
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 6 + [1] * 10], dtype=torch.int32)
    kw = {"positions": torch.cat([torch.arange(6), torch.arange(10)])[None]}
    with torch.no_grad():
        out = sdpa(packed, document_ids=doc_ids, **(kw if restart_positions else {}))
        torch.testing.assert_close(out[:, :6], sdpa(a), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[:, 6:], sdpa(b), atol=1e-4, rtol=1e-4)
        flexed = flex(packed, document_ids=doc_ids, **(kw if restart_positions else {}))
        torch.testing.assert_close(out, flexed, atol=1e-5, rtol=1e-5)
        # Without document ids SDPA stays plainly causal: the second document sees the first.
        assert not torch.allclose(sdpa(packed)[:, 6:], out[:, 6:], atol=1e-3)


def test_bad_args():
    with pytest.raises(ValueError, match="n_kv_heads"):
        get_flavor("debug", n_heads=8, n_kv_heads=3)
    with pytest.raises(ValueError, match="unknown model flavor"):
        get_flavor("llama9")
