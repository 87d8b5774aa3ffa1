"""Mixture-of-experts feed-forward layer (Qwen 3 MoE, with DeepSeek V3's options).

A block of a model whose `ModelArgs.moe` is set replaces its SwiGLU MLP with `MoE`:

- Router: a linear map D -> E (no bias), softmax over the experts in fp32.
- Top-k: each token goes to its k highest-scoring experts; their weights are the softmax
  probabilities, renormalized to sum to one when `norm_topk_prob` (Qwen3-30B-A3B), cast
  back to the activations' dtype, as transformers computes them.
- Experts: E SwiGLU MLPs, `w2(silu(w1 x) * w3 x)`, stored stacked as w1 [E, F, D],
  w2 [E, D, F], w3 [E, F, D] (expert e's slices are Hugging Face's per-expert matrices).
- Expert compute: the token copies are sorted by expert; on a GPU (sm90+, bf16 compute) one
  `torch._grouped_mm` per projection over groups padded to 16 bytes of rows (the grouped
  kernel's alignment); elsewhere, and in batch-invariant mode (whose fixed-block matmuls
  then make each token's result independent of the batch), one matmul per expert over its
  contiguous rows (`GroupedExperts.impl`). No capacity factor: every token reaches its k
  experts, none is dropped.
- Shared experts (DeepSeek V3, `n_shared_experts`): one always-on SwiGLU of width
  n_shared x F added to the routed output.
- Load balancing (`load_balance`):
  - "aux_loss" (Switch / Qwen): the layer computes E * sum_e f_e * P_e, f_e the fraction of
    the N x k routed slots that went to expert e and P_e the mean router probability of e
    (1.0 when perfectly balanced); the trainer adds coefficient x its mean over layers to
    the loss (`training.moe_aux_loss_coef`).
  - "bias" (aux-loss-free, DeepSeek V3): a per-expert bias is added to the scores for the
    choice of experts only (the weights stay the unbiased probabilities); after each
    optimizer step `update_expert_bias` moves it by `bias_update_rate` x sign(mean count -
    count) from the step's tokens per expert, outside autograd. The aux loss is still
    computed, as a metric.
- Metrics without a trainer: each layer keeps its last forward's tokens per expert
  (`last_counts_E`) and auxiliary loss (`last_aux_loss`, with its graph);
  `collect_moe(model)` gathers them after a forward. The model holds no parallelism code.
- Profiling: under a running torch profiler, in eager mode, the forward's parts are named
  ranges `moe.router`, `moe.dispatch`, `moe.experts`, `moe.combine`, `moe.shared_experts`
  (`span` in tidal/models/profiling.py; benchmarks/moe_profile.py sums the time under each,
  backward included); with no profiler, and always under torch.compile, they are not opened.
- Routing replay (R3, for RL): each layer also keeps the experts its last forward chose
  (`last_experts_NK`: a generator records them per token); inside `replay_routing(model,
  experts)` every layer takes the given experts instead of its top-k, with its own router's
  probabilities at them (renormalized as above) as the weights, so the gradient still
  reaches the router.

Shape legend: N tokens (batch x time), D model dim, E experts, K experts per token (top-k),
M routed token copies (N x K, sorted by expert; padded for the grouped kernel), F expert
hidden dim, L MoE layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from tidal.models.batch_invariant import BatchInvariantMode
from tidal.models.profiling import span


@dataclass(kw_only=True, frozen=True, slots=True)
class MoEArgs:
    """The mixture-of-experts MLP of every block (`ModelArgs.moe`)."""

    n_experts: int = 8
    """Routed experts E."""
    top_k: int = 2
    """Experts per token K."""
    ffn_dim: int = 256
    """Hidden width F of each expert's SwiGLU (Hugging Face's moe_intermediate_size)."""
    norm_topk_prob: bool = True
    """Renormalize the k chosen probabilities to sum to one (Qwen 3 MoE's norm_topk_prob)."""
    n_shared_experts: int = 0
    """Always-on shared experts (DeepSeek V3): one SwiGLU of width n_shared_experts x ffn_dim
    added to the routed output; 0 for none (Qwen 3 MoE)."""
    load_balance: Literal["aux_loss", "bias"] = "aux_loss"
    """aux_loss: the trainer adds the router's auxiliary loss (Switch/Qwen). bias: aux-loss-free
    balancing by a per-expert selection bias updated after each step (DeepSeek V3)."""
    bias_update_rate: float = 1e-3
    """Step of the expert-bias update per optimizer step (DeepSeek V3's gamma); load_balance
    "bias" only."""

    def __post_init__(self) -> None:
        if self.n_experts < 1 or self.top_k < 1 or self.ffn_dim < 1:
            raise ValueError(
                f"moe.n_experts={self.n_experts}, moe.top_k={self.top_k} and "
                f"moe.ffn_dim={self.ffn_dim} must be positive"
            )
        if self.top_k > self.n_experts:
            raise ValueError(f"moe.top_k={self.top_k} exceeds moe.n_experts={self.n_experts}")
        if self.n_shared_experts < 0:
            raise ValueError(f"moe.n_shared_experts={self.n_shared_experts} must be >= 0")
        if self.load_balance not in ("aux_loss", "bias"):
            raise ValueError(
                f"moe.load_balance must be 'aux_loss' or 'bias', got {self.load_balance!r}"
            )
        if not self.bias_update_rate >= 0:
            raise ValueError(f"moe.bias_update_rate={self.bias_update_rate} must be >= 0")

    def active_params(self, dim: int) -> int:
        """Parameters of one layer's MLP that a token uses (router, k experts, shared)."""
        return dim * self.n_experts + 3 * dim * self.ffn_dim * (self.top_k + self.n_shared_experts)

    def inactive_params(self, dim: int) -> int:
        """Parameters of one layer's routed experts that a token does not use."""
        return 3 * dim * self.ffn_dim * (self.n_experts - self.top_k)


MOE_SPANS = ("moe.router", "moe.dispatch", "moe.experts", "moe.combine", "moe.shared_experts")
"""The profiler ranges of `MoE.forward`, in order (see `span` in tidal/models/profiling.py)."""


def route(
    x_ND: torch.Tensor,
    router_ED: torch.Tensor,
    bias_E: torch.Tensor | None,
    top_k: int,
    norm_topk_prob: bool,
    experts_NK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing: (weights [N, K] in x's dtype, experts [N, K] int64, fp32 probs [N, E]).
    `bias_E` (aux-loss-free balancing) shifts the choice, not the weights. `experts_NK`
    (routing replay) is the choice, in its order; the weights are the probabilities there."""
    probs_NE = F.linear(x_ND, router_ED).float().softmax(dim=-1)
    if experts_NK is not None:
        experts_NK = experts_NK.long()
        weights_NK = probs_NE.gather(1, experts_NK)
    elif bias_E is None:
        weights_NK, experts_NK = probs_NE.topk(top_k, dim=-1)
    else:
        _, experts_NK = (probs_NE + bias_E.float()).topk(top_k, dim=-1)
        weights_NK = probs_NE.gather(1, experts_NK)
    if norm_topk_prob:
        weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
    return weights_NK.to(x_ND.dtype), experts_NK, probs_NE


def aux_loss(probs_NE: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Switch-style load-balancing loss E * sum_e f_e * P_e (1.0 when balanced): f_e the share
    of routed slots at expert e (no gradient), P_e its mean router probability."""
    E = probs_NE.shape[-1]
    f_E = counts_E.float() / counts_E.sum().clamp(min=1)
    return E * (f_E * probs_NE.mean(dim=0)).sum()


def experts_loop(
    x_MD: torch.Tensor,
    counts_E: torch.Tensor,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
) -> torch.Tensor:
    """SwiGLU of each expert over its rows of `x_MD` (rows sorted by expert, `counts_E` per
    expert): one matmul per projection and expert (reads the counts on the host)."""
    outs = []
    for e, x_mD in enumerate(x_MD.split(counts_E.tolist())):
        if x_mD.shape[0] == 0:
            continue
        h_mF = F.silu(x_mD @ w1_EFD[e].T) * (x_mD @ w3_EFD[e].T)
        outs.append(h_mF @ w2_EDF[e].T)
    if not outs:  # no rows at all
        return x_MD.new_zeros(0, w2_EDF.shape[1])
    return torch.cat(outs)


def experts_grouped_mm(
    x_MD: torch.Tensor,
    counts_E: torch.Tensor,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
) -> torch.Tensor:
    """`experts_loop`'s result through `torch._grouped_mm`, without a host sync.

    Each expert's group starts on a multiple of 16 bytes of rows (the kernel's alignment, which
    the weight-gradient product needs as its contraction runs over the rows): rows are
    scattered into a buffer of static size M + E x (align - 1), zeros in the gaps, and the
    results gathered back."""
    M = x_MD.shape[0]
    E = counts_E.shape[0]
    align = max(1, 16 // x_MD.element_size())
    padded_E = (counts_E + align - 1) // align * align
    ends_E = padded_E.cumsum(0)
    starts_E = ends_E - padded_E
    # Row r of x (expert e, its i-th row) goes to starts_E[e] + i.
    first_E = counts_E.cumsum(0) - counts_E
    expert_M = torch.repeat_interleave(torch.arange(E, device=x_MD.device), counts_E, output_size=M)
    dest_M = starts_E[expert_M] + torch.arange(M, device=x_MD.device) - first_E[expert_M]
    P = M + E * (align - 1)
    x_PD = x_MD.new_zeros(P, x_MD.shape[1]).index_copy(0, dest_M, x_MD)
    offs_E = ends_E.to(torch.int32)
    gate_PF = torch._grouped_mm(x_PD, w1_EFD.transpose(-2, -1), offs=offs_E)
    up_PF = torch._grouped_mm(x_PD, w3_EFD.transpose(-2, -1), offs=offs_E)
    y_PD = torch._grouped_mm(F.silu(gate_PF) * up_PF, w2_EDF.transpose(-2, -1), offs=offs_E)
    return y_PD[dest_M]


def grouped_mm_available(x: torch.Tensor, dtype: torch.dtype, *dims: int) -> bool:
    """Whether `torch._grouped_mm` runs this product: the torch has it, the compute is bf16 on
    an sm90+ GPU, and every row stride is a multiple of 16 bytes."""
    if not hasattr(torch, "_grouped_mm") or not x.is_cuda or dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(d % 8 == 0 for d in dims)


class GroupedExperts(nn.Module):
    """The E routed SwiGLU experts, stacked: `w1` [E, F, D], `w2` [E, D, F], `w3` [E, F, D].

    `forward(x_MD, counts_E)` takes the token copies already sorted by expert with the count
    per expert, so an expert-parallel wrapper can exchange rows and counts around it."""

    def __init__(self, dim: int, n_experts: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.impl: Literal["auto", "grouped_mm", "loop"] = "auto"
        """auto: grouped_mm where `grouped_mm_available`, else loop."""

    def forward(self, x_MD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        return self.compute(x_MD, counts_E, self.w1, self.w2, self.w3)

    def compute(
        self,
        x_MD: torch.Tensor,
        counts_E: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
    ) -> torch.Tensor:
        """The experts `w1`/`w2`/`w3` (these parameters, or an expert-parallel rank's local
        slices of them) over rows sorted by expert, `counts_E` per expert."""
        impl = self.impl
        if impl == "auto" and _batch_invariant():
            impl = "loop"  # the mode's fixed-block matmuls; it has no grouped kernel
        if impl == "auto":
            device = x_MD.device.type
            autocast = torch.is_autocast_enabled(device)
            dtype = torch.get_autocast_dtype(device) if autocast else x_MD.dtype
            ok = grouped_mm_available(x_MD, dtype, w1.shape[1], w1.shape[2])
            impl = "grouped_mm" if ok else "loop"
            if ok:  # autocast does not cover _grouped_mm: cast here
                x_MD, w1, w2, w3 = (t.to(dtype) for t in (x_MD, w1, w2, w3))
        if impl == "grouped_mm":
            return experts_grouped_mm(x_MD, counts_E, w1, w2, w3)
        return experts_loop(x_MD, counts_E, w1, w2, w3)


def _batch_invariant() -> bool:
    """Whether the forward runs in batch-invariant mode (tidal/models/batch_invariant.py)."""
    return any(isinstance(m, BatchInvariantMode) for m in _get_current_dispatch_mode_stack())


class SharedExperts(nn.Module):
    """The always-on SwiGLU of DeepSeek V3's shared experts (names as `FeedForward`'s)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_ND)) * self.w3(x_ND))


class MoE(nn.Module):
    """The mixture-of-experts MLP of one block (see the module docstring).

    Parameters: `router.weight` [E, D], `experts.w1` / `w2` / `w3`, `shared_experts.*` when
    configured; buffer `expert_bias` [E] (persistent, so checkpoints keep it) with
    load_balance "bias" only."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = nn.Linear(dim, args.n_experts, bias=False)
        self.experts = GroupedExperts(dim, args.n_experts, args.ffn_dim)
        self.shared_experts: SharedExperts | None = None
        if args.n_shared_experts:
            self.shared_experts = SharedExperts(dim, args.n_shared_experts * args.ffn_dim)
        self.expert_bias: torch.Tensor | None
        bias = torch.zeros(args.n_experts) if args.load_balance == "bias" else None
        self.register_buffer("expert_bias", bias)
        self.last_counts_E: torch.Tensor | None = None
        """Tokens routed to each expert by the last forward (int64, detached)."""
        self.last_aux_loss: torch.Tensor | None = None
        """The last forward's auxiliary loss (fp32 0-dim, with its graph)."""
        self.last_experts_NK: torch.Tensor | None = None
        """The experts the last forward routed each token to ([B x T, K] int64, detached)."""
        self.replay_BTK: torch.Tensor | None = None
        """Routing replay: the experts of each token of the next forwards ([B, T, K] ints),
        set by `replay_routing`; None routes by top-k."""

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Zero the expert bias (after `to_empty`) and forget the last forward's statistics."""
        if self.expert_bias is not None:
            self.expert_bias.zero_()
        self.last_counts_E = self.last_aux_loss = self.last_experts_NK = None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        K, E = self.args.top_k, self.args.n_experts
        x_ND = x_BTD.reshape(B * T, D)
        replay_NK = None
        if self.replay_BTK is not None:
            if tuple(self.replay_BTK.shape) != (B, T, K):
                raise ValueError(
                    f"routing replay: experts of shape {tuple(self.replay_BTK.shape)} for a "
                    f"forward of [B, T] = [{B}, {T}] tokens, top_k={K}: expected {(B, T, K)}"
                )
            replay_NK = self.replay_BTK.reshape(B * T, K).to(x_ND.device)
        with span("moe.router"):
            weights_NK, experts_NK, probs_NE = route(
                x_ND, self.router.weight, self.expert_bias, K, self.args.norm_topk_prob, replay_NK
            )
        self.last_experts_NK = experts_NK.detach()
        with span("moe.dispatch"):
            # Sort the N x K token copies by expert (stable: by token within an expert).
            flat_M = experts_NK.flatten()
            order_M = flat_M.argsort(stable=True)
            # histc, not bincount: a static shape that torch.compile keeps in the graph.
            counts_E = torch.histc(flat_M.float(), bins=E, min=0, max=E).to(torch.int64)
            x_MD = x_ND[order_M // K]
        self.last_counts_E = counts_E.detach()
        with span("moe.router"):
            self.last_aux_loss = aux_loss(probs_NE, counts_E)
        with span("moe.experts"):
            y_MD = self.experts(x_MD, counts_E)
        with span("moe.combine"):
            # Back to (token, slot) order, weighted and summed over the K slots.
            y_NKD = torch.empty_like(y_MD).index_copy(0, order_M, y_MD).view(B * T, K, D)
            out_ND = (y_NKD * weights_NK.to(y_NKD.dtype)[..., None]).sum(dim=1)
        if self.shared_experts is not None:
            with span("moe.shared_experts"):
                out_ND = out_ND + self.shared_experts(x_ND)
        return out_ND.view(B, T, D)


# ---------------------------------------------------------------------------------------
# statistics and balancing, for a trainer that knows nothing else of the model


class MoEStats(NamedTuple):
    """One forward's routing statistics over a model's MoE layers."""

    aux_loss: torch.Tensor
    """Mean auxiliary loss over the layers (fp32 0-dim, with its graph)."""
    counts_LE: torch.Tensor
    """Tokens routed to each expert, per layer (int64, detached)."""


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE modules, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def collect_moe(model: nn.Module) -> MoEStats | None:
    """The statistics of the model's last forward, or None for a model without MoE layers
    (or one whose MoE layers have not run)."""
    layers = moe_layers(model)
    if not layers or any(m.last_aux_loss is None for m in layers):
        return None
    aux = torch.stack([m.last_aux_loss for m in layers]).mean()  # type: ignore[misc]
    counts = torch.stack([m.last_counts_E for m in layers])  # type: ignore[misc]
    return MoEStats(aux, counts)


def moe_shape(model: nn.Module) -> tuple[int, int, int] | None:
    """(MoE layers, experts, top-k) of a model, None for a dense one."""
    layers = moe_layers(model)
    if not layers:
        return None
    return len(layers), layers[0].args.n_experts, layers[0].args.top_k


def expert_dtype(n_experts: int) -> torch.dtype:
    """The compact integer dtype of expert ids (routing records): uint8 up to 256 experts,
    else int16 (up to 32768)."""
    return torch.uint8 if n_experts <= 256 else torch.int16


@contextlib.contextmanager
def replay_routing(model: nn.Module, experts_BLTK: torch.Tensor) -> Iterator[None]:
    """Routing replay: inside, MoE layer l of `model` (module order) routes token (b, t) to
    the experts `experts_BLTK[b, l, t]` (in that order) instead of its top-k, its weights its
    own router's probabilities there (renormalized as the model does; the gradient reaches
    the router). Covers the backward too when it recomputes (activation checkpointing).

    Raises:
        ValueError: a dense model, or records of another number of layers or top-k (one
            line, before any forward; the ids are the caller's to check, on the host)."""
    layers = moe_layers(model)
    shape = moe_shape(model)
    if shape is None:
        raise ValueError("routing replay needs a mixture-of-experts model; this one is dense")
    L, _, K = shape
    if experts_BLTK.dim() != 4 or experts_BLTK.shape[1] != L or experts_BLTK.shape[3] != K:
        raise ValueError(
            f"routed experts of shape {tuple(experts_BLTK.shape)} do not match the model: "
            f"expected [batch, {L} MoE layers, time, top_k {K}]"
        )
    try:
        for i, m in enumerate(layers):
            m.replay_BTK = experts_BLTK[:, i]
        yield
    finally:
        for m in layers:
            m.replay_BTK = None


@torch.no_grad()
def update_expert_bias(model: nn.Module, counts_LE: torch.Tensor) -> None:
    """Aux-loss-free balancing (DeepSeek V3): move each layer's expert bias by
    `bias_update_rate` toward its under-loaded experts, `bias += rate * sign(mean - count)`,
    from the tokens per expert of a step (`counts_LE`, the same on every rank). Layers with
    load_balance "aux_loss" are left alone."""
    layers = moe_layers(model)
    if counts_LE.shape[0] != len(layers):
        raise ValueError(f"counts for {counts_LE.shape[0]} MoE layers, the model has {len(layers)}")
    for m, counts_E in zip(layers, counts_LE, strict=True):
        if m.expert_bias is None:
            continue
        c = counts_E.float().to(m.expert_bias.device)
        m.expert_bias += m.args.bias_update_rate * torch.sign(c.mean() - c).to(m.expert_bias.dtype)


def load_metrics(counts_LE: torch.Tensor) -> dict[str, torch.Tensor]:
    """Load balance of a step from its tokens per expert: `moe_load_max` / `moe_load_min`, the
    largest / smallest expert load over the mean load over every layer (1.0 is balanced), and
    `moe_dropped_tokens` (0: there is no capacity factor)."""
    c = counts_LE.float()
    load = c / c.mean(dim=1, keepdim=True).clamp(min=1e-9)
    return {
        "moe_load_max": load.amax(),
        "moe_load_min": load.amin(),
        "moe_dropped_tokens": torch.zeros((), device=c.device),
    }
