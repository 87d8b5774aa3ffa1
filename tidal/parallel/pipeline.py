"""Pipeline parallelism with `torch.distributed.pipelining`.

The model is cut by layers into `pp x stages_per_rank` stages. Each stage is a Transformer
built on the meta device with the layers it does not own deleted: the first stage keeps the
embedding, the last keeps the final norm and output projection, the others pass hidden states.
Layer names keep their global index (`layers.7` stays `layers.7`), so state dicts of stages
line up with the full model's.

Stage placement on pipeline ranks: one stage per rank for GPipe and 1F1B; a loop
(rank r holds stages r, r + pp, ...) for Interleaved1F1B, LoopedBFS and
InterleavedZeroBubble; a V (rank r holds stages r and 2 pp - 1 - r) for ZBVZeroBubble.

Lifecycle: every pipeline rank calls `build_stages`, parallelizes each stage module like a
whole model (TP, AC, compile, FSDP), materializes and initializes it, then `build_schedule`.
Each training step calls `PipelineRunner.step`, which feeds the batch on the rank holding the
first stage and the loss target on the rank holding the last.

Loss targets: the schedule splits the inputs and one target tensor into micro-batches by rows
(`torch.tensor_split` on dim 0) and calls `loss_fn(output, target_mb, **loss_kwargs)` on the
last stage. The target is anything with the batch's rows in dim 0 (the trainer passes row
indices, so that its loss can slice the labels and per-token inputs with the same rows);
`loss_kwargs` are the same for every micro-batch of one call and change from call to call
(the step's normalizers, its loss): the runner binds them to its loss function for the
length of the call (torch's own `loss_kwargs` argument is missing from torch 2.11), so no
state is kept between calls.
On its first step, and after each switch between `step` and `eval`, a schedule may call
`loss_fn` once more on micro-batch 0 while inferring shapes; a loss that records anything per
micro-batch keys it by rows. Every batch must have the shape of the first, with rows
divisible by the number of micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as pp_schedules

from tidal.models.transformer import ModelArgs, Transformer
from tidal.parallel.config import ParallelismConfig

SCHEDULE_CLASSES = {
    "GPipe": pp_schedules.ScheduleGPipe,
    "1F1B": pp_schedules.Schedule1F1B,
    "Interleaved1F1B": pp_schedules.ScheduleInterleaved1F1B,
    "LoopedBFS": pp_schedules.ScheduleLoopedBFS,
    "InterleavedZeroBubble": pp_schedules.ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": pp_schedules.ScheduleZBVZeroBubble,
}
SINGLE_STAGE = ("GPipe", "1F1B")


ZBV_GLOO_MIN_TORCH = (2, 13)
"""torch 2.11's ZBVZeroBubble fails its first step on gloo: the shape exchange of the V's
first stage breaks the connection ("Pair is not connected"; measured on 2.11, fine on 2.13)."""


def require_zbv_support(schedule: str, pp_group) -> None:
    """Refuse ZBVZeroBubble on gloo with a torch older than ZBV_GLOO_MIN_TORCH, in one line
    before any stage is built, instead of gloo's error at the first step."""
    if schedule != "ZBVZeroBubble" or dist.get_backend(pp_group) != "gloo":
        return
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version < ZBV_GLOO_MIN_TORCH:
        need = ".".join(map(str, ZBV_GLOO_MIN_TORCH))
        raise ValueError(
            f"parallelism.pp_schedule 'ZBVZeroBubble' on gloo (CPU) needs torch >= {need}, "
            f"this is {torch.__version__}: its first step fails in torch's shape exchange; "
            "use 'InterleavedZeroBubble' or a newer torch"
        )


