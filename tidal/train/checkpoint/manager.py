"""Save and load a training run with torch.distributed.checkpoint (DCP).

What a checkpoint holds, as DCP keys (one flat dict, so `dcp_to_torch` of a model-only
checkpoint gives a plain model state dict, as with torchtitan):

    <model FQN>                 e.g. layers.0.attention.wq.weight: a tensor or DTensor
    optimizer.state.<FQN>.<k>   AdamW's exp_avg, exp_avg_sq, step (flattened by FQN, so
    optimizer.param_groups...   pipeline stages and every layout reshard)
    lr_scheduler                JSON: the step the schedule started at (the WSD schedule is a
                                function of the step) and its settings
    dataloader                  JSON: the loader's state_dict()
    train_state                 JSON: {"step": N}
    rng.rank<R>.python|torch|cuda   each rank's RNG states

plus tidal.json (model flavor and args, layout, contents) and the COMPLETE marker
(tidal/train/checkpoint/layout.py). Model and optimizer go through DCP's
`get_state_dict`/`set_state_dict`, so a checkpoint saved under FSDP loads into TP, PP or one
process: DCP reads for each rank the pieces of every tensor it holds.

Lifecycle (every rank makes the same calls in the same order): the Trainer calls `plan_load`
first (file system only: bad input fails before the data, the model or any process group
exists), builds one `Checkpointer` after the optimizer, calls `load(plan)` once, then
`maybe_save(step)` after every step, `wait_before_update()` before every optimizer step and
`finish()` at the end, which waits for a background save. Saves run on a gloo process group
of their own, so a background save never shares a communicator with training.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from tidal.models.transformer import ModelArgs, Transformer
from tidal.train.checkpoint import layout
from tidal.train.checkpoint.layout import CheckpointError
from tidal.train.checkpoint.staging import PinnedStaging, copy_to_host
from tidal.train.config import CHECKPOINT_STATES, CheckpointConfig

Log = Callable[[str], None]
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# ModelArgs fields that shape the weights or the math; attention kernel, max_seq_len (RoPE
# tables, not saved) and notes may differ between the saving and the loading run.
_ARCH_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(ModelArgs)
    if f.name not in ("attention", "max_seq_len", "extra")
)


def checkpoint_folder(cfg: CheckpointConfig, output_dir: str | Path) -> Path:
    """`checkpoint.folder` resolved against the run's output_dir."""
    folder = Path(cfg.folder).expanduser()
    return folder if folder.is_absolute() else Path(output_dir) / folder


def model_info(args: ModelArgs, flavor: str) -> dict[str, Any]:
    """The model part of tidal.json: the flavor name and the architecture it resolved to."""
    fields = dataclasses.asdict(args)
    fields.pop("extra", None)
    return {"flavor": flavor, "args": fields}


# -- which checkpoint to load -------------------------------------------------------------


@dataclass(kw_only=True)
class LoadPlan:
    """The checkpoint a run starts from, decided before anything is built."""

    path: Path
    step: int
    info: dict[str, Any]
    model_only: bool
    resume: bool
    """True: the run's own checkpoint (everything not excluded is restored, the metrics file
    is appended to). False: `initial_load_path` (a fresh run starting from those weights)."""


