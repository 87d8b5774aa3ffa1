"""CUDA tensors through the store (shared memory registered with CUDA, and TCP)."""

import pytest
import torch

import tidal.store

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_cuda_round_trip(transport):
    with tidal.store.connect(transport=transport) as store:
        x = torch.randn(257, 129, device="cuda", dtype=torch.bfloat16)
        for v in range(4):  # the ring of slots: pinned segments are reused
            store.put("x", x + v)
            into = torch.empty(129, 257, device="cuda", dtype=torch.bfloat16).t()
            store.get("x", into=into)
            assert torch.equal(into, x + v)
        assert torch.equal(store.get("x").cuda(), x + 3)
        sd = {"a": x, "b": {"c": torch.arange(10, device="cuda")}}
        store.put_state_dict(sd, "sd")
        got = {
            "a": torch.empty_like(x),
            "b": {"c": torch.zeros(10, device="cuda", dtype=torch.int64)},
        }
        store.get_state_dict("sd", into=got)
        assert torch.equal(got["a"], x) and torch.equal(got["b"]["c"], sd["b"]["c"])
