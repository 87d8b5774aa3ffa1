"""Simulate N ranks in one process: tidal's parallel plans on real data, without processes.

`simulated_ranks(world_size)` starts torch's fake process group and enters torch's
`LocalTensorMode` (torch.distributed._local_tensor, a debugging tool, private and
experimental in torch 2.11-2.13). Inside it every tensor op runs once per simulated rank on
that rank's own values, and a collective combines the ranks' values as the real collective
would: a DTensor sharded over a simulated mesh holds, per rank, exactly the shard that rank
would hold in a real job. So a layout's plan (which weights are split how, where activations
are gathered or reduced) runs with real numbers in one CPU process, under a debugger, with no
launcher; the results can be compared with the single-process model op by op.

Lifecycle (one process, no torchrun)::

    with simulated_ranks(2):
        mesh = build_mesh(ParallelDims(world_size=2, tp=2))
        with torch.device("meta"):
            model = Transformer(args)
        apply_tp(model, mesh["tp"], loss_parallel=False)   # tidal's TP/SP plan
        model.to_empty(device="cpu")
        load_full_weights(model, reference)   # a plain model's weights; not init_weights
        logits = model(tokens)                # every rank's forward, at once
        per_rank(logits)                      # {rank: that rank's values}
        full(logits)                          # one tensor, if every rank agrees

`compare_with_one_process(args, tokens, tp=2, cp=2)` does that for one forward and backward
and returns the largest differences from one process; `python -m tidal.parallel.simulate
--tp 2 --cp 2` prints them for a flavor on the bytes of an English text.

What it covers, measured on torch 2.13 (tests/parallel/test_simulate.py): tensor parallel
with sequence parallel (loss-parallel or replicated logits), context parallel (load-balanced
or contiguous), and both at once, forward and backward, to fp32 rounding. What it does not:

- FSDP2 (and so HSDP, and `parallelize` on a layout with dp_shard or cp > 1): `fully_shard`
  frees a gathered parameter by resizing its storage, which a simulated tensor does not have
  ("Attempted to call resize_() on an invalid python storage", torch 2.13). Context parallel
  is simulated here without FSDP: each rank keeps whole weights, and its gradients are summed
  over the cp ranks, as FSDP's reduce-scatter would. (FSDP's own numerics are covered by the
  gloo tests in tests/parallel/test_parity.py.)
- pipeline parallel: a pipeline rank runs other layers than its neighbours and talks to them
  with point-to-point send/recv, which LocalTensorMode runs only between threads of torch's
  `LocalRunnerMode`; tidal's schedules are not wired to it.
- `Transformer.init_weights` under the mode: truncated-normal init branches on a per-rank
  boolean (`if not mask.any()`), which a simulated tensor cannot answer. Initialize (or load)
  a plain model and copy its weights in with `load_full_weights`.
- compile, CUDA and speed: it is a numerics and plan debugger on CPU, many times slower than
  one process.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tidal.models.flavors import get_flavor
from tidal.models.transformer import ModelArgs, Transformer
from tidal.parallel.context import ContextParallel
from tidal.parallel.dims import NamedMesh, ParallelDims
from tidal.parallel.parallelize import apply_tp


def _local_tensor():
    try:
        from torch.distributed import _local_tensor
    except ImportError as e:  # torch before 2.10 has no LocalTensorMode
        raise ImportError(
            f"simulated ranks need torch.distributed._local_tensor (torch 2.11+); this is "
            f"torch {torch.__version__}"
        ) from e
    return _local_tensor


@contextlib.contextmanager
def simulated_ranks(world_size: int) -> Iterator[object]:
    """Simulate `world_size` ranks in this process until the block ends: a fake default
    process group of that size and LocalTensorMode over its ranks (yielded).

    Raises:
        ValueError: world_size < 1, or a process group already exists in this process.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if dist.is_initialized():
        raise ValueError(
            "simulated_ranks needs a process without a process group; this one has one "
            f"(world size {dist.get_world_size()})"
        )
    lt = _local_tensor()
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        with lt.LocalTensorMode(world_size) as mode:
            yield mode
    finally:
        dist.destroy_process_group()


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> NamedMesh:
    """The layout's named mesh over the simulated ranks (built outside the mode, as torch's
    own LocalTensor tests do: the mesh's rank tables are plain tensors)."""
    with _local_tensor().maybe_disable_local_tensor_mode():
        return dims.build_mesh(device_type)