def plan_load(
    cfg: CheckpointConfig,
    output_dir: str | Path,
    args: ModelArgs,
    flavor: str,
    *,
    total_steps: int,
    log: Log = print,
) -> LoadPlan | None:
    """The checkpoint this run will load, or None for a start from the seed initialization.

    Resumes from the newest complete checkpoint in `checkpoint.folder` (or `load_step`), else
    starts from `initial_load_path`; names the checkpoint chosen and any incomplete one
    skipped. Reads only tidal.json and DCP's `.metadata`, no tensor: a checkpoint of another
    model fails here, naming the keys, both shapes and the settings that differ.

    Raises:
        CheckpointError: a missing folder or path, a `load_step` without a checkpoint (naming
            the steps there are), an incomplete, corrupt or mismatched checkpoint.
    """
    if not cfg.enable:
        for name in ("initial_load_path", "load_step"):
            if getattr(cfg, name) not in (None, -1):
                log(f"warning: checkpoint.{name} is ignored without --checkpoint.enable true")
        return None
    folder = checkpoint_folder(cfg, output_dir)
    found = layout.scan(folder)
    skipped = f"; skipped incomplete: {found.describe_incomplete()}" if found.incomplete else ""
    if cfg.create_seed_checkpoint:
        if found.complete:
            raise CheckpointError(
                f"checkpoint.create_seed_checkpoint: {folder} already holds checkpoints "
                f"({_steps(found)}); use an empty checkpoint.folder"
            )
        return None
    if found.complete:
        step = max(found.complete) if cfg.load_step == -1 else cfg.load_step
        if step not in found.complete:
            raise CheckpointError(
                f"checkpoint.load_step={cfg.load_step}: {folder} has no complete step-{step}; "
                f"complete checkpoints: {_steps(found)}{skipped}"
            )
        if cfg.initial_load_path:
            log(f"warning: checkpoint.initial_load_path is ignored: resuming from {folder}")
        path, resume = found.complete[step], True
    elif cfg.load_step != -1:
        where = (
            "does not exist"
            if not folder.exists()
            else f"holds no complete checkpoint (incomplete: {found.describe_incomplete()})"
        )
        raise CheckpointError(f"checkpoint.load_step={cfg.load_step} but {folder} {where}")
    elif cfg.initial_load_path:
        path, resume = _initial_path(Path(cfg.initial_load_path).expanduser()), False
    else:
        if found.incomplete:
            log(f"checkpoint: no complete checkpoint in {folder}{skipped}; starting fresh")
        return None

    info = layout.verify(path)  # marker, file sizes, tidal.json
    contents = info.get("contents", ["model"])
    step = int(info.get("step", 0))
    if resume:
        model_only = contents == ["model"]
        if model_only and 0 < step < total_steps:
            raise CheckpointError(
                f"{path} holds only the model (saved with checkpoint.last_save_model_only), "
                f"so training cannot resume from it; complete checkpoints: {_steps(found)}. "
                f"Pick one with all states (--checkpoint.load_step), or start a new run from "
                f"these weights with --checkpoint.initial_load_path {path}"
            )
    else:
        model_only = cfg.initial_load_model_only
        if not model_only and contents == ["model"]:
            raise CheckpointError(
                f"checkpoint.initial_load_model_only=false but {path} holds only the model"
            )
    _check_model(path, info, args, flavor)
    what = "resuming from" if resume else "starting from"
    part = " (model only)" if model_only else ""
    log(f"checkpoint: {what} {path}{part}, step {step}{skipped if resume else ''}")
    return LoadPlan(path=path, step=step, info=info, model_only=model_only, resume=resume)


def _steps(found: layout.Scan) -> str:
    return ", ".join(f"step-{s}" for s in found.steps) or "none"


def _initial_path(path: Path) -> Path:
    if not path.exists():
        raise CheckpointError(f"checkpoint.initial_load_path {path} does not exist")
    if layout.is_checkpoint(path):
        return path
    inner = layout.scan(path)
    if inner.complete:  # a run's checkpoint folder: take its newest
        return inner.complete[max(inner.complete)]
    raise CheckpointError(
        f"checkpoint.initial_load_path {path} is not a checkpoint (no {layout.MARKER} marker "
        f"or DCP {layout.DCP_METADATA}) nor a folder of step-N checkpoints"
    )


