"""The mixture-of-experts layer (tidal/models/moe.py): sorted-token expert compute against a
naive loop over experts (forward and gradients), grouped GEMM on CPU where torch has a kernel
and on a GPU (`gpu` marker), routing (top-k, renormalization, the selection bias), the
auxiliary loss, shared experts, the bias update and the MoE flavors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tidal.models import FLAVORS, Transformer, get_flavor
from tidal.models.moe import (
    MoE,
    MoEArgs,
    aux_loss,
    collect_moe,
    load_metrics,
    update_expert_bias,
)
from tidal.train.checkpoint.plan import args_from_info, model_info


def make_moe(dim=32, seed=0, **kw) -> MoE:
    args = MoEArgs(**({"n_experts": 6, "top_k": 2, "ffn_dim": 16} | kw))
    moe = MoE(dim, args)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    moe.init_buffers()
    return moe


def naive(moe: MoE, x_BTD: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: the definition the layer must compute."""
    B, T, D = x_BTD.shape
    x_ND = x_BTD.reshape(-1, D)
    probs_NE = F.softmax(x_ND @ moe.router.weight.T, dim=-1)
    scores_NE = probs_NE if moe.expert_bias is None else probs_NE + moe.expert_bias
    rows = []
    for n in range(x_ND.shape[0]):
        chosen = scores_NE[n].topk(moe.args.top_k).indices
        w = probs_NE[n, chosen]
        if moe.args.norm_topk_prob:
            w = w / w.sum()
        out = torch.zeros(D)
        for e, weight in zip(chosen.tolist(), w, strict=True):
            ex = moe.experts
            h = F.silu(ex.w1[e] @ x_ND[n]) * (ex.w3[e] @ x_ND[n])
            out = out + weight * (ex.w2[e] @ h)
        if moe.shared_experts is not None:
            out = out + moe.shared_experts(x_ND[n])
        rows.append(out)
    return torch.stack(rows).view(B, T, D)


def grads(moe: MoE, x: torch.Tensor, fn) -> list[torch.Tensor]:
    moe.zero_grad()
    x = x.clone().requires_grad_(True)
    (fn(x) * torch.linspace(-1, 1, x.shape[-1])).sum().backward()
    assert x.grad is not None
    return [x.grad] + [p.grad.clone() for p in moe.parameters()]  # type: ignore[union-attr]


