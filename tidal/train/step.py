"""The forward and backward passes of one training step on one rank, on every layout: the
default cross entropy or an injected `TokenLoss` (tidal/train/loss.py), and per-token
log-probs for scoring.

Lifecycle: the Trainer builds one `StepPath` after parallelizing its model (and sets
`pipeline` once the schedule exists, whose loss function is `StepPath.pp_loss`). Each
optimizer step calls `backward(batches, n_tokens, loss)` on every rank; the Trainer then
clips and steps the optimizer. `logprobs(batch)` and `validation_loss_sum(batch)` run
forward only (the Trainer switches the modules to eval mode around them).

Per layout:

- one process / FSDP / TP: the loss runs after the model's forward on this rank's
  micro-batch. Without TP and PP (and outside batch-invariant mode) the default loss is
  fused with the output projection (`fused_loss`): the model hands its final hidden states
  to `linear_cross_entropy_sum` in place of the logits. Under loss-parallel TP the logits
  are vocabulary-sharded DTensors; the default loss is loss_parallel's cross entropy, an
  injected one gets its log-probs from `token_logprobs`' distributed log-sum-exp (the same
  values on every TP rank).
- pipeline parallel: the schedule calls `pp_loss(output, target)` on the last stage per
  pipeline micro-batch. For the default loss the target is the labels. An injected loss needs
  the micro-batch's extras, which torch's schedules cannot split (they split one target
  tensor): its target is the rows' indices (an int64 CPU tensor [B]), and `pp_loss` slices
  the step's batch to those rows (`Batch.row_slice`). Metrics and log-probs are recorded per
  micro-batch keyed by their first row (a schedule may compute micro-batch 0 once more while
  inferring shapes) and reduced over the pipeline group, so every rank gets them.
- context parallel: the default loss sums over this rank's slice of every sequence and the
  count covers whole sequences. `logprobs` gathers the slices back into whole rows. An
  injected loss is refused: per-sequence terms (GRPO's per-sequence means, GSPO's sequence
  ratio) need whole rows, which a CP rank does not hold.

Gradient scale: FSDP averages gradients over its data-parallel (and CP) ranks; the backward
loss is multiplied by that count (`grad_scale`) so the result is the gradient of the sum.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tidal.models.transformer import ModelArgs, Transformer
from tidal.parallel.context import ContextParallel
from tidal.parallel.pipeline import PipelineRunner
from tidal.train.data import Batch
from tidal.train.loss import (
    IGNORE_INDEX,
    StepNorms,
    TokenLoss,
    cross_entropy_sum,
    linear_cross_entropy_sum,
    token_logprobs,
)


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
    the same on every rank. Empty for the default cross entropy."""