def stage_layers(n_layers: int, n_stages: int, split: str = "") -> list[list[int]]:
    """Layer indices of each stage: an even split, explicit first-layer indices ("4,8,12"),
    or explicit module lists ("tok_embeddings,layers.0;layers.1,norm,output")."""
    if any(c.isalpha() for c in split):
        return _module_lists(n_layers, n_stages, split)
    if split:
        cuts = [int(x) for x in split.split(",")]
        if len(cuts) != n_stages - 1 or cuts[-1] >= n_layers:
            raise ValueError(
                f"parallelism.pp_split={split!r} must list {n_stages - 1} increasing layer "
                f"indices below {n_layers} (the first layer of stages 2..{n_stages})"
            )
        bounds = [0, *cuts, n_layers]
    else:
        if n_stages > n_layers:
            raise ValueError(f"{n_stages} pipeline stages exceed the {n_layers} layers")
        base, extra = divmod(n_layers, n_stages)
        bounds = [0]
        for s in range(n_stages):
            bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return [list(range(bounds[s], bounds[s + 1])) for s in range(n_stages)]


def _module_lists(n_layers: int, n_stages: int, split: str) -> list[list[int]]:
    """Parse and check per-stage module lists; the ends must sit on the first/last stage."""
    where = f"parallelism.pp_split={split!r}"
    stages = [[m.strip() for m in part.split(",") if m.strip()] for part in split.split(";")]
    if len(stages) != n_stages:
        raise ValueError(f"{where} lists {len(stages)} stages; the layout has {n_stages}")
    layers: list[list[int]] = []
    for s, names in enumerate(stages):
        ids = []
        for name in names:
            if name == "tok_embeddings" and s != 0:
                raise ValueError(f"{where}: tok_embeddings must be on the first stage")
            if name in ("norm", "output") and s != n_stages - 1:
                raise ValueError(f"{where}: {name} must be on the last stage")
            if name.startswith("layers.") and name[7:].isdigit():
                ids.append(int(name[7:]))
            elif name not in ("tok_embeddings", "norm", "output"):
                raise ValueError(
                    f"{where}: unknown module {name!r} (tok_embeddings, layers.N, norm, output)"
                )
        layers.append(ids)
    flat = [i for ids in layers for i in ids]
    if flat != list(range(n_layers)):
        raise ValueError(f"{where} must list layers.0 .. layers.{n_layers - 1} once each, in order")
    if "tok_embeddings" not in stages[0] or not {"norm", "output"} <= set(stages[-1]):
        raise ValueError(
            f"{where}: the first stage must hold tok_embeddings and the last norm and output"
        )
    return layers


