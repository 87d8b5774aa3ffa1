"""Context parallelism: each rank holds a slice of every sequence; attention gathers keys and
values over the `cp` mesh dimension.

This is the all-gather form of context parallelism (as used for Llama 3's long-context
training): queries stay local, keys and values of the whole sequence are gathered before
attention (with GQA they are a small fraction of the activations), and the gather's backward
reduce-scatters their gradients. Everything outside attention is per-token and runs on the
local slice unchanged.

Load balancing: with causal masking the last tokens attend to the most keys. The sequence is
cut into 2 x cp chunks and rank r takes chunks r and 2 cp - 1 - r, so every rank gets an equal
share of the causal work. Positions (for RoPE and the mask) stay global.

Masks: SDPA with an explicit boolean mask (causal by global position, and within the same
document when document ids are given), or flex attention with the same rule as a block mask.

Lifecycle: the trainer builds one `ContextParallel` per run; each micro-batch is cut with
`shard(batch)`, the model runs on the local slice with `positions` and the `attention` object
from `attention_for(...)`, and the summed loss of the local tokens is reduced over `dp_cp`
with the token count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

# The gather whose backward reduce-scatters. Recent torch (2.13) names it
# all_gather_single_autograd and warns (FutureWarning) on each call of the old
# all_gather_tensor_autograd, now an alias of it; releases before the rename have only the old
# name, so the new one is taken where it exists.
_all_gather_autograd: Callable[..., torch.Tensor] = getattr(
    funcol, "all_gather_single_autograd", funcol.all_gather_tensor_autograd
)


class ContextParallel:
    def __init__(self, cp_mesh: DeviceMesh, *, load_balance: bool = True):
        self.mesh = cp_mesh
        self.size = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.load_balance = load_balance

    def local_index(self, T: int, device: torch.device) -> torch.Tensor:
        """Global positions [T / cp] of this rank's tokens."""
        if not self.load_balance:
            n = T // self.size
            return torch.arange(self.rank * n, (self.rank + 1) * n, device=device)
        n = T // (2 * self.size)
        first = torch.arange(self.rank * n, (self.rank + 1) * n, device=device)
        mirror = 2 * self.size - 1 - self.rank
        second = torch.arange(mirror * n, (mirror + 1) * n, device=device)
        return torch.cat([first, second])

    def shard(self, *tensors_BT: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's slice (dim 1) of each [B, T, ...] tensor, plus the global positions."""
        T = tensors_BT[0].shape[1]
        idx = self.local_index(T, tensors_BT[0].device)
        return (*(t.index_select(1, idx) for t in tensors_BT), idx)

    def unshard(self, x_BT: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        """The whole sequences [B, cp x T, ...] from every rank's slice `x_BT` [B, T, ...] at
        global `positions_T` (what `shard` returned): the inverse of `shard`, by an all-gather
        over the cp group. No autograd (for scoring, e.g. per-token log-probs)."""
        group = self.mesh.get_group()
        pos_S, x_BS = _gather(positions_T, 0, group), _gather(x_BT, 1, group)
        out_BS = torch.empty_like(x_BS)
        out_BS[:, pos_S] = x_BS
        return out_BS

    def attention_for(
        self, positions_T: torch.Tensor, document_ids_BT: torch.Tensor | None, kind: str
    ) -> CPAttention:
        """The attention strategy for one forward over the local slice."""
        return CPAttention(self, positions_T, document_ids_BT, kind)


class CPAttention:
    """Gathers K/V over the context-parallel group and attends with global positions."""

    def __init__(self, cp: ContextParallel, positions_T, document_ids_BT, kind: str):
        self.cp, self.kind = cp, kind
        group = cp.mesh.get_group()
        # Global position of every gathered key: ranks' slices concatenated in rank order.
        self.q_pos_T = positions_T
        self.k_pos_S = _gather(positions_T, 0, group)
        self.q_doc_BT = document_ids_BT
        self.k_doc_BS = None if document_ids_BT is None else _gather(document_ids_BT, 1, group)
        self.block_mask = None
        if kind == "flex":
            self.block_mask = self._flex_mask()

    def _visible(self) -> torch.Tensor:
        """[B or 1, 1, T, S] boolean: causal by global position, same document if known."""
        vis = (self.k_pos_S[None, :] <= self.q_pos_T[:, None])[None, None]
        if self.q_doc_BT is not None and self.k_doc_BS is not None:
            same = self.q_doc_BT[:, :, None] == self.k_doc_BS[:, None, :]
            vis = vis & same[:, None]
        return vis

    def _flex_mask(self):
        from torch.nn.attention.flex_attention import create_block_mask

        q_pos, k_pos = self.q_pos_T, self.k_pos_S
        q_doc, k_doc = self.q_doc_BT, self.k_doc_BS
        B = 1 if q_doc is None else q_doc.shape[0]

        def mask_mod(b, h, q, kv):
            ok = k_pos[kv] <= q_pos[q]
            if q_doc is not None:
                ok = ok & (q_doc[b, q] == k_doc[b, kv])
            return ok

        return create_block_mask(mask_mod, B, None, len(q_pos), len(k_pos), device=q_pos.device)

    def attend(self, q_BHTK, k_BGTK, v_BGTK) -> torch.Tensor:
        group = self.cp.mesh.get_group()
        k_BGSK = _all_gather_autograd(k_BGTK.contiguous(), 2, group)
        v_BGSK = _all_gather_autograd(v_BGTK.contiguous(), 2, group)
        if self.kind == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            return flex_attention(
                q_BHTK, k_BGSK, v_BGSK, block_mask=self.block_mask, enable_gqa=True
            )
        return F.scaled_dot_product_attention(
            q_BHTK, k_BGSK, v_BGSK, attn_mask=self._visible(), enable_gqa=True
        )


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim` (index tensors: no autograd needed)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
