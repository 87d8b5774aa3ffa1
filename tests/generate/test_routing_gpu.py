"""A mixture-of-experts model in the Generator on CUDA: bf16 on an sm90+ GPU, the experts run
through `torch._grouped_mm` (no host sync), so the compiled decode step is captured in CUDA
graphs and still records every token's experts; in batch-invariant mode the experts loop reads
counts on the host, so graphs stay off (or are refused when asked for), and the records are the
training forward's bit for bit. Skipped without CUDA (`pytest -m gpu`)."""

import pytest
import torch

from tidal.generate import Generator, GeneratorConfig, SamplingParams
from tidal.models import Transformer, get_flavor
from tidal.models.moe import grouped_mm_available, moe_layers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("fresh_dynamo"),
]

PROMPTS = [[1, 5, 7], list(range(2, 60)), [4], [9] * 5]


def _model(dtype: torch.dtype) -> Transformer:
    with torch.device("meta"):
        m = Transformer(get_flavor("debug_moe", vocab_size=512, max_seq_len=256))
    m.to_empty(device="cuda")
    m.init_weights(seed=0)
    return m.to(dtype)


def _forward_routing(model, ids, batch_invariant: bool) -> torch.Tensor:
    with torch.no_grad():
        model(torch.tensor([ids], device="cuda"), batch_invariant=batch_invariant)
    return torch.stack([m.last_experts_NK for m in moe_layers(model)])[:, :-1].cpu()


def test_graph_captured_decode_records_routing():
    model = _model(torch.bfloat16)
    ex = moe_layers(model)[0].experts
    if not grouped_mm_available(ex.w1, torch.bfloat16, *ex.w1.shape[1:]):
        pytest.skip("no torch._grouped_mm for bf16 on this GPU (needs sm90+)")
    cfg = GeneratorConfig(max_batch=8, max_seq_len=128, record_routing=True)
    gen = Generator(model, config=cfg)
    assert gen.compiles and gen.captures  # the grouped path has no host sync
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=1)
    groups = gen.generate(PROMPTS, params)
    assert gen.stats.graphs_captured >= 1
    same = total = 0
    for g in groups:
        for s in g:
            want = _forward_routing(model, s.prompt_ids + s.completion_ids, False)
            got = s.routed_experts.long()
            assert got.shape == want.shape
            # Other kernels (compiled, other batch shapes) may flip a near tie in bf16.
            same += int((got.sort(-1).values == want.sort(-1).values).all(-1).sum())
            total += want.shape[0] * want.shape[1]
    assert same / total > 0.97, (same, total)


def test_batch_invariant_moe_keeps_graphs_off():
    model = _model(torch.bfloat16)
    cfg = GeneratorConfig(max_batch=4, max_seq_len=128, batch_invariant=True, record_routing=True)
    gen = Generator(model, config=cfg)
    assert not gen.captures  # the experts' loop reads the counts on the host
    with pytest.raises(ValueError, match="cuda_graphs=True: this mixture-of-experts model"):
        Generator(
            model,
            config=GeneratorConfig(max_batch=4, batch_invariant=True, cuda_graphs=True),
        )
    groups = gen.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=16))
    for g in groups:
        for s in g:
            want = _forward_routing(model, s.prompt_ids + s.completion_ids, True)
            assert torch.equal(s.routed_experts.long(), want)