def read_metadata(path: Path) -> Metadata:
    """DCP's index of a checkpoint (keys, global shapes, dtypes), read without any tensor."""
    try:
        return FileSystemReader(str(path)).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"{path / layout.DCP_METADATA}: missing") from None
    except Exception as e:  # unpickling garbage raises many types
        raise CheckpointError(
            f"{path / layout.DCP_METADATA}: unreadable ({_first_line(e)}); the checkpoint is "
            "corrupt"
        ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _arch_diff(saved: dict[str, Any], args: ModelArgs) -> list[str]:
    mine = model_info(args, "")["args"]
    out = []
    for name in _ARCH_FIELDS:
        if name in saved and saved[name] != mine[name]:
            flag = " (--model.vocab_size)" if name == "vocab_size" else ""
            out.append(f"{name} {saved[name]!r} in the checkpoint, {mine[name]!r} here{flag}")
    return out


def _shape_diff(
    target: dict[str, tuple[int, ...]], metadata: Metadata
) -> tuple[list[str], list[str]]:
    """(keys whose shapes differ, described with both shapes; keys the checkpoint lacks)."""
    saved = metadata.state_dict_metadata
    wrong, missing = [], []
    for key, shape in target.items():
        md = saved.get(key)
        if md is None:
            missing.append(key)
        elif isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(shape):
            wrong.append(f"{key} is {list(md.size)} in the checkpoint and {list(shape)} here")
    return wrong, missing


def _mismatch_message(path: Path, wrong: list[str], missing: list[str], diff: list[str]) -> str:
    parts = []
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        parts.append("; ".join(wrong[:3]) + more)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        parts.append(f"missing from the checkpoint: {', '.join(missing[:3])}{more}")
    if diff:
        parts.append("the model settings differ: " + "; ".join(diff))
    return f"checkpoint {path} does not fit this run: " + ". ".join(parts)


def _check_model(path: Path, info: dict[str, Any], args: ModelArgs, flavor: str) -> None:
    """Compare the saved model with this run's before any tensor is read."""
    saved = info.get("model", {})
    diff = _arch_diff(saved.get("args", {}), args)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    wrong, missing = _shape_diff(shapes, read_metadata(path))
    saved_flavor = saved.get("flavor")
    if diff and saved_flavor and saved_flavor != flavor:
        diff.insert(0, f"saved from model.flavor {saved_flavor!r}, this run builds {flavor!r}")
    if wrong or missing or diff:
        raise CheckpointError(_mismatch_message(path, wrong, missing, diff))


# -- reading with errors that name the file --------------------------------------------------


class _NamingReader(FileSystemReader):
    """DCP's file reader, reading one file at a time so that a failure names the file."""

    def read_data(self, plan, planner):
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as e:
                raise CheckpointError(
                    f"{Path(self.path) / name}: unreadable ({_first_line(e)}); the checkpoint "
                    "is corrupt"
                ) from e
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done


def _unwrap(e: CheckpointException) -> BaseException:
    """The first rank's error inside DCP's wrapper (ours carry the file name)."""
    for exc, _trace in e.failures.values():
        if isinstance(exc, CheckpointError):
            return exc
    first = next(iter(e.failures.values()), (e, None))[0]
    return first


def _quiet_single_process() -> None:
    """DCP warns on every call without a process group; one process is a normal case here.
    (A filter, not catch_warnings: saves also run on a background thread.)"""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def load_flat(flat: dict[str, Any], path: Path, process_group=None) -> None:
    """Fill `flat` (DCP keys -> tensors or placeholders) in place from the checkpoint `path`,
    resharding to whatever layout `flat`'s DTensors have.

    Raises:
        CheckpointError: a file is unreadable (named).
    """
    _quiet_single_process()
    try:
        dcp.load(
            flat,
            storage_reader=_NamingReader(str(path)),
            process_group=process_group,
            no_dist=not dist.is_initialized(),
        )
    except CheckpointException as e:
        err = _unwrap(e)
        if isinstance(err, CheckpointError):
            raise err from None
        raise CheckpointError(f"loading {path} failed: {type(err).__name__}: {err}") from None


# -- model-only checkpoints (also for `tidal convert`) --------------------------------------


def save_model(
    state_dict: dict[str, torch.Tensor],
    folder: str | Path,
    step: int,
    *,
    info: dict[str, Any],
    process_group=None,
) -> Path:
    """Save a model state dict (FQN -> tensor or DTensor) as the model-only checkpoint
    `folder/step-<step>`, with the same layout, marker and crash safety as training saves.
    `info` is tidal.json's content beyond step and contents: at least
    `{"model": model_info(args, flavor)}`. Every rank calls it; returns the path.

    Example::

        sd = get_model_state_dict(model)  # or a converted Hugging Face state dict
        save_model(sd, "ckpt", 0, info={"model": model_info(args, "llama3_1b")})
    """
    folder = Path(folder)
    rank = dist.get_rank(process_group) if dist.is_initialized() else 0
    partial = _begin_partial(folder, step, rank, process_group)
    _save_flat(dict(state_dict), partial, process_group)
    final = layout.step_dir(folder, step)
    if rank == 0:
        full = {"format": layout.FORMAT, "step": step, "contents": ["model"], **info}
        layout.commit(partial, final, full)
    return final


def load_model(state_dict: dict[str, torch.Tensor], path: str | Path, process_group=None) -> None:
    """Fill a model state dict (FQN -> tensor or DTensor, any layout) in place from the
    checkpoint at `path` (model-only or full; other keys are not read).

    Raises:
        CheckpointError: incomplete, corrupt, or lacking a key / with another shape (named).
    """
    path = Path(path)
    layout.verify(path)
    shapes = {k: tuple(v.shape) for k, v in state_dict.items()}
    wrong, missing = _shape_diff(shapes, read_metadata(path))
    if wrong or missing:
        raise CheckpointError(_mismatch_message(path, wrong, missing, []))
    load_flat(state_dict, path, process_group)


def _save_flat(flat: dict[str, Any], partial: Path, process_group) -> None:
    _quiet_single_process()
    dcp.save(
        flat,
        storage_writer=FileSystemWriter(str(partial)),  # fsyncs every file it writes
        process_group=process_group,
        no_dist=not dist.is_initialized(),
    )


def _begin_partial(folder: Path, step: int, rank: int, process_group) -> Path:
    """Rank 0 clears leftovers of earlier saves; every rank then writes into the same
    partial folder (the broadcast orders the clean-up before any write)."""
    partial = layout.partial_dir(folder, step)
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        layout.remove_incomplete(folder)
    if dist.is_initialized() and dist.get_world_size(process_group) > 1:
        box = [str(partial)]
        dist.broadcast_object_list(
            box,
            src=dist.get_global_rank(process_group, 0) if process_group is not None else 0,
            group=process_group,
        )
    return partial


# -- the training-run checkpointer ----------------------------------------------------------


class _Stages(nn.Module):
    """One module over several pipeline stages of a rank, with the full model's names (the
    stages hold disjoint parts: layer indices are global, the ends sit on one stage each), so
    DCP's state-dict helpers see one model and one optimizer."""

    def __init__(self, stages: Sequence[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict()
        for stage in stages:
            for name, child in stage.named_children():
                if name == "layers":
                    for key, block in child.named_children():
                        self.layers[key] = block
                elif child is not None:
                    self.add_module(name, child)


@dataclass
class SaveStats:
    """Timings of the last save, for logs and benchmarks."""

    step: int = 0
    blocked_s: float = 0.0
    """Seconds the training thread spent in `save()`."""
    total_s: float = 0.0
    """Seconds from the call until the checkpoint was complete on disk."""
    bytes: int = 0


class Checkpointer:
    """Saves, restores and prunes a run's checkpoints (see the module docstring).

    Args:
        cfg: the checkpoint section.
        folder: the resolved checkpoint folder.
        modules: this rank's model (one module, or its pipeline stages).
        optimizer: the optimizer over all of `modules`.
        loader: the training data loader (its `state_dict()`/`load_state_dict()` are saved
            and restored when it has them).
        device: the training device (pinned staging on CUDA).
        args: the model's architecture (named in mismatch errors).
        info: tidal.json content: {"model": model_info(...), "parallelism": {...}}.
        lr_settings: the schedule's settings, saved for information.
        log: rank 0's logger.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        folder: Path,
        modules: Sequence[nn.Module],
        optimizer: torch.optim.Optimizer,
        loader: Any,
        device: torch.device,
        args: ModelArgs,
        info: dict[str, Any],
        lr_settings: dict[str, Any],
        log: Log = print,
    ):
        self.cfg = cfg
        self.folder = folder
        self.model = modules[0] if len(modules) == 1 else _Stages(modules)
        self.optimizer = optimizer
        self.loader = loader
        self.device = device
        self.args = args
        self.info = info
        self.lr_settings = lr_settings
        self.log = log
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # A gloo group of its own: DCP's collectives of a background save never interleave
        # with training's, and they run on the host whatever the training backend.
        self.pg = dist.new_group(backend="gloo") if cfg.enable and self.world > 1 else None
        self.staging = PinnedStaging(device) if cfg.async_mode == "async_with_pinned_mem" else None
        self.pending: Future | None = None
        self.last_saved_step: int | None = None
        self.stats = SaveStats()
        self.lr_start = 0
        self.saves_enabled = cfg.enable and not cfg.load_only
        if cfg.enable and not hasattr(loader, "state_dict"):
            log("warning: the data loader has no state_dict(); a resumed run restarts its data")

    # -- what is saved ----------------------------------------------------------------------

    def _flat(self, step: int, *, model_only: bool, only: set[str] | None = None) -> dict:
        """The state as one flat dict of DCP keys; `only` limits the non-model states."""
        keep = set(CHECKPOINT_STATES) if only is None else only
        if model_only or "optimizer" not in keep:
            flat: dict[str, Any] = dict(get_model_state_dict(self.model, options=_OPTIONS))
        else:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
            flat = dict(model_sd)
            flat.update({f"optimizer.{k}": v for k, v in optim_sd.items()})
        if model_only:
            return flat
        if "lr_scheduler" in keep:
            flat["lr_scheduler"] = json.dumps({"start_step": self.lr_start, **self.lr_settings})
        if "dataloader" in keep and hasattr(self.loader, "state_dict"):
            flat["dataloader"] = json.dumps(self.loader.state_dict())
        if "train_state" in keep:
            flat["train_state"] = json.dumps({"step": step})
        if "rng" in keep:
            flat.update(self._rng_state())
        return flat

    def _rng_state(self) -> dict[str, Any]:
        version, state, gauss = random.getstate()
        prefix = f"rng.rank{self.rank}"
        out: dict[str, Any] = {
            f"{prefix}.python": json.dumps([version, list(state), gauss]),
            f"{prefix}.torch": torch.get_rng_state(),
        }
        if self.device.type == "cuda":
            out[f"{prefix}.cuda"] = torch.cuda.get_rng_state(self.device)
        return out

    def _set_rng_state(self, flat: dict[str, Any]) -> None:
        prefix = f"rng.rank{self.rank}"
        version, state, gauss = json.loads(flat[f"{prefix}.python"])
        random.setstate((version, tuple(state), gauss))
        torch.set_rng_state(flat[f"{prefix}.torch"])
        if f"{prefix}.cuda" in flat:
            torch.cuda.set_rng_state(flat[f"{prefix}.cuda"], self.device)

    def _info(self, step: int, contents: list[str], dtype: str) -> dict[str, Any]:
        return {
            "format": layout.FORMAT,
            "step": step,
            "contents": contents,
            "dtype": dtype,
            **self.info,
            "async_mode": self.cfg.async_mode,
            "torch": torch.__version__,
            "saved_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }

    # -- saving -----------------------------------------------------------------------------

    def maybe_save(self, step: int, total_steps: int) -> None:
        """After step `step`: save on the interval and at the last step."""
        if not self.saves_enabled:
            return
        if step == total_steps:
            self.save(step, last=True)
        elif step % self.cfg.interval == 0:
            self.save(step)

    def save(self, step: int, *, last: bool = False, seed: bool = False) -> None:
        """Save the state after step `step` (at once, or staged and written in the background
        per `async_mode`; the last save always completes before returning). `seed`: the
        model only, in fp32, at once (create_seed_checkpoint)."""
        if not self.saves_enabled:
            return
        start = time.perf_counter()
        self.wait()  # one save at a time; raises if the previous one failed
        export = last and self.cfg.last_save_model_only
        model_only = export or seed
        flat = self._flat(step, model_only=model_only)
        dtype = "float32"
        if export and self.cfg.export_dtype != "float32":
            dtype = self.cfg.export_dtype
            flat = {
                k: v.to(_DTYPES[dtype]) if v.is_floating_point() else v for k, v in flat.items()
            }
        contents = ["model"] if model_only else self._contents(flat)
        info = self._info(step, contents, dtype)
        mode = "disabled" if last or seed else self.cfg.async_mode
        if mode == "disabled":
            self._write(flat, step, info, start, staged=False)
            self.stats.blocked_s = time.perf_counter() - start
        else:
            if mode == "async":
                flat = copy_to_host(flat)
            else:
                assert self.staging is not None
                flat = self.staging.stage(flat)
            self.stats.blocked_s = time.perf_counter() - start
            self.pending = _in_background(self._write, flat, step, info, start, True)
        self.last_saved_step = step

    def _contents(self, flat: dict[str, Any]) -> list[str]:
        groups = {k.split(".", 1)[0] for k in flat}
        return ["model"] + [s for s in CHECKPOINT_STATES if s in groups]

    def _write(self, flat: dict, step: int, info: dict, start: float, staged: bool) -> None:
        if staged and self.staging is not None:
            if self.staging.cuda:
                self.staging.wait_copied()
            else:
                self.staging.run_host_copy()
        partial = _begin_partial(self.folder, step, self.rank, self.pg)
        _save_flat(flat, partial, self.pg)
        final = layout.step_dir(self.folder, step)
        if self.rank == 0:
            layout.commit(partial, final, info)
            self._purge()
            size = sum(f.stat().st_size for f in final.iterdir())
        else:
            size = 0
        total = time.perf_counter() - start
        self.stats = SaveStats(step=step, blocked_s=self.stats.blocked_s, total_s=total, bytes=size)
        how = f" ({self.cfg.async_mode}: the step waited {self.stats.blocked_s:.2f}s)"
        how = how if staged else ""
        self.log(f"checkpoint: saved {final} ({size / 2**20:,.1f} MiB) in {total:.2f}s{how}")

    def _purge(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        steps = layout.scan(self.folder).complete
        for step in sorted(steps)[:-k]:
            layout.remove(steps[step])

    def wait_before_update(self) -> None:
        """Call before the optimizer changes weights in place: a pinned staging copy of the
        last save must have read them (on CUDA the device waits, not the host)."""
        if self.staging is not None:
            self.staging.wait_before_update()

    def wait(self) -> None:
        """Block until the background save (if any) is complete on disk.

        Raises:
            CheckpointError: the save failed (its error chained).
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.result()
        except BaseException as e:
            if self.staging is not None:
                self.staging.abandon()
            raise CheckpointError(f"saving a checkpoint in {self.folder} failed: {e}") from e

    def finish(self) -> None:
        """End of training: wait for the last background save."""
        self.wait()

    # -- loading ----------------------------------------------------------------------------

    def load(self, plan: LoadPlan) -> int:
        """Restore what `plan` says; returns the step to continue from (0 for a model-only or
        initial load that keeps no step)."""
        start = time.perf_counter()
        only = set() if plan.model_only else set(CHECKPOINT_STATES) - set(self.cfg.excluded)
        flat = self._flat(plan.step, model_only=plan.model_only, only=only)
        metadata = read_metadata(plan.path)
        saved_keys = metadata.state_dict_metadata
        rng_keys = [k for k in flat if k.startswith("rng.")]
        if rng_keys and not all(k in saved_keys for k in rng_keys):
            saved_world = plan.info.get("parallelism", {}).get("world_size", "?")
            self.log(
                f"warning: RNG states not restored: saved by {saved_world} ranks, this run "
                f"has {self.world}"
            )
            for k in rng_keys:
                del flat[k]
        if "dataloader" in flat and "dataloader" not in saved_keys:
            self.log("warning: the checkpoint has no data loader state; the data restarts")
            del flat["dataloader"]
        self._check_fits(plan, flat, metadata)
        hyper = [
            {k: v for k, v in g.items() if k not in ("params", "lr")}
            for g in self.optimizer.param_groups
        ]
        load_flat(flat, plan.path, self.pg)

        model_sd = {k: v for k, v in flat.items() if not _is_state_key(k)}
        if "optimizer.state" in {k[:15] for k in flat}:
            optim_sd = {
                k[len("optimizer.") :]: v for k, v in flat.items() if k.startswith("optimizer.")
            }
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=model_sd,
                optim_state_dict=optim_sd,
                options=_OPTIONS,
            )
            self._keep_config_hyperparameters(hyper)
        else:
            set_model_state_dict(self.model, model_sd, options=_OPTIONS)
        step = plan.step if plan.resume else 0  # a model-only checkpoint has no train_state
        if "train_state" in flat:
            step = int(json.loads(flat["train_state"])["step"])
        if "lr_scheduler" in flat:
            self.lr_start = int(json.loads(flat["lr_scheduler"])["start_step"])
        elif not plan.model_only:
            self.lr_start = step  # excluded: the schedule restarts over the remaining steps
        if "dataloader" in flat:
            self.loader.load_state_dict(self._fit_loader_state(json.loads(flat["dataloader"])))
        if any(k.startswith("rng.") for k in flat):
            self._set_rng_state(flat)
        saved = plan.info.get("parallelism", {})
        if saved and saved != self.info.get("parallelism"):
            self.log(
                f"checkpoint: resharded from {_layout(saved)} to "
                f"{_layout(self.info['parallelism'])}"
            )
        self.log(f"checkpoint: loaded {plan.path} in {time.perf_counter() - start:.2f}s")
        self.last_saved_step = step if plan.resume else None
        return step

    def _check_fits(self, plan: LoadPlan, flat: dict[str, Any], metadata: Metadata) -> None:
        shapes = {k: tuple(v.shape) for k, v in flat.items() if isinstance(v, torch.Tensor)}
        wrong, missing = _shape_diff(shapes, metadata)
        missing += [k for k in flat if k not in shapes and k not in metadata.state_dict_metadata]
        if wrong or missing:
            diff = _arch_diff(plan.info.get("model", {}).get("args", {}), self.args)
            raise CheckpointError(_mismatch_message(plan.path, wrong, missing, diff))

    def _keep_config_hyperparameters(self, before: list[dict[str, Any]]) -> None:
        """The config's betas, eps and weight decay win over the checkpoint's (the learning
        rate is set every step)."""
        changed = set()
        for group, want in zip(self.optimizer.param_groups, before, strict=True):
            for k, v in want.items():
                if group.get(k) != v:
                    changed.add(f"{k} {group.get(k)!r} -> {v!r}")
                    group[k] = v
        if changed:
            self.log(
                "checkpoint: optimizer settings from the config replace the checkpoint's: "
                + ", ".join(sorted(changed))
            )

    def _fit_loader_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A PackedLoader position taken with another split of the same global batch (other
        data-parallel degree, per-rank batch size) names the same windows: rewrite the split."""
        loader = self.loader
        keys = ("batch_size", "dp_world")
        if all(k in state for k in keys) and all(hasattr(loader, k) for k in keys):
            saved = (int(state["batch_size"]), int(state["dp_world"]))
            mine = (loader.batch_size, loader.dp_world)
            if saved != mine and saved[0] * saved[1] == mine[0] * mine[1]:
                self.log(
                    f"checkpoint: data position kept across layouts (batch {saved[0]} x "
                    f"{saved[1]} ranks -> {mine[0]} x {mine[1]})"
                )
                state = {**state, "batch_size": mine[0], "dp_world": mine[1]}
        return state


def _in_background(fn: Callable[..., None], *args: Any) -> Future:
    """Run `fn(*args)` on a daemon thread (a process that exits, or is interrupted, does not
    wait for it: an unfinished save stays an incomplete folder)."""
    future: Future = Future()

    def run() -> None:
        try:
            fn(*args)
            future.set_result(None)
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name="tidal-checkpoint", daemon=True).start()
    return future


def _is_state_key(key: str) -> bool:
    return key.split(".", 1)[0] in CHECKPOINT_STATES


def _layout(p: dict[str, Any]) -> str:
    degrees = ", ".join(f"{k}={v}" for k, v in p.get("degrees", {}).items() if v > 1)
    return f"{p.get('world_size', '?')} rank(s) ({degrees or 'single'})"
