"""`Transformer.fuse_projections`: one product for Q/K/V and one for W1/W3, same results."""

import copy

import pytest
import torch
from torch import nn

from tests.train.test_trainer import tiny_trainer
from tidal.models import Transformer
from tidal.models.flavors import get_flavor


def _pair(flavor: str) -> tuple[Transformer, Transformer]:
    model = Transformer(get_flavor(flavor))
    model.init_weights(seed=0)
    fused = copy.deepcopy(model)
    assert fused.fuse_projections() == 2 * len(fused.layers)
    return model, fused


@pytest.mark.parametrize("flavor", ["tiny", "debug_qwen3"])
def test_fused_projections_match_separate_ones(flavor):
    model, fused = _pair(flavor)
    tokens = torch.randint(
        0, model.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    loss_a, loss_b = model(tokens).square().mean(), fused(tokens).square().mean()
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    loss_a.backward()
    loss_b.backward()
    grads = {n: p.grad for n, p in fused.named_parameters()}
    for name, param in model.named_parameters():
        assert grads[name] is not None, name
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert model.state_dict().keys() == fused.state_dict().keys()


def test_bf16_autocast_matches_separate_products():
    model, fused = _pair("tiny")
    tokens = torch.randint(
        0, model.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = model(tokens), fused(tokens)
    assert a.dtype == b.dtype == torch.bfloat16
    torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)


def test_layers_that_are_not_plain_linear_keep_their_own_products():
    model = Transformer(get_flavor("tiny"))

    class Other(nn.Linear):
        pass

    first = next(iter(model.layers.values()))
    old = first.attention.wk
    first.attention.wk = Other(old.in_features, old.out_features, bias=False)
    assert model.fuse_projections() == 2 * len(model.layers) - 1
    assert not first.attention.fused and first.feed_forward.fused


def test_linear_layers_with_hooks_keep_their_own_products():
    """Tensor parallelism keeps the nn.Linear class and adds input/output hooks: such a layer
    is not fused (the hooks would be skipped)."""
    model = Transformer(get_flavor("tiny"))
    first = next(iter(model.layers.values()))
    first.feed_forward.w3.register_forward_pre_hook(lambda module, args: None)
    assert model.fuse_projections() == 2 * len(model.layers) - 1
    assert first.attention.fused and not first.feed_forward.fused


def test_the_trainer_refuses_fused_projections_with_batch_invariant_mode(tmp_path):
    with pytest.raises(ValueError, match="training.fuse_projections=true"):
        tiny_trainer(
            tmp_path, "--training.fuse_projections", "true", "--training.batch_invariant", "true"
        )


def test_trainer_steps_match_with_and_without_fused_projections(tmp_path):
    """Losses and gradient norms of the same steps agree (AdamW's first updates are about
    lr * sign(grad), so single weights whose gradient is near zero may differ by more than
    rounding; the model tests above compare the gradients themselves)."""
    runs = []
    for fuse in ("true", "false"):
        t = tiny_trainer(tmp_path / fuse, "--training.fuse_projections", fuse)
        assert all(b.attention.fused == (fuse == "true") for b in t.model.layers.values())
        steps = [t.train_step(*t.next_batches()[:2]) for _ in range(3)]
        runs.append([(float(s.loss), float(s.grad_norm)) for s in steps])
        assert set(t.model.state_dict()) == set(Transformer(t.args).state_dict())
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_compiled_bf16_matches_separate_products():
    from tidal.parallel.parallelize import apply_compile

    model, fused = (m.cuda() for m in _pair("debug"))
    apply_compile(fused)
    tokens = torch.randint(0, model.args.vocab_size, (2, 256), device="cuda")
    for m in (model, fused):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            m(tokens).float().square().mean().backward()
    for (name, a), (_, b) in zip(model.named_parameters(), fused.named_parameters(), strict=True):
        cos = torch.nn.functional.cosine_similarity(a.grad.flatten(), b.grad.flatten(), dim=0)
        assert cos > 0.999, (name, cos)