def cpu_grouped_mm() -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        torch._grouped_mm(
            torch.ones(4, 8), torch.ones(2, 8, 8), offs=torch.tensor([1, 4], dtype=torch.int32)
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True


IMPLS = [
    "loop",
    pytest.param(
        "grouped_mm",
        marks=pytest.mark.skipif(
            not cpu_grouped_mm(), reason="this torch has no CPU kernel for torch._grouped_mm"
        ),
    ),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"norm_topk_prob": False, "top_k": 3},
        {"n_shared_experts": 2},
        {"load_balance": "bias"},
    ],
)
def test_sorted_experts_match_a_naive_loop(impl, kw):
    moe = make_moe(**kw)
    moe.experts.impl = impl
    if moe.expert_bias is not None:  # a bias large enough to change the choice
        moe.expert_bias.copy_(torch.linspace(-0.3, 0.3, 6))
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x), naive(moe, x), atol=1e-5, rtol=1e-5)
    for got, want in zip(grads(moe, x, moe), grads(moe, x, lambda x: naive(moe, x)), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_an_expert_without_tokens_and_grouped_padding():
    """Uneven groups (one empty, one of one row) through the padded grouped product."""
    if not cpu_grouped_mm():
        pytest.skip("this torch has no CPU kernel for torch._grouped_mm")
    from tidal.models.moe import experts_grouped_mm, experts_loop

    g = torch.Generator().manual_seed(0)
    E, F_, D = 4, 8, 16
    w1, w3 = torch.randn(E, F_, D, generator=g), torch.randn(E, F_, D, generator=g)
    w2 = torch.randn(E, D, F_, generator=g)
    counts = torch.tensor([3, 0, 1, 6])
    x = torch.randn(10, D, generator=g)
    torch.testing.assert_close(
        experts_grouped_mm(x, counts, w1, w2, w3), experts_loop(x, counts, w1, w2, w3)
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_mm_matches_the_loop_on_gpu(monkeypatch):
    """bf16 on the GPU: torch._grouped_mm (sm90) against one matmul per expert, forward and
    gradients, with uneven and empty groups."""
    moe = make_moe(dim=256, n_experts=8, top_k=2, ffn_dim=128, load_balance="bias")
    moe = moe.cuda().bfloat16()
    if not hasattr(torch, "_grouped_mm") or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm needs torch with it and an sm90 GPU")
    with torch.no_grad():  # expert 0 takes no token
        moe.expert_bias[0] = -10.0
    x = torch.randn(4, 33, 256, device="cuda", dtype=torch.bfloat16)
    out = {}
    for impl in ("grouped_mm", "loop"):
        moe.experts.impl = impl
        moe.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = moe(xi)
        (y.float() * torch.linspace(-1, 1, 256, device="cuda")).sum().backward()
        out[impl] = [y, xi.grad] + [p.grad for p in moe.parameters()]
    assert int(moe.last_counts_E[0]) == 0

    def close(a, b):  # bf16: within 2% of the largest value
        err = (a.float() - b.float()).abs().max() / b.float().abs().max()
        assert err < 2e-2, err

    for a, b in zip(out["grouped_mm"], out["loop"], strict=True):
        close(a, b)
    # auto picks the grouped kernel, also for fp32 weights under bf16 autocast (the trainer's).
    import copy

    import tidal.models.moe as moe_module

    calls = []
    grouped = moe_module.experts_grouped_mm
    monkeypatch.setattr(moe_module, "experts_grouped_mm", lambda *a: calls.append(1) or grouped(*a))
    moe32 = copy.deepcopy(moe).float()
    moe32.experts.impl = "auto"
    with torch.autocast("cuda", dtype=torch.bfloat16):
        close(moe32(x.float()), out["loop"][0])
    assert calls == [1]


def test_routing_weights_bias_and_aux_loss():
    moe = make_moe(load_balance="bias")
    x = torch.randn(1, 16, 32)
    moe(x)
    assert moe.last_counts_E is not None and int(moe.last_counts_E.sum()) == 16 * 2
    # A huge bias on expert 5 routes every token there; the weights stay the probabilities.
    moe.expert_bias[5] = 10.0
    y = moe(x)
    assert int(moe.last_counts_E[5]) == 16
    torch.testing.assert_close(y, naive(moe, x), atol=1e-5, rtol=1e-5)
    # The aux loss: 1.0 when the load and the probabilities are uniform, E when all on one.
    E = 6
    uniform = torch.full((8, E), 1 / E)
    assert float(aux_loss(uniform, torch.full((E,), 4))) == pytest.approx(1.0)
    onehot = F.one_hot(torch.zeros(8, dtype=torch.long), E).float()
    assert float(aux_loss(onehot, torch.tensor([16, 0, 0, 0, 0, 0]))) == pytest.approx(E)


def test_bias_update_moves_toward_balance():
    model = Transformer(get_flavor("debug_moe", vocab_size=64, n_layers=2))
    model.init_weights()
    with pytest.raises(ValueError, match="for 1 MoE layers, the model has 2"):
        update_expert_bias(model, torch.zeros(1, 8))
    counts = torch.tensor([[10, 0, 2, 2, 2, 2, 2, 4]] * 2)
    update_expert_bias(model, counts)  # load_balance aux_loss: nothing to update
    biased = Transformer(
        dataclasses.replace(
            model.args, moe=dataclasses.replace(model.args.moe, load_balance="bias")
        )
    )
    biased.init_weights()
    update_expert_bias(biased, counts)
    bias = biased.layers["0"].feed_forward.expert_bias
    # Mean load 3: over-loaded experts go down, under-loaded ones up, by the rate.
    assert bias.tolist() == pytest.approx([-1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, -1e-3])
    assert "layers.0.feed_forward.expert_bias" in biased.state_dict()  # checkpoints keep it
    metrics = load_metrics(counts)
    assert float(metrics["moe_load_max"]) == pytest.approx(10 / 3)
    assert float(metrics["moe_load_min"]) == 0.0 and float(metrics["moe_dropped_tokens"]) == 0


def test_bias_updates_balance_a_skewed_router():
    """Repeated bias updates (weights fixed) even out a router that favours a few experts."""
    moe = make_moe(n_experts=8, load_balance="bias", bias_update_rate=0.005)
    with torch.no_grad():
        moe.router.weight[:2] *= 4  # experts 0 and 1 win most tokens
    x = torch.randn(1, 256, 32, generator=torch.Generator().manual_seed(2))
    model = torch.nn.ModuleList([moe])
    loads = []
    for _ in range(60):
        moe(x)
        counts = moe.last_counts_E.float()
        loads.append(float(counts.max() / counts.mean()))
        update_expert_bias(model, moe.last_counts_E[None])
    assert loads[0] > 1.8 and max(loads[-10:]) < 1.45, loads


def test_debug_moe_forward_backward_and_collect():
    model = Transformer(get_flavor("debug_moe", vocab_size=64))
    model.init_weights(seed=3)
    assert collect_moe(model) is None  # nothing ran yet
    tokens = torch.randint(0, 64, (2, 24))
    model(tokens).float().logsumexp(-1).mean().backward()
    stats = collect_moe(model)
    assert stats is not None and stats.counts_LE.shape == (4, 8)
    assert stats.counts_LE.sum(1).tolist() == [2 * 24 * 2] * 4
    assert stats.aux_loss.requires_grad and 0.9 < float(stats.aux_loss.detach()) < 8
    assert collect_moe(Transformer(get_flavor("tiny"))) is None  # dense
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # The residual output of the experts is scaled down with depth, as the dense w2.
    w2 = [model.layers[str(i)].feed_forward.experts.w2.std().item() for i in (0, 3)]
    assert w2[1] < w2[0]


def test_moe_flavors():
    a = FLAVORS["qwen3_30b_a3b"]
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.k, a.vocab_size) == (
        2048,
        48,
        32,
        4,
        128,
        151936,
    )
    assert a.moe == MoEArgs(n_experts=128, top_k=8, ffn_dim=768)
    assert a.rope_theta == 1e6 and a.qk_norm and not a.tie_embeddings
    active = a.extra["published_params"] - a.n_layers * a.moe.inactive_params(a.dim)
    assert 3.3e9 < active < 3.4e9  # Qwen3-30B-A3B: 3.3B activated
    with torch.device("meta"):
        n = sum(p.numel() for p in Transformer(FLAVORS["qwen3_moe_1b"]).parameters())
    assert 0.9e9 < n < 1.1e9


def test_moe_args_are_checked_and_saved_in_checkpoint_info():
    for kw, message in [
        ({"top_k": 9}, "moe.top_k=9 exceeds moe.n_experts=8"),
        ({"n_experts": 0}, "must be positive"),
        ({"load_balance": "loss"}, "moe.load_balance must be 'aux_loss' or 'bias'"),
        ({"n_shared_experts": -1}, "n_shared_experts=-1"),
        ({"bias_update_rate": -1.0}, "bias_update_rate=-1.0"),
    ]:
        with pytest.raises(ValueError, match=message):
            MoEArgs(**({"n_experts": 8} | kw))
    args = get_flavor("debug_moe", moe=MoEArgs(n_experts=4, n_shared_experts=1))
    import json

    info = json.loads(json.dumps({"model": model_info(args, "debug_moe")}))
    assert args_from_info(info, None) == args  # type: ignore[arg-type]


def test_batch_invariant_mode_gives_the_same_bits_in_any_batch_and_in_decode():
    """Routing is per token and, in batch-invariant mode, each expert's matmul runs on fixed
    row blocks: a row's logits do not depend on the other rows, and a prefill plus decode
    steps over the KV cache reproduce the training forward bit for bit."""
    from tidal.models import KVCache

    model = Transformer(get_flavor("debug_moe", vocab_size=64, n_layers=2)).eval()
    model.init_weights(seed=2)
    tokens = torch.randint(0, 64, (5, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens, batch_invariant=True)
        assert torch.equal(model(tokens[2:3], batch_invariant=True), full[2:3])
        cache = KVCache.for_model(model, batch_size=5, capacity=32)
        steps = [model.forward_cached(tokens[:, :12], cache, batch_invariant=True)]
        cache.advance(12)
        for t in range(12, 20):
            steps.append(model.forward_cached(tokens[:, t : t + 1], cache, batch_invariant=True))
            cache.advance(1)
    assert torch.equal(torch.cat(steps, 1), full)