def _clean(name: str) -> str:
    # Wrappers a parallelize step may put around blocks (activation checkpointing, compile)
    # add name segments that the plain model does not have.
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


@torch.no_grad()
def load_full_weights(model: nn.Module, source: nn.Module | Mapping[str, torch.Tensor]) -> None:
    """Copy full (unsharded) tensors into `model`'s parameters and buffers, each simulated
    rank taking its own shard of a sharded (DTensor) parameter.

    Args:
        model: the parallelized model, materialized (`to_empty`).
        source: a plain model of the same architecture (every parameter and buffer is
            copied, the RoPE tables too), or a state dict (non-persistent buffers, which it
            lacks, are left as they are).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(source, nn.Module):
        tensors = dict(source.named_parameters()) | dict(source.named_buffers())
    else:
        tensors = dict(source)
    persistent = set(model.state_dict())
    for name, target in [*model.named_parameters(), *model.named_buffers()]:
        key = _clean(name)
        if key not in tensors:
            if name in persistent:
                raise KeyError(f"load_full_weights: the source has no tensor {key!r}")
            continue  # a non-persistent buffer (RoPE tables) missing from a state dict
        full = tensors[key].detach().to(device=target.device, dtype=target.dtype)
        if isinstance(target, DTensor):
            # src_data_rank=None: every rank holds the full tensor; each slices its shard.
            shard = distribute_tensor(
                full, target.device_mesh, target.placements, src_data_rank=None
            )
            target.to_local().copy_(shard.to_local())
        else:
            target.copy_(full)


def per_rank(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each simulated rank's values of `t`: its local shard for a DTensor, its own tensor for
    a simulated (LocalTensor) one. Call it inside `simulated_ranks`."""
    from torch.distributed.tensor import DTensor

    lt = _local_tensor()
    local = t.to_local() if isinstance(t, DTensor) else t
    if isinstance(local, lt.LocalTensor):
        return {rank: v.detach().clone() for rank, v in sorted(local._local_tensors.items())}
    mode = lt.enabled_local_tensor_mode()
    ranks = sorted(mode.ranks) if mode is not None else [0]
    return {rank: local.detach().clone() for rank in ranks}  # the same on every rank


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole of `t` as one plain tensor: a DTensor gathered, a simulated tensor whose
    ranks all hold the same values reconciled to one copy.

    Raises:
        ValueError: the simulated ranks hold different values (a replicated tensor that is
            not: the kind of bug this mode is for).
    """
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    values = list(per_rank(t).values())
    for rank, v in enumerate(values[1:], 1):
        if not torch.equal(v, values[0]):
            diff = (v.float() - values[0].float()).abs().max().item()
            raise ValueError(f"ranks 0 and {rank} hold different values (max diff {diff:.3g})")
    return values[0]


# -- a layout against one process ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LayoutDiff:
    """Largest absolute differences between a simulated layout and one process."""

    loss: float
    logits: float
    grads: float
    worst_grad: str
    """The parameter whose gradient differs most."""


def compare_with_one_process(
    args: ModelArgs,
    tokens_BT: torch.Tensor,
    *,
    tp: int = 1,
    cp: int = 1,
    loss_parallel: bool = True,
    cp_load_balance: bool = True,
    seed: int = 0,
) -> LayoutDiff:
    """One forward and backward of the summed next-token cross entropy on `tokens_BT`, in one
    process and on `tp` x `cp` simulated ranks with tidal's tensor-parallel plan and context
    parallelism, in fp32 on CPU. Returns how far the loss, the logits and every gradient of
    the simulated run are from the single process's.

    Under CP each rank's gradients are those of its own tokens' loss; their sum over the cp
    ranks (what FSDP's reduce-scatter computes in a real job) is what is compared.

    Raises:
        ValueError: a degree below 1, or a sequence that does not split over cp.
    """
    from torch.distributed.tensor import DTensor

    if tp < 1 or cp < 1:
        raise ValueError(f"tp and cp must be >= 1, got tp={tp}, cp={cp}")
    inputs_BT, labels_BT = tokens_BT[:, :-1], tokens_BT[:, 1:]
    chunks = 2 * cp if cp_load_balance else cp
    if inputs_BT.shape[1] % chunks:
        raise ValueError(
            f"{inputs_BT.shape[1]} input tokens per row do not split into {chunks} equal chunks "
            f"(cp={cp}{', load-balanced' if cp_load_balance else ''})"
        )
    ref = Transformer(args)
    ref.init_weights(seed=seed)
    ref_logits = ref(inputs_BT)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels_BT.flatten(), reduction="sum")
    ref_loss.backward()

    world = tp * cp
    with simulated_ranks(world):
        mesh = build_mesh(ParallelDims(world_size=world, tp=tp, cp=cp))
        with torch.device("meta"):
            model = Transformer(args)
        if tp > 1:
            apply_tp(model, mesh["tp"], loss_parallel)
        model.to_empty(device="cpu")
        load_full_weights(model, ref)
        kw: dict = {}
        x, y = inputs_BT, labels_BT
        context = None
        if cp > 1:
            context = ContextParallel(mesh["cp"], load_balance=cp_load_balance)
            x, y, positions = context.shard(inputs_BT, labels_BT)
            kw = {
                "positions": positions,
                "attention": context.attention_for(positions, None, "sdpa"),
            }
        logits = model(x, **kw)
        sharded_vocab = tp > 1 and loss_parallel
        with _loss_parallel() if sharded_vocab else contextlib.nullcontext():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
            loss.backward()
        whole = logits.detach()
        if sharded_vocab:
            whole = whole.full_tensor()
        if context is not None:
            whole = context.unshard(whole, positions)
        # Loss and gradients: summed over the cp ranks; the tp ranks of a group hold copies.
        sim_loss = torch.stack(list(per_rank(loss.detach()).values())).sum() / tp
        diffs = {}
        for name, p in model.named_parameters():
            ref_grad = ref.get_parameter(name).grad
            assert p.grad is not None and ref_grad is not None, f"{name} got no gradient"
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            summed = torch.stack(list(per_rank(g).values())).sum(0) / tp
            diffs[name] = (summed - ref_grad).abs().max().item()
        logits_diff = (full(whole) - ref_logits.detach()).abs().max().item()
    worst = max(diffs, key=lambda n: diffs[n])
    return LayoutDiff(
        loss=abs(float(sim_loss) - ref_loss.item()),
        logits=logits_diff,
        grads=diffs[worst],
        worst_grad=worst,
    )


def _loss_parallel():
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def main(argv: list[str] | None = None) -> None:
    """`python -m tidal.parallel.simulate --tp 2 --cp 2`: one step of a layout on simulated
    ranks against one process, on the bytes of an English text."""
    parser = argparse.ArgumentParser(
        prog="python -m tidal.parallel.simulate",
        description="Run tidal's TP/CP layout on simulated ranks in this process (torch's "
        "LocalTensorMode) and compare one forward and backward with one process.",
    )
    parser.add_argument("--flavor", default="tiny", help="model flavor (default tiny)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel degree")
    parser.add_argument("--no-loss-parallel", action="store_true", help="replicated logits")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    opts = parser.parse_args(argv)
    from pydoc_data.topics import topics  # English prose in the standard library

    text = " ".join(topics[k] for k in sorted(topics)).encode()
    n = opts.batch * (opts.seq_len + 1)
    tokens = torch.tensor(list(text[:n])).view(opts.batch, opts.seq_len + 1)  # byte ids
    args = get_flavor(opts.flavor, vocab_size=max(256, get_flavor(opts.flavor).vocab_size))
    diff = compare_with_one_process(
        args, tokens, tp=opts.tp, cp=opts.cp, loss_parallel=not opts.no_loss_parallel
    )
    print(
        f"tp={opts.tp} cp={opts.cp} on {opts.tp * opts.cp} simulated ranks against one process "
        f"({opts.flavor}, fp32): loss {diff.loss:.2e}, logits {diff.logits:.2e}, gradients "
        f"{diff.grads:.2e} (largest in {diff.worst_grad})"
    )


if __name__ == "__main__":
    main()
