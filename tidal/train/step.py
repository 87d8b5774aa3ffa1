"""The forward and backward passes of one training step on one rank, on every layout: the
default cross entropy or an injected `TokenLoss` (tidal/train/loss.py), and per-token
log-probs for scoring.

Lifecycle: the Trainer builds one `StepPath` after parallelizing its model (under PP with
the `PipelineStep` of its stages, tidal/train/pipeline_step.py). Each optimizer step calls
`backward(batches, n_tokens, loss)` on every rank; the Trainer then clips and steps the
optimizer. `logprobs(batch)` and `validation_loss_sum(batch)` run forward only (the Trainer
switches the modules to eval mode around them).

One step, as nanochat and torchtitan write it:

    step_loss = step_loss(batches, n_tokens, loss)   # the step's normalizers, once
    for batch in batches:                            # gradient accumulation
        forward, loss of the batch, backward         # forward_backward(batch, step_loss)
    all-reduce the reported loss and metrics

Loss normalization: the step minimizes the sum over micro-batches and data-parallel ranks of
each micro-batch's share of the step's loss, so every share is normalized by the step's
totals, never by its own counts: the default cross entropy is each micro-batch's sum of
token losses / the step's valid labels over all data-parallel ranks (`StepLoss.tokens`); an
injected loss gets those and the step's rows with a valid label as `StepNorms` and returns
its share itself. Gradients accumulate in `.grad` over the micro-batches; nothing is divided
by their number. FSDP averages gradients over its data-parallel (and CP) ranks; each value
backward starts from is multiplied by that count (`grad_scale`), so the result is the
gradient of the sum.

The micro-batch path is one for both losses: the model's output goes to the `StepLoss`
(`loss(output, batch)`), which returns the value to backpropagate. Per layout:

- one process / FSDP / TP: the forward runs on this rank's micro-batch, then the loss and
  backward. Without TP and PP (and outside batch-invariant mode) the default loss is fused
  with the output projection (`fused_loss`): the model hands its final hidden states to
  `linear_cross_entropy_sum` in place of the logits. Under loss-parallel TP the logits are
  vocabulary-sharded DTensors; the default loss is loss_parallel's cross entropy, an
  injected one gets its log-probs from `token_logprobs`' distributed log-sum-exp (the same
  values on every TP rank).
- pipeline parallel: the schedule runs forward and backward and calls the same `StepLoss`
  on the last stage per pipeline micro-batch, passed per call as a keyword argument of its
  loss function (tidal/train/pipeline_step.py). The step's loss and metrics live on the last
  stage and are reduced over the pipeline group, so every rank gets them.
- mixture of experts (tidal/models/moe.py): after each micro-batch's forward the router's
  auxiliary loss (mean over layers) is added to the value backward starts from, x
  `moe_aux_coef` / the step's micro-batches (a mean over micro-batches; FSDP's average
  makes it a mean over ranks), and the tokens per expert are summed over the step and the
  data-parallel ranks (`moe_counts`, for the aux-loss-free bias update and the load metrics
  `moe_aux_loss`, `moe_load_max`, `moe_load_min`, `moe_dropped_tokens`). Not under PP.
- routing replay (RL, mixture of experts): a batch whose extras hold "routed_experts"
  [B, MoE layers, T, top_k] runs its forward, and the backward's recomputation, with every MoE
  layer routing to those experts (`tidal.models.moe.replay_routing`). Not under PP or CP.
- context parallel: the default loss sums over this rank's slice of every sequence and the
  count covers whole sequences. `logprobs` gathers the slices back into whole rows. An
  injected loss is refused: per-sequence terms (GRPO's per-sequence means, GSPO's sequence
  ratio) need whole rows, which a CP rank does not hold.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tidal.models.moe import collect_moe, load_metrics, replay_routing
from tidal.models.transformer import ModelArgs, Transformer
from tidal.parallel.context import ContextParallel
from tidal.train.data import Batch
from tidal.train.loss import (
    IGNORE_INDEX,
    StepNorms,
    TokenLoss,
    cross_entropy_sum,
    linear_cross_entropy_sum,
    token_logprobs,
)
from tidal.train.pipeline_step import PipelineStep


def plain(x: torch.Tensor) -> torch.Tensor:
    """A loss-parallel loss is a replicated DTensor; every rank holds the whole value."""
    return x.full_tensor() if isinstance(x, DTensor) else x


@dataclass
class StepResult:
    """What one optimizer step reports."""

    loss: torch.Tensor
    """The step's loss over all ranks (0-dim, not synced): the mean token loss for the
    default cross entropy, the sum of the injected loss's micro-batch values otherwise."""
    grad_norm: torch.Tensor
    """Global L2 norm of the gradients, before clipping."""
    tokens: int
    """Token positions processed by all data-parallel ranks."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """The injected loss's metrics reduced over micro-batches and data-parallel ranks (sum;
    max for names ending in "_max", min for "_min"): 0-dim fp32 device tensors, not synced,
    the same on every rank. Empty for the default cross entropy. A mixture-of-experts model
    adds its routing metrics (`moe_*`, see `StepPath.moe_metrics`)."""


class MicroRecord(NamedTuple):
    """What one micro-batch's loss reports besides the value it backpropagates."""

    loss: torch.Tensor
    """Its share of the step's reported loss (detached). Under PP the step reports the sum of
    what the schedule backpropagated instead (/ `grad_scale`), as the schedule returns it."""
    metrics: dict[str, torch.Tensor]
    """An injected loss's metrics (detached); empty for the default cross entropy."""