def stage_ids_for_rank(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    if schedule == "ZBVZeroBubble":
        assert stages_per_rank == 2, "ZBVZeroBubble places 2 stages per rank (check_layout)"
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def build_stage_model(args: ModelArgs, layers: list[int], first: bool, last: bool) -> Transformer:
    """A meta-device Transformer holding only `layers` (and the ends it owns)."""
    with torch.device("meta"):
        model = Transformer(args)
    for name in list(model.layers.keys()):
        if int(name) not in layers:
            del model.layers[name]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model


@dataclass
class StageModels:
    ids: list[int]
    modules: list[Transformer]
    n_stages: int


def build_stages(args: ModelArgs, cfg: ParallelismConfig, pp_rank: int) -> StageModels:
    spr = cfg.stages_per_rank
    n_stages = cfg.pp * spr
    layers = stage_layers(args.n_layers, n_stages, cfg.pp_split)
    ids = stage_ids_for_rank(pp_rank, cfg.pp, spr, cfg.pp_schedule)
    modules = [build_stage_model(args, layers[s], s == 0, s == n_stages - 1) for s in ids]
    return StageModels(ids=ids, modules=modules, n_stages=n_stages)


class PipelineRunner:
    """Runs one training step through the schedule on this pipeline rank."""

    def __init__(
        self,
        stages: StageModels,
        pp_group,
        device: torch.device,
        schedule: str,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor],
    ):
        require_zbv_support(schedule, pp_group)
        self.stage_objs = [
            PipelineStage(m, sid, stages.n_stages, device, group=pp_group)
            for sid, m in zip(stages.ids, stages.modules, strict=True)
        ]
        self.has_first = 0 in stages.ids
        self.has_last = stages.n_stages - 1 in stages.ids
        self.n_microbatches = n_microbatches
        cls = SCHEDULE_CLASSES[schedule]
        stage_arg = self.stage_objs[0] if schedule in SINGLE_STAGE else self.stage_objs
        self._loss_fn = loss_fn
        self._loss_kwargs: dict[str, Any] = {}
        self.schedule = cls(
            stage_arg, n_microbatches=n_microbatches, loss_fn=self._loss, scale_grads=False
        )
        # torch (2.13) runs a V-shaped schedule's backward actions in `eval` too, and fails on
        # the first one between the two stages of a rank: eval runs the forward part of its
        # action list instead (tests/rl/test_trainer_parallel.py, pp2_zbv).
        self._forward_order = (
            _forward_actions(self.schedule) if schedule == "ZBVZeroBubble" else None
        )

    @property
    def can_eval(self) -> bool:
        """Forward-only runs (validation) need `schedule.eval`, present in recent torch."""
        return hasattr(self.schedule, "eval")

    def eval(
        self,
        input_ids: torch.Tensor,
        target: torch.Tensor,
        loss_kwargs: dict[str, Any],
        **model_kwargs: Any,
    ) -> torch.Tensor | None:
        """Forward only; the summed micro-batch losses on the last stage's rank, else None.
        `loss_kwargs` reach the loss function of every micro-batch of this call;
        `model_kwargs` (non-tensor options such as batch_invariant) reach every stage."""
        sched: Any = self.schedule
        if self._forward_order is None:
            return self._run(sched.eval, input_ids, target, loss_kwargs, model_kwargs)
        full, sched.pipeline_order_with_comms = sched.pipeline_order_with_comms, self._forward_order
        try:
            return self._run(sched.eval, input_ids, target, loss_kwargs, model_kwargs)
        finally:
            sched.pipeline_order_with_comms = full

    def step(
        self,
        input_ids: torch.Tensor,
        target: torch.Tensor,
        loss_kwargs: dict[str, Any],
        **model_kwargs: Any,
    ) -> torch.Tensor | None:
        """Forward and backward of one batch; the summed micro-batch losses on the rank that
        holds the last stage, None elsewhere. `loss_kwargs` as in `eval`."""
        return self._run(self.schedule.step, input_ids, target, loss_kwargs, model_kwargs)

    def _run(
        self,
        run: Callable[..., Any],
        input_ids: torch.Tensor,
        target: torch.Tensor,
        loss_kwargs: dict[str, Any],
        model_kwargs: dict[str, Any],
    ) -> torch.Tensor | None:
        """Feeds the inputs on the first stage and the target on the last."""
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.has_first else ()
        kwargs = {"target": target, "losses": losses} if self.has_last else {}
        # Bound for this call only (torch's own `step(..., loss_kwargs=)` is not in every
        # supported torch: 2.11 lacks it).
        self._loss_kwargs = loss_kwargs
        try:
            run(*args, **kwargs, **model_kwargs)
        finally:
            self._loss_kwargs = {}
        return torch.stack(losses).sum() if self.has_last else None

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the given one with this call's `loss_kwargs`."""
        return self._loss_fn(output, target, **self._loss_kwargs)


def _forward_actions(schedule: Any) -> dict[int, list[Any]] | None:
    """The forward part of a runtime schedule's per-rank action lists (forward compute, its
    sends and receives, FSDP unshard/reshard): the same forward order, whose sends and
    receives still pair up across ranks. None where torch keeps no such lists."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if not isinstance(order, dict):
        return None
    keep = {"F", "SEND_F", "RECV_F", "UNSHARD", "RESHARD"}
    out: dict[int, list[Any]] = {}
    for rank, actions in order.items():
        out[rank] = []
        for a in actions:
            for sub in getattr(a, "sub_actions", None) or [a]:  # OVERLAP_F_B: its forward
                if sub.computation_type.value in keep:
                    out[rank].append(sub)
    return out
