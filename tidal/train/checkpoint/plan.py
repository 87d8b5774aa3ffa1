"""Which checkpoint a run starts from, decided from the file system alone.

`plan_load` runs on every rank before the data, the model or any process group exists: it
picks the newest complete checkpoint of the run's folder (or `load_step`, or
`initial_load_path`, or the Hugging Face folder of `initial_load_hf`), checks its marker and
file sizes, and compares the saved model (tidal.json and DCP's `.metadata`, or config.json and
the safetensors headers; no tensor) with this run's, so a missing, incomplete, corrupt or
mismatched checkpoint fails at once with the file, key, shapes or setting named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tidal.models.moe import MoEArgs
from tidal.models.transformer import ModelArgs, RopeScaling, Transformer
from tidal.train.checkpoint import layout
from tidal.train.checkpoint import torchtitan as tt
from tidal.train.checkpoint.dcp_io import mismatch_message, read_metadata, shape_diff
from tidal.train.checkpoint.layout import CheckpointError
from tidal.train.config import CheckpointConfig

Log = Callable[[str], None]
# ModelArgs fields that shape the weights or the math; attention kernel, max_seq_len (RoPE
# tables, not saved) and notes may differ between the saving and the loading run.
ARCH_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(ModelArgs)
    if f.name not in ("attention", "max_seq_len", "extra")
)


def checkpoint_folder(cfg: CheckpointConfig, output_dir: str | Path) -> Path:
    """`checkpoint.folder` resolved against the run's output_dir."""
    folder = Path(cfg.folder).expanduser()
    return folder if folder.is_absolute() else Path(output_dir) / folder


def model_info(args: ModelArgs, flavor: str) -> dict[str, Any]:
    """The model part of tidal.json: the flavor name and the architecture it resolved to, and
    the token ids of a Hugging Face config.json the model came from (`args.extra["hf"]`, which
    an export writes back)."""
    fields = dataclasses.asdict(args)
    fields.pop("extra", None)
    info: dict[str, Any] = {"flavor": flavor, "args": fields}
    if args.extra.get("hf"):
        info["hf"] = dict(args.extra["hf"])
    return info