@dataclass(frozen=True)
class StepLoss:
    """One optimizer step's loss, as each micro-batch applies it to the model's output: the
    default cross entropy, or an injected `TokenLoss`, normalized by the step's totals over
    every micro-batch and data-parallel rank. Built once per step and passed per call (under
    PP through the schedule, as a keyword argument of its loss function): nothing of it
    outlives the step.

    Called as `loss(output, batch, labels=None) -> (value, MicroRecord)`: `value` is what
    backward starts from, scaled by `grad_scale` (the gradient of the step's loss, summed
    over FSDP ranks); `labels` default to the batch's (under CP: this rank's slice)."""

    path: StepPath
    tokens: float | torch.Tensor
    """Valid labels of the step, at least 1 (`StepNorms.tokens`)."""
    fn: TokenLoss | None = None
    """The injected loss; None for the default cross entropy."""
    sequences: float | torch.Tensor = 1.0
    """Rows with a valid label, at least 1 (`StepNorms.sequences`; injected losses only)."""
    aux_scale: float = 0.0
    """Weight of a micro-batch's MoE auxiliary loss: the coefficient / the step's micro-batches
    (0: not added)."""

    @property
    def fused(self) -> bool:
        """Whether the model's output is already the summed cross entropy (`fused_loss`)."""
        return self.fn is None and self.path.fused_loss

    def __call__(
        self, output: torch.Tensor, batch: Batch, labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, MicroRecord]:
        path, labels = self.path, batch.labels if labels is None else labels
        if self.fn is None:
            # This micro-batch's summed token losses / the step's tokens (x grad_scale).
            summed = output if self.fused else path.token_loss_sum(output, labels)
            value = summed * (path.grad_scale / self.tokens)
            return value, MicroRecord(plain(value.detach()) / path.grad_scale, {})
        entropy = getattr(self.fn, "wants_entropy", False)  # a plain function: no entropy
        logp, ent = token_logprobs(
            output, labels, entropy=entropy, batch_invariant=path.batch_invariant
        )
        norms = StepNorms(tokens=self.tokens, sequences=self.sequences)
        value, metrics = self.fn(logp, batch, norms, ent)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise ValueError(f"an injected loss must return a 0-dim tensor, got {value!r}")
        detached = {k: v.detach() for k, v in metrics.items()}
        return value * path.grad_scale, MicroRecord(value.detach(), detached)