MicroBatchCall = Callable[[torch.Tensor, int, int], torch.Tensor]
"""(last-stage output, first row, end row) -> the loss the schedule backpropagates."""


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
        self.pipeline: PipelineRunner | None = None
        self.pp_norm: float | torch.Tensor = 1.0  # the default loss's scale under PP
        self._pp_call: MicroBatchCall | None = None  # an injected loss's, during a schedule call

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

    def dim(self, name: str) -> DeviceMesh:
        assert self.mesh is not None, f"mesh dimension {name!r} needs a multi-rank run"
        return self.mesh[name]

    def reduce(
        self, x: torch.Tensor, dim: str = "dp_cp", op: Any = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """All-reduce over a mesh dimension (identity on one process)."""
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
        with self.loss_context():
            return self.token_loss_sum(logits, labels)

    def pp_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function, per micro-batch on the last stage: the default cross
        entropy (target: labels), or the bound call of an injected loss (target: rows)."""
        if self._pp_call is None:
            with self.loss_context():
                return self.token_loss_sum(logits, target) * self.pp_norm
        return self._pp_call(logits, int(target[0]), int(target[-1]) + 1)

    @contextlib.contextmanager
    def _bound(self, call: MicroBatchCall) -> Iterator[None]:
        self._pp_call = call
        try:
            yield
        finally:
            self._pp_call = None

    def _pipeline_rows(self, batch: Batch) -> torch.Tensor:
        assert self.pipeline is not None
        B, n = batch.input_ids.shape[0], self.pipeline.n_microbatches
        if B % n:
            raise ValueError(
                f"a batch of {B} rows does not split into parallelism.pp_microbatches={n} "
                "equal pipeline micro-batches"
            )
        return torch.arange(B)  # on the host: slicing by it needs no device sync

    # -- one step -------------------------------------------------------------------------

    def backward(
        self, batches: list[Batch], n_tokens: int, loss: TokenLoss | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward of every micro-batch, gradients accumulated; returns the step
        loss over all ranks and the injected loss's reduced metrics."""
        # A step whose batches hold no target (chat rows of prompts only) contributes 0.
        count = self.global_count(n_tokens)
        count = max(count, 1.0) if isinstance(count, float) else count.clamp(min=1.0)
        if loss is not None:
            return self._backward_injected(batches, count, loss)
        scale = self.grad_scale / count
        total = torch.zeros((), device=self.device)
        for batch in batches:
            if self.pipeline is not None:
                self.pp_norm = scale
                with self.autocast():  # the schedule runs forward and backward inside
                    out = self.pipeline.step(batch.input_ids, batch.labels, **self.model_kwargs)
                if out is not None:
                    total += plain(out.detach()) / self.grad_scale
                continue
            value = self.forward_loss(batch) * scale
            with self.loss_context():
                value.backward()
            total += plain(value.detach()) / self.grad_scale
        if self.pipeline is not None:
            total = self.reduce(total, "pp")  # only the last stage holds the loss
        return self.reduce(total), {}

    def _micro_loss(
        self, logits: torch.Tensor, batch: Batch, loss: TokenLoss, norms: StepNorms
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        entropy = getattr(loss, "wants_entropy", False)  # a plain function: no entropy
        logp, ent = token_logprobs(
            logits, batch.labels, entropy=entropy, batch_invariant=self.batch_invariant
        )
        value, metrics = loss(logp, batch, norms, ent)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise ValueError(f"an injected loss must return a 0-dim tensor, got {value!r}")
        return value, {k: v.detach() for k, v in metrics.items()}

    def _backward_injected(
        self, batches: list[Batch], count: float | torch.Tensor, loss: TokenLoss
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.cp is not None:
            raise ValueError(
                "an injected loss does not run under context parallelism (parallelism.cp="
                f"{self.cp.size}): per-sequence terms need whole rows; use parallelism.cp 1"
            )
        rows = torch.zeros((), device=self.device)
        for b in batches:  # counted on the device: no sync
            rows += (b.labels != IGNORE_INDEX).any(1).sum()
        sequences = self.reduce(rows, "dp").clamp(min=1.0)
        norms = StepNorms(tokens=count, sequences=sequences)
        total = torch.zeros((), device=self.device)
        per_micro: list[dict[str, torch.Tensor]] = []
        for batch in batches:
            if self.pipeline is None:
                logits, _, _ = self.forward(batch)
                value, metrics = self._micro_loss(logits, batch, loss, norms)
                (value * self.grad_scale).backward()
                total += value.detach()
                per_micro.append(metrics)
                continue
            recorded: dict[int, dict[str, torch.Tensor]] = {}

            def call(logits, start, stop, batch=batch, recorded=recorded):
                value, recorded[start] = self._micro_loss(
                    logits, batch.row_slice(start, stop), loss, norms
                )
                return value * self.grad_scale

            target = self._pipeline_rows(batch)
            with self._bound(call), self.autocast():
                out = self.pipeline.step(batch.input_ids, target, **self.model_kwargs)
            if out is not None:
                total += plain(out.detach()) / self.grad_scale
            per_micro += [recorded[k] for k in sorted(recorded)]
        if self.pipeline is not None:
            total = self.reduce(total, "pp")  # only the last stage holds the loss
        return self.reduce(total, "dp"), self._reduce_metrics(per_micro)

    def _reduce_metrics(self, per_micro: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        names = sorted(set().union(*per_micro))
        if self.pipeline is not None:  # only last-stage ranks computed any: share the names
            everyone: list[Any] = [None] * self.dim("pp").size()
            dist.all_gather_object(everyone, names, group=self.dim("pp").get_group())
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
            if self.pipeline is not None:
                vals = self.reduce(vals, "pp", op)
            vals = self.reduce(vals, "dp", op)
            out |= {k: vals[i] for i, k in enumerate(keys)}
        return {k: out[k] for k in names}

    # -- forward only ---------------------------------------------------------------------

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """fp32 [B, T] log p(labels) of one batch, 0 where the label is IGNORE_INDEX, on every
        rank (the caller disables grad and sets eval mode)."""
        if self.pipeline is None:
            logits, labels, positions = self.forward(batch)
            logp, _ = token_logprobs(logits, labels, batch_invariant=self.batch_invariant)
            if self.cp is not None:
                assert positions is not None
                logp = self.cp.unshard(logp, positions)
            return logp
        if not self.pipeline.can_eval:
            raise RuntimeError(
                "Trainer.logprobs under pipeline parallel needs forward-only schedules "
                "(PipelineSchedule.eval, torch >= 2.9)"
            )
        recorded: dict[int, torch.Tensor] = {}

        def call(logits, start, stop):
            recorded[start], _ = token_logprobs(
                logits, batch.labels[start:stop], batch_invariant=self.batch_invariant
            )
            return torch.zeros((), device=self.device)

        target = self._pipeline_rows(batch)
        with self._bound(call), self.autocast():
            self.pipeline.eval(batch.input_ids, target, **self.model_kwargs)
        if self.pipeline.has_last:
            logp = torch.cat([recorded[k] for k in sorted(recorded)])
        else:
            logp = torch.zeros(batch.labels.shape, device=self.device)
        return self.reduce(logp, "pp")  # x + 0 is x: the last stage's values, exactly

    def validation_loss_sum(self, batch: Batch) -> torch.Tensor:
        """Summed token loss of one batch (this rank's part; the last stage's under PP, 0
        elsewhere), forward only."""
        if self.pipeline is None:
            return plain(self.forward_loss(batch)).float()
        self.pp_norm = 1.0
        with self.autocast():
            out = self.pipeline.eval(batch.input_ids, batch.labels, **self.model_kwargs)
        return plain(out).float() if out is not None else torch.zeros((), device=self.device)
