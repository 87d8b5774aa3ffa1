"""Checks of tidal/kernels/batch_invariant.py, run on CPU under Triton's interpreter (in a
subprocess with TRITON_INTERPRET=1, by test_batch_invariant_kernels.py) or on CUDA.

Each case takes a device and small block sizes (the interpreter runs every program in
Python), and asserts: values close to torch's, and bitwise invariance to the rows around.
"""

from __future__ import annotations

import sys

import torch

from tidal.kernels import batch_invariant as tk

SMALL = {"matmul": (4, 8, 8), "row": 16, "attention": (4, 8, 16)}
"""Blocks on CPU (the interpreter): small, so that tiny shapes still span several."""
GPU = {"matmul": tk.MATMUL_BLOCKS, "row": tk.ROW_BLOCK, "attention": tk.ATTENTION_BLOCKS}


def _blocks(device: str, name: str):
    return SMALL[name] if device == "cpu" else GPU[name]


def matmul(device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(0)
    blocks = _blocks(device, "matmul")
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]:
        a = torch.randn(13, 32, generator=g).to(device, dtype)
        w = torch.randn(10, 32, generator=g).to(device, dtype)  # a linear layer's weight
        bias = torch.randn(10, generator=g).to(device, dtype)
        for parts in (1, 2, 8):
            full = tk.matmul(a, w.t(), bias, parts=parts, blocks=blocks)
            want = (a.double() @ w.double().t() + bias.double()).to(dtype)
            torch.testing.assert_close(full, want, atol=tol, rtol=tol)
            for rows in (slice(0, 1), slice(5, 12), slice(12, 13)):
                part = tk.matmul(a[rows], w.t(), bias, parts=parts, blocks=blocks)
                assert torch.equal(part, full[rows]), (dtype, parts, rows)
    # Two ranks of a row-parallel layer: each sums its half of the parts, then the halves
    # added as the tree's top level give the bits of the whole.
    a, w = torch.randn(6, 64, generator=g).to(device), torch.randn(64, 5, generator=g).to(device)
    whole = tk.matmul(a, w, parts=8, blocks=blocks)
    halves = [
        tk.matmul(a[:, h * 32 : h * 32 + 32], w[h * 32 : h * 32 + 32], parts=4, blocks=blocks)
        for h in (0, 1)
    ]
    assert torch.equal(halves[0] + halves[1], whole)


def rows(device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(1)
    block = _blocks(device, "row")
    x = (torch.randn(9, 40, generator=g) * 4).to(device)
    x[3, 7:] = float("-inf")  # masked logits
    w = (torch.rand(40, generator=g) + 0.5).to(device)
    xf = torch.randn(9, 40, generator=g).to(device)
    y, rstd = tk.rms_norm(xf, w, 1e-5, block=block)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(xf, (40,), w, 1e-5))
    assert rstd.shape == (9, 1) and rstd.dtype == torch.float32
    lp = tk.log_softmax(x, block=block)
    torch.testing.assert_close(lp, torch.log_softmax(x, -1))
    targets = torch.randint(0, 7, (9,), generator=g).to(device)
    tok = tk.token_logprobs(x, targets, block=block)
    assert torch.equal(tok, lp.gather(1, targets[:, None])[:, 0])
    xb = xf.to(torch.bfloat16)
    yb, _ = tk.rms_norm(xb, w.to(torch.bfloat16), 1e-5, block=block)
    assert yb.dtype == torch.bfloat16
    for r in (slice(0, 1), slice(2, 8)):
        assert torch.equal(tk.rms_norm(xf[r], w, 1e-5, block=block)[0], y[r])
        assert torch.equal(tk.log_softmax(x[r], block=block), lp[r])
        assert torch.equal(tk.token_logprobs(x[r], targets[r], block=block), tok[r])


def _reference_attention(q, k, v, pos):
    S = k.shape[2]
    visible = torch.arange(S, device=k.device) <= pos[:, :, None]
    return torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=visible[:, None], enable_gqa=True
    )


def attention(device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(2)
    blocks = _blocks(device, "attention")
    B, H, G, K, S = 3, 4, 2, 16, 40
    k = torch.randn(B, G, S, K, generator=g).to(device)
    v = torch.randn(B, G, S, K, generator=g).to(device)
    # Prefill: every position of each sequence.
    T = 37
    q = torch.randn(B, H, T, K, generator=g).to(device)
    pos = torch.arange(T, device=device).expand(B, T)
    pre = tk.attention(q, k[:, :, :T], v[:, :, :T], pos, blocks=blocks)
    torch.testing.assert_close(
        pre, _reference_attention(q, k[:, :, :T], v[:, :, :T], pos), atol=1e-5, rtol=1e-5
    )
    # Decode: one query per sequence at positions 36, 20, 9, over a longer cache (slots past
    # a position hold other data), in a batch of 3 and alone: the prefill's bits.
    p = torch.tensor([36, 20, 9], device=device)
    q_dec = q[torch.arange(B), :, p][:, :, None]  # [B, H, 1, K]
    dec = tk.attention(q_dec, k, v, p[:, None], blocks=blocks)
    for b in range(B):
        assert torch.equal(dec[b, :, 0], pre[b, :, p[b]]), b
        alone = tk.attention(
            q_dec[b : b + 1], k[b : b + 1], v[b : b + 1], p[b : b + 1, None], blocks=blocks
        )
        assert torch.equal(alone[0], dec[b]), b
        # With other sequences of other lengths around it.
        others = torch.cat([k[b : b + 1], torch.randn(2, G, S, K, generator=g).to(device)])
        vo = torch.cat([v[b : b + 1], torch.randn(2, G, S, K, generator=g).to(device)])
        qo = torch.cat([q_dec[b : b + 1], torch.randn(2, H, 1, K, generator=g).to(device)])
        po = torch.tensor([[int(p[b])], [3], [39]], device=device)
        assert torch.equal(tk.attention(qo, others, vo, po, blocks=blocks)[0], dec[b]), b


def model(device: str = "cpu") -> None:
    """The mode's Triton path on the tiny model (on CPU under the interpreter: the kernels are
    switched on for CPU tensors here; the GPU blocks, so fewer programs)."""
    from tests.generate.conftest import tiny_model
    from tidal.generate import logprobs
    from tidal.models import batch_invariant as bi

    net = tiny_model().to(device)
    ids = torch.randint(0, 512, (3, 24), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        torch_path = logprobs(net, ids, batch_invariant=True)
        bi.use_triton(True, on_cpu=device == "cpu")
        try:
            batch = logprobs(net, ids, batch_invariant=True)
            for b in range(3):
                n = 24 - 5 * b  # alone and shorter: the rows' bits do not change
                alone = logprobs(net, ids[b : b + 1, :n], batch_invariant=True)
                assert torch.equal(alone[0], batch[b, : n - 1]), b
        finally:
            bi.use_triton(False)
    torch.testing.assert_close(batch, torch_path, atol=1e-4, rtol=0)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        globals()[name]()
    print("ok")
