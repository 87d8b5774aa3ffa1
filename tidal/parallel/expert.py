"""Expert parallelism: a mixture-of-experts model's routed experts spread over the `ep` ranks.

`apply_ep(model, ep_mesh)` shards the stacked expert weights of every `GroupedExperts`
(tidal/models/moe.py) along the expert dimension over the `ep` mesh (DTensor `Shard(0)`: rank
r holds experts [r E/ep, (r+1) E/ep)) and gives the module an expert-parallel forward. The
model itself is unchanged: `MoE.forward` still routes its own tokens, sorts the N x K copies
by (global) expert and calls `experts(x_MD, counts_E)`; around the local expert compute:

1. dispatch: the counts per expert go through one all-to-all (equal splits of E/ep), so each
   rank learns how many rows every other rank sends to each of its local experts; the row
   split sizes are read on the host, and the rows go through `all_to_all_single`;
2. the received rows (ordered by source rank, then local expert) are regrouped by local
   expert (a stable sort) and run through `GroupedExperts.compute` with the local slices;
3. combine: the results are put back in received order and returned to their ranks by the
   reverse all-to-all, in the order the layer sent them.

The all-to-alls are autograd functions whose backward is the reverse exchange, so gradients
of the inputs return to the ranks that sent the rows and each expert's weight gradient sums
the contributions of every rank's tokens. `ep` borrows its ranks from dp_shard
(tidal/parallel/dims.py): `shard_experts` FSDP-shards the experts over the remaining
`dp_shard_mod_ep` ranks (on their hidden/model dimension, dim 1, so the two shardings stay
independent), and their gradients are scaled so that they end up divided by the whole
data-parallel group, as every other parameter's. Works on gloo (CPU tests) and NCCL.

Beside tensor parallel (TP for attention; `tp_plan_block(moe=True)` in
tidal/parallel/parallelize.py), the MoE runs replicated over the `tp` ranks. Its input, the
sequence-sharded activations, is all-gathered into a plain tensor, so every TP rank of a
data-parallel rank holds the same tokens; each routes all of them with its own copy of the
router and shared experts, and dispatches them by all-to-all over its `ep` group, which is
made of ranks of the same TP index (`ep` is carved from dp_shard alone, not from tp). The
output, the same on every TP rank, is cut back to this rank's part of the sequence. Because
the TP ranks of one data-parallel rank do exactly the same work on the same data, the
gradients of the router, the shared experts and the experts are whole (not partial) and equal
on every TP rank: they need no sum over `tp`, only the usual reduction over the data-parallel
ranks (FSDP), and the input's gradient is sliced back to each rank's part of the sequence.
Nothing inside the MoE changes. The price is that the MoE's compute (and its all-to-alls) is
repeated on each TP rank instead of split among them. torchtitan instead lets `ep` borrow the
TP ranks (ep over dp_shard x tp): each TP rank routes only its own sequence shard, which
splits the MoE work, but the router's gradient is then partial and must be summed over tp
(a Replicate DTensor on the tp mesh does that) and the shared experts are TP-sharded like a
dense MLP; that is the faster design to move to when the MoE dominates the step time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tidal.models.moe import GroupedExperts, moe_layers


class _AllToAll(torch.autograd.Function):
    """Rows of `x` exchanged over `group`: `in_splits[r]` rows go to rank r, `out_splits[r]`
    come from it. Backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        g = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return g, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable `all_to_all_single` over the rows of `x`."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _local(w: torch.Tensor, grad_scale: float) -> torch.Tensor:
    w = w.to_local() if isinstance(w, DTensor) else w
    return w if grad_scale == 1.0 else _ScaleGrad.apply(w, grad_scale)


class ExpertParallelExperts(GroupedExperts):
    """`GroupedExperts` whose w1/w2/w3 are DTensors sharded over the `ep` ranks (made by
    `apply_ep` from a GroupedExperts in place: same parameters, same state-dict keys)."""

    ep_group: dist.ProcessGroup
    ep: int
    grad_scale: float
    """Factor on the local weights' gradients (set by `shard_experts`: FSDP's average over
    dp_shard_mod_ep times it is the average over the whole data-parallel group)."""

    def forward(self, x_MD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        ep, group = self.ep, self.ep_group
        E = counts_E.shape[0]
        El = E // ep  # experts per rank
        # Rows this rank sends to each rank's experts, and receives: [source rank, local expert].
        recv_SE = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_SE, counts_E.contiguous(), group=group)
        recv_SE = recv_SE.view(ep, El)
        send = counts_E.view(ep, El).sum(1).tolist()
        recv = recv_SE.sum(1).tolist()
        x_RD = all_to_all(x_MD, recv, send, group)
        # Received rows run by (source rank, local expert): regroup them by local expert.
        R = x_RD.shape[0]
        expert_R = torch.repeat_interleave(
            torch.arange(El, device=x_RD.device).repeat(ep), recv_SE.flatten(), output_size=R
        )
        order_R = expert_R.argsort(stable=True)
        s = self.grad_scale
        y_RD = self.compute(
            x_RD[order_R],
            recv_SE.sum(0),
            _local(self.w1, s),
            _local(self.w2, s),
            _local(self.w3, s),
        )
        y_RD = torch.empty_like(y_RD).index_copy(0, order_R, y_RD)
        return all_to_all(y_RD, send, recv, group)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Shard every MoE layer's routed experts of `model` over `ep_mesh` (in place, on a meta
    or a materialized model) and give them the all-to-all forward. Returns the number of
    expert modules converted."""
    ep = ep_mesh.size()
    n = 0
    for moe in moe_layers(model):
        experts = moe.experts
        assert moe.args.n_experts % ep == 0, "check_layout validates ep against the experts"
        for name in ("w1", "w2", "w3"):
            p = getattr(experts, name)
            # src_data_rank=None: every rank slices its experts locally (no scatter), as
            # init_weights later draws the full tensor on every rank anyway.
            d = distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(d, requires_grad=p.requires_grad))
        experts.__class__ = ExpertParallelExperts
        assert isinstance(experts, ExpertParallelExperts)
        experts.ep, experts.ep_group, experts.grad_scale = ep, ep_mesh.get_group(), 1.0
        n += 1
    return n


def shard_experts(
    block: nn.Module,
    mesh: DeviceMesh,
    *,
    mp: MixedPrecisionPolicy,
    reshard_after_forward: bool,
    divide_factor: float,
) -> None:
    """FSDP2 over `mesh` (dp_shard_mod_ep) for the expert-parallel experts inside `block`,
    before the block's own fully_shard (which then leaves their parameters alone). Their
    gradients end up divided by `divide_factor` (the data-parallel world, as FSDP divides the
    others' by their mesh size): FSDP averages over `mesh` and the forward scales the local
    weights' gradients by mesh size / divide_factor (1/ep; FSDP's own
    `set_gradient_divide_factor` needs PREMUL_SUM, which gloo lacks)."""
    for m in block.modules():
        if isinstance(m, ExpertParallelExperts):
            fully_shard(
                m,
                mesh=mesh,
                mp_policy=mp,
                reshard_after_forward=reshard_after_forward,
                shard_placement_fn=lambda p: Shard(1),
            )
            m.grad_scale = mesh.size() / divide_factor
