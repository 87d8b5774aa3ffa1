"""The store moves a mixture-of-experts state dict between an expert-parallel trainer layout
(2 gloo ranks, EP 2: experts as DTensor shards over ep, the rest FSDP over 2) and one process
(full tensors), resharding on read, in both directions; every byte of every tensor is
checked against the same model initialized in the layout it is read into."""

from __future__ import annotations

import dataclasses

import torch

import tidal.store
from tests.parallel._launch import run_ranks


def moe_model(ep: int):
    """A 2-layer debug_moe (bias balancing, a non-zero bias) initialized from seed 3, spread
    as EP `ep` over the process group's ranks (ep 1: one process, unsharded)."""
    from tidal.models.flavors import get_flavor
    from tidal.models.moe import moe_layers
    from tidal.models.transformer import Transformer
    from tidal.parallel.config import ActivationCheckpointConfig, ParallelismConfig
    from tidal.parallel.dims import ParallelDims
    from tidal.parallel.parallelize import parallelize

    args = get_flavor("debug_moe", n_layers=2, vocab_size=512)
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, load_balance="bias"))
    with torch.device("meta"):
        model = Transformer(args)
    if ep > 1:
        dims = ParallelDims(dp_shard=ep, ep=ep, world_size=ep)
        parallelize(
            model,
            dims.build_mesh("cpu"),
            dims,
            ParallelismConfig(ep=ep),
            ActivationCheckpointConfig(),
            compile=False,
            param_dtype=None,
        )
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    for i, m in enumerate(moe_layers(model)):
        assert m.expert_bias is not None
        m.expert_bias.copy_(torch.arange(8.0) * 1e-3 - i)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def same_bytes(got: dict, want: dict) -> int:
    """Asserts every tensor of `got` has the bytes of `want`'s (local shards); returns the
    number of bytes compared."""
    assert sorted(got) == sorted(want)
    n = 0
    for k, v in got.items():
        a, b = _local(v).contiguous(), _local(want[k]).contiguous()
        assert a.shape == b.shape and a.dtype == b.dtype, k
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), k
        n += a.numel() * a.element_size()
    return n


def ep_job(rank, world, address):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo")
    model = moe_model(ep=world)
    sd = model.state_dict()
    experts = sd["layers.0.feed_forward.experts.w1"]
    assert isinstance(experts, DTensor) and _local(experts).shape[0] == 8 // world
    store = tidal.store.connect(address)
    try:
        store.put_state_dict(sd, "moe_ep", version=0)
        # The one-process put, read into this rank's shards.
        got = {k: torch.zeros_like(v) for k, v in sd.items()}
        store.get_state_dict("moe_one", into=got, version=0)
        plain = {k: v for k, v in sd.items() if not isinstance(v, DTensor)}
        return same_bytes(got, sd), same_bytes(plain, plain)
    finally:
        store.close()


def test_store_reshards_moe_state_dicts_between_ep_and_one_process(tmp_path):
    torch.set_num_threads(1)
    one = moe_model(ep=1).state_dict()
    with tidal.store.connect(keep=2) as store:
        store.put_state_dict(one, "moe_one", version=0)
        checked = run_ranks(2, ep_job, store.address, tmp_path=tmp_path)
        got = {k: torch.zeros_like(v) for k, v in one.items()}
        store.get_state_dict("moe_ep", into=got, version=0)
    total = sum(v.numel() * v.element_size() for v in one.values())
    assert same_bytes(got, one) == total
    # Each EP rank compared its shards (half the experts, half of every other parameter)
    # and the unsharded tensors (the expert biases): together, every byte once, the
    # unsharded ones on both ranks.
    (a, plain), (b, _) = checked
    assert plain > 0 and a + b - plain == total