def args_from_info(info: dict[str, Any], path: Path) -> ModelArgs | None:
    """The ModelArgs a tidal.json records (the inverse of `model_info`), or None when it
    records none (a DCP folder written by another tool).

    Raises:
        CheckpointError: the recorded architecture is not one this tidal can build.
    """
    model = info.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("args"), dict):
        return None
    saved = model["args"]
    fields = dict(saved)
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(fields) - known)
    try:
        if unknown:
            raise ValueError(f"unknown model fields {unknown}")
        if isinstance(fields.get("rope_scaling"), dict):
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        if isinstance(fields.get("moe"), dict):
            fields["moe"] = MoEArgs(**fields["moe"])
        if isinstance(model.get("hf"), dict):
            fields["extra"] = {"hf": dict(model["hf"])}
        return ModelArgs(**fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"{path / layout.INFO}: its model cannot be built ({e}); the checkpoint is corrupt or "
            "from another version of tidal"
        ) from None


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
    is appended to). False: `initial_load_path` or `initial_load_hf` (a fresh run starting
    from those weights)."""
    hf: bool = False
    """`path` is a Hugging Face folder (`initial_load_hf`), not a DCP checkpoint."""
    layout: str = "tidal"
    """The order of the saved weights: "tidal", or "torchtitan" (the model's q/k rows are
    reordered as they load; tidal/train/checkpoint/torchtitan.py)."""


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
    hf = cfg.initial_load_hf
    if not cfg.enable:
        if cfg.load_step != -1:
            log("warning: checkpoint.load_step is ignored without --checkpoint.enable true")
        return _hf_plan(Path(hf).expanduser(), args, log) if hf else None
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
        for name in ("initial_load_path", "initial_load_hf"):
            if getattr(cfg, name):
                log(
                    f"warning: the weights of checkpoint.{name} are not loaded: resuming from "
                    f"{folder}"
                )
        later = [s for s in found.steps if s > step]
        if later:
            log(
                f"warning: {', '.join(f'step-{s}' for s in later)} in {folder} come from before "
                f"this resume; this run replaces them as it saves those steps, and a restart "
                "before then would resume from the newest of them"
            )
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
    elif hf:
        if found.incomplete:
            log(f"checkpoint: no complete checkpoint in {folder}{skipped}")
        return _hf_plan(Path(hf).expanduser(), args, log)
    else:
        if found.incomplete:
            log(f"checkpoint: no complete checkpoint in {folder}{skipped}; starting fresh")
        return None

    flag = "--checkpoint.initial_load_layout"
    given = None if resume or cfg.initial_load_layout == "auto" else cfg.initial_load_layout
    weights = tt.resolve_layout(path, given, flag)
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
        tt.check_loadable(path, weights, model_only, flag)
        if not model_only and contents == ["model"]:
            raise CheckpointError(
                f"checkpoint.initial_load_model_only=false but {path} holds only the model"
            )
    if resume and weights != tt.TIDAL:
        raise CheckpointError(
            f"{path} holds weights in {weights}'s layout; a run resumes only from its own "
            f"checkpoints (start from it with --checkpoint.initial_load_path)"
        )
    _check_model(path, info, args, flavor)
    what = "resuming from" if resume else "starting from"
    part = " (model only)" if model_only else ""
    part += f", {weights} layout" if weights != tt.TIDAL else ""
    log(f"checkpoint: {what} {path}{part}, step {step}{skipped if resume else ''}")
    return LoadPlan(
        path=path, step=step, info=info, model_only=model_only, resume=resume, layout=weights
    )


def _hf_plan(path: Path, args: ModelArgs, log: Log) -> LoadPlan:
    """Start from the Hugging Face folder `path`, checked (config.json, every safetensors
    header, names and shapes) without reading tensor data."""
    from tidal.models.hf import check_hf

    try:
        saved = check_hf(path)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint.initial_load_hf: {e}") from None
    except ValueError as e:
        raise CheckpointError(f"checkpoint.initial_load_hf: {e}") from None
    diff = arch_diff(model_info(saved, "")["args"], args)
    if diff:
        raise CheckpointError(
            f"checkpoint.initial_load_hf {path} does not fit this run: " + "; ".join(diff)
        )
    log(f"checkpoint: starting from the Hugging Face weights in {path} (model only)")
    return LoadPlan(path=path, step=0, info={}, model_only=True, resume=False, hf=True)


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
    foreign = tt.newest_foreign_step(path)  # torchtitan's checkpoint folder: its newest
    if foreign is not None:
        return foreign
    if tt.is_hf_folder(path):
        raise CheckpointError(
            f"checkpoint.initial_load_path {path} is a Hugging Face folder; start from it with "
            "--checkpoint.initial_load_hf"
        )
    raise CheckpointError(
        f"checkpoint.initial_load_path {path} is not a checkpoint (no {layout.MARKER} marker "
        f"or DCP {layout.DCP_METADATA}) nor a folder of step-N checkpoints"
    )


def arch_diff(saved: dict[str, Any], args: ModelArgs) -> list[str]:
    mine = model_info(args, "")["args"]
    out = []
    for name in ARCH_FIELDS:
        if name in saved and saved[name] != mine[name]:
            flag = " (--model.vocab_size)" if name == "vocab_size" else ""
            out.append(f"{name} {saved[name]!r} in the checkpoint, {mine[name]!r} here{flag}")
    return out


def _check_model(path: Path, info: dict[str, Any], args: ModelArgs, flavor: str) -> None:
    """Compare the saved model with this run's before any tensor is read."""
    saved = info.get("model", {})
    diff = arch_diff(saved.get("args", {}), args)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    wrong, missing = shape_diff(shapes, read_metadata(path))
    saved_flavor = saved.get("flavor")
    if diff and saved_flavor and saved_flavor != flavor:
        diff.insert(0, f"saved from model.flavor {saved_flavor!r}, this run builds {flavor!r}")
    if wrong or missing or diff:
        raise CheckpointError(mismatch_message(path, wrong, missing, diff))
