"""Reading and writing DCP checkpoint folders: the metadata, the checks against a state dict,
loads whose errors name the file, and model-only checkpoints (the piece other formats'
converters reuse: `save_model` / `load_model`).

Lifecycle: every rank calls `save_model`/`load_model`/`load_flat` with its own shards (DCP
coordinates through the process group); rank 0 alone cleans up and commits the folder
(tidal/train/checkpoint/layout.py).
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from tidal.train.checkpoint import checksum, layout
from tidal.train.checkpoint.layout import CheckpointError


def read_metadata(path: Path) -> Metadata:
    """DCP's index of a checkpoint (keys, global shapes, dtypes), read without any tensor."""
    try:
        return FileSystemReader(str(path)).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"{path / layout.DCP_METADATA}: missing") from None
    except Exception as e:  # unpickling garbage raises many types
        raise CheckpointError(
            f"{path / layout.DCP_METADATA}: unreadable ({first_line(e)}); the checkpoint is corrupt"
        ) from None


def plain_tensor(value: Any) -> Any:
    """`value` with a wrapper tensor subclass around one data tensor replaced by that tensor
    (the same storage), inside a DTensor too; anything else as it is. FSDP's float8
    all-gather (tidal/train/float8.py) keeps weights, and the AdamW states made like them, as
    torchao's WeightWithDynamicFloat8CastTensor: saved as such, the files would unpickle only
    where torchao is imported. Saved plain, a float8 run's checkpoint is an ordinary fp32
    one; loading into the plain view fills the wrapped storage in place."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    local = value._local_tensor if isinstance(value, DTensor) else value
    inner = getattr(local, "_tensor", None)
    if not (is_traceable_wrapper_subclass(local) and isinstance(inner, torch.Tensor)):
        return value
    if not isinstance(value, DTensor):
        return inner
    return DTensor.from_local(
        inner,
        value.device_mesh,
        value.placements,
        run_check=False,
        shape=value.size(),
        stride=value.stride(),
    )


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def shape_diff(
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


def mismatch_message(path: Path, wrong: list[str], missing: list[str], diff: list[str]) -> str:
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


class _NamingReader(FileSystemReader):
    """DCP's file reader, reading one file at a time so that a failure names the file, and
    checking every chunk it reads against the marker's `checksums` ({}: none)."""

    def __init__(self, path: str, checksums: checksum.Checksums):
        super().__init__(path)
        self.checksums = checksums

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        chunks = []
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            chunks.append((info.relative_path, info.offset, info.length, item.storage_index.fqn))
        checksum.verify(Path(self.path), self.checksums, chunks)
        for name, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(
                    f"{Path(self.path) / name}: unreadable ({first_line(e)}); the checkpoint "
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


def load_flat(
    flat: dict[str, Any],
    path: Path,
    process_group=None,
    *,
    no_dist: bool = False,
    verify: bool = True,
) -> None:
    """Fill `flat` (DCP keys -> tensors or placeholders) in place from the checkpoint `path`,
    resharding to whatever layout `flat`'s DTensors have. `no_dist`: this process reads alone
    (plain tensors), even when a process group exists. `verify`: check what is read against
    the marker's checksums, if it has any.

    Raises:
        CheckpointError: a file is unreadable (named).
    """
    _quiet_single_process()
    sums = layout.read_marker(path).get("crc32", {}) if verify else {}
    try:
        dcp.load(
            flat,
            storage_reader=_NamingReader(str(path), sums),
            process_group=process_group,
            no_dist=no_dist or not dist.is_initialized(),
        )
    except CheckpointException as e:
        err = _unwrap(e)
        if isinstance(err, CheckpointError):
            raise err from None
        raise CheckpointError(f"loading {path} failed: {type(err).__name__}: {err}") from None


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
    `{"model": model_info(args, flavor)}`, and `"layout": "torchtitan"` for a state dict in
    torchtitan's layout (tidal/train/checkpoint/torchtitan.py; "tidal" by default). Every
    rank calls it; returns the path.

    Example::

        sd = get_model_state_dict(model)  # or a converted Hugging Face state dict
        save_model(sd, "ckpt", 0, info={"model": model_info(args, "llama3_1b")})
    """
    folder = Path(folder)
    rank = dist.get_rank(process_group) if dist.is_initialized() else 0
    partial = begin_partial(folder, step, rank, process_group)
    save_flat(dict(state_dict), partial, process_group)
    final = layout.step_dir(folder, step)
    if rank == 0:
        full = {
            "format": layout.FORMAT,
            "step": step,
            "contents": ["model"],
            "layout": "tidal",
            **info,
        }
        layout.commit(partial, final, full, checksum.compute(partial))
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
    wrong, missing = shape_diff(shapes, read_metadata(path))
    if wrong or missing:
        raise CheckpointError(mismatch_message(path, wrong, missing, []))
    load_flat(state_dict, path, process_group)


def save_flat(
    flat: dict[str, Any],
    partial: Path,
    process_group,
    storage_writer: FileSystemWriter | None = None,
) -> None:
    """DCP's save of `flat` into `partial`: by DCP's FileSystemWriter in this thread, or by
    `storage_writer` (a ProcessFileSystemWriter: the same files, written by the writer
    process). Every data file is fsynced before this returns.

    Raises:
        CheckpointError: the writer process died, stalled or failed (DCP's wrapper removed).
    """
    _quiet_single_process()
    try:
        dcp.save(
            flat,
            storage_writer=storage_writer or FileSystemWriter(str(partial)),
            process_group=process_group,
            no_dist=not dist.is_initialized(),
        )
    except CheckpointException as e:
        err = _unwrap(e)
        if isinstance(err, CheckpointError):  # the writer process's, naming the folder
            raise err from None
        raise


def begin_partial(folder: Path, step: int, rank: int, process_group) -> Path:
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