class StepPath:
    """Forward and backward of micro-batches on this rank (see the module docstring)."""

    def __init__(
        self,
        *,
        model: Transformer,
        args: ModelArgs,
        mesh: Any,
        cp: ContextParallel | None,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
        loss_parallel: bool,
        grad_scale: int,
        batch_invariant: bool,
        document_mask: bool = False,
        fused_loss: bool = False,
        pipeline: PipelineStep | None = None,
        moe_aux_coef: float = 0.0,
    ):
        self.model, self.args, self.mesh, self.cp = model, args, mesh, cp
        # Packed chat samples: each sees only its own document with SDPA too (a dense mask;
        # flex attention always masks documents). Not under CP or PP: there plainly causal.
        self.document_mask = document_mask and cp is None
        self.device, self.autocast_dtype = device, autocast_dtype
        self.loss_parallel, self.grad_scale = loss_parallel, grad_scale
        self.batch_invariant = batch_invariant
        # The default loss fused with the output projection (no [N, V] logits); the caller
        # sets it only where the projection is a plain matrix product on this rank.
        self.fused_loss = fused_loss and not loss_parallel and not batch_invariant
        # Model options for every forward; empty by default, so the default path's calls are
        # exactly what they were before batch-invariant mode existed.
        self.model_kwargs: dict[str, Any] = {"batch_invariant": True} if batch_invariant else {}
        self.pipeline = pipeline
        # The router's auxiliary loss weight (MoE models balanced by aux_loss; 0 otherwise).
        self.moe_aux_coef = moe_aux_coef
        self.moe_counts: torch.Tensor | None = None
        """Tokens per expert [L, E] of the last step, summed over micro-batches and data-parallel
        ranks (None for a dense model)."""
        self._moe_aux: list[torch.Tensor] = []

    # -- contexts and reductions ----------------------------------------------------------

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def loss_context(self):
        """Loss-parallel cross entropy on vocabulary-sharded logits (TP), else nothing."""
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def reduce(
        self, x: torch.Tensor, dim: str = "dp_cp", op: Any = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """All-reduce over a mesh dimension (identity on one process or a dimension of 1:
        over "pp" without pipeline parallel)."""
        if self.mesh is not None and self.mesh[dim].size() > 1:
            dist.all_reduce(x, op=op, group=self.mesh[dim].get_group())
        return x

    def global_count(self, n: int) -> float | torch.Tensor:
        """`n` summed over data-parallel ranks (every CP rank counted whole sequences). One
        process: a Python number. Several: a device tensor, copied from pinned memory without
        blocking the host, so a step still never waits for the device."""
        if self.mesh is None or self.mesh["dp"].size() == 1:
            return float(n)
        pinned = self.device.type == "cuda"
        host = torch.tensor(float(n), pin_memory=pinned)
        return self.reduce(host.to(self.device, non_blocking=pinned), "dp")

    def routing(self, batch: Batch) -> contextlib.AbstractContextManager:
        """Routing replay for a batch whose extras hold "routed_experts", else nothing."""
        experts = batch.extras.get("routed_experts")
        if experts is None:
            return contextlib.nullcontext()
        if self.pipeline is not None or self.cp is not None:
            raise ValueError(
                "routing replay (loss.routing_replay) runs without pipeline or context "
                "parallelism: set parallelism.pp 1 and parallelism.cp 1"
            )
        return replay_routing(self.model, experts)

    # -- forward --------------------------------------------------------------------------

    def forward(
        self, batch: Batch, *, fused_loss: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Logits of this rank's part of a micro-batch (no pipeline), its labels, and under CP
        the global positions of its slice (None otherwise). With `fused_loss`, the summed
        cross entropy of that part (`linear_cross_entropy_sum`) in place of the logits."""
        flex = self.args.attention == "flex"
        doc_ids = batch.document_ids if flex or self.document_mask else None
        input_ids, labels = batch.input_ids, batch.labels
        kw: dict[str, Any] = {"document_ids": doc_ids, **self.model_kwargs}
        positions = None
        if self.cp is not None:
            if doc_ids is not None:
                input_ids, labels, doc_ids, positions = self.cp.shard(input_ids, labels, doc_ids)
            else:
                input_ids, labels, positions = self.cp.shard(input_ids, labels)
            attention = self.cp.attention_for(positions, doc_ids, "flex" if flex else "sdpa")
            kw = {"positions": positions, "attention": attention}
        if fused_loss:
            kw["head"] = functools.partial(linear_cross_entropy_sum, labels_BT=labels)
        with self.autocast():
            return self.model(input_ids, **kw), labels, positions

    def token_loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The default loss: summed cross entropy of one micro-batch's tokens."""
        with self.loss_context():
            if self.loss_parallel:  # a DTensor sharded over the vocabulary
                return F.cross_entropy(
                    logits.flatten(0, 1).float(),
                    labels.flatten(),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
            return cross_entropy_sum(logits, labels)

    def forward_loss(self, batch: Batch) -> torch.Tensor:
        """Summed token loss of one micro-batch (of this rank's slice under CP; no pipeline)."""
        if self.fused_loss:
            return self.forward(batch, fused_loss=True)[0]
        logits, labels, _ = self.forward(batch)
        return self.token_loss_sum(logits, labels)

    # -- one step -------------------------------------------------------------------------

    def backward(
        self, batches: list[Batch], n_tokens: int, loss: TokenLoss | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward of every micro-batch, gradients accumulated; returns the step
        loss over all ranks and the injected loss's reduced metrics."""
        step_loss = self.step_loss(batches, n_tokens, loss)
        total = torch.zeros((), device=self.device)
        metrics: list[dict[str, torch.Tensor]] = []
        self.moe_counts, self._moe_aux = None, []
        for batch in batches:
            share, micro_metrics = self.forward_backward(batch, step_loss)
            total += share
            metrics += micro_metrics
        total = self.reduce(self.reduce(total, "pp"))  # under PP only the last stage has it
        reduced = {} if loss is None else self._reduce_metrics(metrics)
        return total, reduced | self.moe_metrics()

    def step_loss(self, batches: list[Batch], n_tokens: int, loss: TokenLoss | None) -> StepLoss:
        """The step's loss with its normalizers: `n_tokens` (this rank's valid labels) and,
        for an injected loss, the rows with a valid label, summed over data-parallel ranks."""
        # A step whose batches hold no target (chat rows of prompts only) contributes 0.
        count = self.global_count(n_tokens)
        tokens = max(count, 1.0) if isinstance(count, float) else count.clamp(min=1.0)
        aux_scale = self.moe_aux_coef / len(batches)
        if loss is None:
            return StepLoss(self, tokens, aux_scale=aux_scale)
        if self.cp is not None:
            raise ValueError(
                "an injected loss does not run under context parallelism (parallelism.cp="
                f"{self.cp.size}): per-sequence terms need whole rows; use parallelism.cp 1"
            )
        rows = torch.zeros((), device=self.device)
        for b in batches:  # counted on the device: no sync
            rows += (b.labels != IGNORE_INDEX).any(1).sum()
        sequences = self.reduce(rows, "dp").clamp(min=1.0)
        return StepLoss(self, tokens, loss, sequences, aux_scale)

    def forward_backward(
        self, batch: Batch, loss: StepLoss
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """Forward, loss and backward of one micro-batch (under PP: of its pipeline
        micro-batches, in the schedule); returns its share of the step's loss (0 on pipeline
        ranks without the last stage) and the loss's metrics."""
        if self.pipeline is not None:
            self.routing(batch)  # refuses routing replay
            with self.autocast():  # the schedule runs forward, loss and backward inside
                out, records = self.pipeline.forward_backward(batch, loss, **self.model_kwargs)
            if out is None:
                return torch.zeros((), device=self.device), []
            return plain(out.detach()) / self.grad_scale, [r.metrics for r in records]
        with self.routing(batch):  # the backward too: activation checkpoints recompute
            output, labels, _ = self.forward(batch, fused_loss=loss.fused)
            value, record = loss(output, batch, labels)
            moe = collect_moe(self.model) if self.args.moe is not None else None
            if moe is not None:
                if loss.aux_scale:
                    value = value + loss.aux_scale * moe.aux_loss
                counts = moe.counts_LE
                self.moe_counts = counts if self.moe_counts is None else self.moe_counts + counts
                self._moe_aux.append(moe.aux_loss.detach())
            with self.loss_context():
                value.backward()
        return record.loss, [record.metrics]

    def moe_metrics(self) -> dict[str, torch.Tensor]:
        """The step's routing metrics of a mixture-of-experts model (empty otherwise), the same
        on every rank: `moe_aux_loss` (the auxiliary loss, mean over layers, micro-batches and
        data-parallel ranks) and the load balance of `tidal.models.moe.load_metrics`. Sums
        `moe_counts` over the data-parallel ranks."""
        if self.moe_counts is None:
            return {}
        self.moe_counts = self.reduce(self.moe_counts)
        aux = self.reduce(torch.stack(self._moe_aux).mean())
        ranks = self.mesh["dp_cp"].size() if self.mesh is not None else 1
        return {"moe_aux_loss": aux / ranks} | load_metrics(self.moe_counts)

    def _reduce_metrics(self, per_micro: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Micro-batch metrics reduced over micro-batches, pipeline stages (only the last
        computed any) and data-parallel ranks: sum, or max/min for "_max"/"_min" names."""
        names = sorted(set().union(*per_micro))
        if self.mesh is not None and self.mesh["pp"].size() > 1:  # share the last stage's names
            everyone: list[Any] = [None] * self.mesh["pp"].size()
            dist.all_gather_object(everyone, names, group=self.mesh["pp"].get_group())
            names = sorted(set().union(*everyone))
        out: dict[str, torch.Tensor] = {}
        for suffix, op, fill in (
            ("_max", dist.ReduceOp.MAX, -torch.inf),
            ("_min", dist.ReduceOp.MIN, torch.inf),
            ("", dist.ReduceOp.SUM, 0.0),
        ):
            keys = [k for k in names if k.endswith(suffix) and k not in out]
            if not keys:
                continue
            vals = torch.full((len(keys),), fill, device=self.device)
            for i, k in enumerate(keys):
                got = [m[k].float() for m in per_micro if k in m]
                if got:
                    stacked = torch.stack(got)
                    vals[i] = (
                        stacked.amax()
                        if suffix == "_max"
                        else (stacked.amin() if suffix == "_min" else stacked.sum())
                    )
            vals = self.reduce(self.reduce(vals, "pp", op), "dp", op)
            out |= {k: vals[i] for i, k in enumerate(keys)}
        return {k: out[k] for k in names}

    # -- forward only ---------------------------------------------------------------------

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """fp32 [B, T] log p(labels) of one batch, 0 where the label is IGNORE_INDEX, on every
        rank (the caller disables grad and sets eval mode)."""
        if self.pipeline is None:
            with self.routing(batch):
                logits, labels, positions = self.forward(batch)
            logp, _ = token_logprobs(logits, labels, batch_invariant=self.batch_invariant)
            if self.cp is not None:
                assert positions is not None
                logp = self.cp.unshard(logp, positions)
            return logp

        def record(logits: torch.Tensor, micro: Batch) -> tuple[torch.Tensor, torch.Tensor]:
            logp, _ = token_logprobs(logits, micro.labels, batch_invariant=self.batch_invariant)
            return torch.zeros((), device=self.device), logp

        self.routing(batch)  # refuses routing replay
        with self.autocast():
            _, records = self.pipeline.forward(batch, record, **self.model_kwargs)
        if self.pipeline.has_last:
            logp = torch.cat(records)
        else:
            logp = torch.zeros(batch.labels.shape, device=self.device)
        return self.reduce(logp, "pp")  # x + 0 is x: the last stage's values, exactly

    def validation_loss_sum(self, batch: Batch) -> torch.Tensor:
        """Summed token loss of one batch (this rank's part; the last stage's under PP, 0
        elsewhere), forward only."""
        if self.pipeline is None:
            return plain(self.forward_loss(batch)).float()

        def summed(logits: torch.Tensor, micro: Batch) -> tuple[torch.Tensor, None]:
            return self.token_loss_sum(logits, micro.labels), None

        with self.autocast():
            out, _ = self.pipeline.forward(batch, summed, **self.model_kwargs)
        return plain(out).float() if out is not None else torch.zeros((), device=self.device)
