"""GPU-only checks: bf16 training, compile, flex attention backward. Skipped without CUDA."""

import pytest
import torch

from tidal.models import Transformer, get_flavor
from tidal.train.loss import cross_entropy_sum

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model(**kw):
    args = get_flavor("debug", vocab_size=512, max_seq_len=512, **kw)
    with torch.device("meta"):
        m = Transformer(args)
    m.to_empty(device="cuda")
    m.init_weights(seed=0)
    return m


def _overfit(model, steps=30, compile_blocks=False):
    if compile_blocks:
        for block in model.layers.values():
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, 512, (4, 257), device="cuda", generator=g)
    doc_ids = (torch.arange(256, device="cuda") >= 128).int().expand(4, -1).contiguous()
    losses = []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1], document_ids=doc_ids)
        loss = cross_entropy_sum(logits, tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_bf16_training_overfits_on_cuda():
    losses = _overfit(_model())
    assert losses[-1] < 0.5 * losses[0], losses


def test_compiled_blocks_train():
    losses = _overfit(_model(), steps=20, compile_blocks=True)
    assert losses[-1] < 0.7 * losses[0], losses


def test_flex_attention_trains_with_document_masking():
    losses = _overfit(_model(attention="flex"), steps=20)
    assert losses[-1] < 0.7 * losses[0], losses


def test_trainer_pins_batches_and_copies_them_to_the_device(tmp_path, monkeypatch):
    from tests.train.test_trainer import fixed_batch_data, tiny_trainer
    from tidal.train.data import Batch

    pinned = []
    real_pin = Batch.pin_memory

    def pin_memory(self):
        out = real_pin(self)
        pinned.append(out.input_ids.is_pinned() and out.labels.is_pinned())
        return out

    monkeypatch.setattr(Batch, "pin_memory", pin_memory)
    trainer = tiny_trainer(tmp_path, "--job.device", "cuda")
    (batch,), _, _ = trainer.next_batches()
    expected = next(iter(fixed_batch_data().train))
    assert pinned == [True] and batch.input_ids.is_cuda
    assert torch.equal(batch.input_ids.cpu(), expected.input_ids)  # .cpu() waits for the copy


def test_token_logprobs_at_a_128k_vocabulary_stay_lean_on_cuda():
    """The compiled per-token log-probs: values and gradient as F.log_softmax's, and the peak
    memory of forward + backward within the bf16 gradient buffer (and the gradient, if
    autograd copies it) and two fp32 chunks: 12.6 GB at 4 x 4096 rows, where the plain form
    holds an fp32 copy of the logits and the fp32 log-softmax (16.8 GB) before any gradient."""
    from tidal.train.loss import CHUNK_ROWS, token_logprobs

    N, V = 4 * 4096, 128_256
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(2, N // 2, V, device="cuda", dtype=torch.bfloat16, generator=g)
    logits.requires_grad_()
    labels = torch.randint(0, V, (2, N // 2), device="cuda", generator=g)
    weights = torch.randn(2, N // 2, device="cuda", generator=g)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lp, ent = token_logprobs(logits, labels, entropy=True)
    (lp * weights).sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    bound = 2 * N * V * 2 + 2 * CHUNK_ROWS * V * 4
    assert peak <= bound, (peak / 2**30, bound / 2**30)
    ref_x = logits.detach()[:, :512].float().requires_grad_()  # the reference on a slice
    ref = torch.log_softmax(ref_x, -1).gather(2, labels[:, :512, None])[..., 0]
    torch.testing.assert_close(lp[:, :512], ref, atol=1e-3, rtol=1e-3)
    (ref * weights[:, :512]).sum().backward()
    torch.testing.assert_close(logits.grad[:, :512].float(), ref_x.grad, atol=1e-2, rtol=1e-2)
