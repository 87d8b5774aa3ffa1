"""The training step's forward and backward through a pipeline schedule on this rank
(`parallelism.pp` > 1): the pipeline half of tidal/train/step.py.

The schedule cuts each batch into `parallelism.pp_microbatches` pipeline micro-batches by rows,
runs the stages, and calls the loss once per pipeline micro-batch on the last stage. What
that loss needs besides the stage's output (the step's normalizers, an injected loss, the
labels and per-token extras of its rows) is no state of this class: each call passes a
`MicroBatchLoss` and the batch through the schedule as keyword arguments of its loss function,
as torchtitan passes its token count. The schedule's target is the rows' indices (an int64
host tensor [B], so slicing by it needs no device sync), and the loss function slices the
batch to the rows of its micro-batch (`Batch.row_slice`).

What a loss records per micro-batch (an injected loss's metrics, log-probs) comes back keyed
by first row, in row order: a schedule may call the loss on micro-batch 0 once more while it
infers shapes, and the second record replaces the first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tidal.parallel.pipeline import PipelineRunner, StageModels
from tidal.train.data import Batch

MicroBatchLoss = Callable[[torch.Tensor, Batch], tuple[torch.Tensor, Any]]
"""(last-stage output of a pipeline micro-batch, its rows of the batch) -> (the loss the
schedule backpropagates, or sums under `forward`; a record handed back to the caller)."""


def _schedule_loss(
    output: torch.Tensor,
    rows: torch.Tensor,
    *,
    loss: MicroBatchLoss,
    batch: Batch,
    records: dict[int, Any],
) -> torch.Tensor:
    """The schedule's loss function: `loss` on this micro-batch's rows of `batch`."""
    start, stop = int(rows[0]), int(rows[-1]) + 1
    value, records[start] = loss(output, batch.row_slice(start, stop))
    return value


class PipelineStep:
    """Runs batches through this rank's pipeline stages (see the module docstring).

    Args:
        stages: this rank's stage modules (`build_stages`), parallelized and initialized.
        pp_group: the pipeline process group.
        device: this rank's device.
        schedule: a `parallelism.pp_schedule` name.
        n_microbatches: pipeline micro-batches per batch.
    """

    def __init__(
        self,
        stages: StageModels,
        pp_group: Any,
        device: torch.device,
        schedule: str,
        n_microbatches: int,
    ):
        self.runner = PipelineRunner(
            stages, pp_group, device, schedule, n_microbatches, _schedule_loss
        )

    @property
    def has_last(self) -> bool:
        """Whether this rank holds the last stage (the only one that computes the loss)."""
        return self.runner.has_last

    @property
    def can_eval(self) -> bool:
        """Whether this torch has forward-only schedules (`forward`)."""
        return self.runner.can_eval

    def forward_backward(
        self, batch: Batch, loss: MicroBatchLoss, **model_kwargs: Any
    ) -> tuple[torch.Tensor | None, list[Any]]:
        """Forward and backward of one batch. Returns the sum of the losses the schedule
        backpropagated and the records in row order on the last stage's rank; None and []
        elsewhere. `model_kwargs` (non-tensor options such as batch_invariant) reach every
        stage."""
        return self._run(self.runner.step, batch, loss, model_kwargs)

    def forward(
        self, batch: Batch, loss: MicroBatchLoss, **model_kwargs: Any
    ) -> tuple[torch.Tensor | None, list[Any]]:
        """Forward only (the caller disables grad); returns as `forward_backward`."""
        if not self.can_eval:
            raise RuntimeError(
                "a forward-only pass under pipeline parallel needs forward-only schedules "
                "(PipelineSchedule.eval, torch >= 2.9)"
            )
        return self._run(self.runner.eval, batch, loss, model_kwargs)

    def _run(
        self, run: Callable[..., Any], batch: Batch, loss: MicroBatchLoss, model_kwargs: Any
    ) -> tuple[torch.Tensor | None, list[Any]]:
        B, n = batch.input_ids.shape[0], self.runner.n_microbatches
        if B % n:
            raise ValueError(
                f"a batch of {B} rows does not split into parallelism.pp_microbatches={n} "
                "equal pipeline micro-batches"
            )
        records: dict[int, Any] = {}
        loss_kwargs = {"loss": loss, "batch": batch, "records": records}
        out = run(batch.input_ids, torch.arange(B), loss_kwargs, **model_kwargs)
        return out, [records[k] for k in sorted(records)]
