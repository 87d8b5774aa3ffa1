"""Hugging Face folders and DCP checkpoints (tidal's or torchtitan's layout), all ways:
`tidal convert`, a run started from Hugging Face weights (`checkpoint.initial_load_hf`) and
the export of its last save (`checkpoint.last_save_in_hf`).

- `hf_to_dcp(src, dst)`: a Hugging Face folder -> a model-only DCP checkpoint folder (tidal.json,
  COMPLETE), which `--checkpoint.initial_load_path`, `tidal generate --checkpoint` and
  `dcp_to_hf` read. The flavor is the one named, or the first whose architecture matches.
- `dcp_to_hf(src, dst)`: the model of a checkpoint (model-only or a full training save; a
  `step-N` folder or a folder of them, the newest taken) -> a Hugging Face folder. The
  architecture is read from the checkpoint's tidal.json, or named (a DCP folder of another
  tool has none). Optimizer and other states are not read.
- `dcp_to_dcp(src, dst)`: the model of a checkpoint -> a model-only checkpoint in the same or
  the other layout (torchtitan's to tidal's, or back).
- Each DCP side is in tidal's or torchtitan's layout (`layout=`, tidal.json's record; see
  tidal/train/checkpoint/torchtitan.py): a torchtitan checkpoint is read and written exactly
  as torchtitan's own model holds it.
- `hf_args_for(cfg)`: the ModelArgs of a run with `initial_load_hf` (from config.json).

Both converters check everything before the first tensor byte is read (the source's config,
headers or metadata, names and shapes against the model), hold the model in host memory once,
print progress, and write into a temporary folder beside `dst` that is renamed to `dst` when
complete: a failure or Ctrl-C leaves no `dst` behind. Both run in one process (an export at
the end of a multi-rank run runs on rank 0 only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tidal.models.flavors import FLAVORS
from tidal.models.transformer import ModelArgs, Transformer
from tidal.train.checkpoint import layout
from tidal.train.checkpoint import torchtitan as tt
from tidal.train.checkpoint.dcp_io import (
    load_flat,
    mismatch_message,
    read_metadata,
    save_model,
    shape_diff,
)
from tidal.train.checkpoint.layout import CheckpointError
from tidal.train.checkpoint.plan import ARCH_FIELDS, arch_diff, args_from_info, model_info

if TYPE_CHECKING:
    from tidal.train.config import Config

Log = Callable[[str], None]
StrPath = str | os.PathLike[str]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Names `--dtype` and `checkpoint.export_dtype` take."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)
"""Files beside the weights that an export copies from the tokenizer's folder, if present."""

READ_CHUNK_BYTES = 512 * 2**20
"""Bytes of tensors `read_in_chunks` reads per call when converting (it sets how often
progress is logged, and bounds nothing else: the state dict is allocated whole)."""


# -- the architecture ----------------------------------------------------------------------


def hf_args_for(cfg: Config) -> ModelArgs:
    """The ModelArgs of a run started from `checkpoint.initial_load_hf`: the folder's
    config.json with the run's `model.attention`.

    `model.flavor` and `model.vocab_size` are ignored (a warning names a vocabulary size that
    differs): the weights fix the shapes.

    Raises:
        ValueError: the folder or its config.json is missing or unsupported, or
            `training.seq_len` exceeds its context.
    """
    from tidal.models.hf import hf_model_args

    path = Path(cfg.checkpoint.initial_load_hf or "").expanduser()
    try:
        args = hf_model_args(path)
    except FileNotFoundError as e:
        raise ValueError(f"checkpoint.initial_load_hf: {e}") from None
    if cfg.model.vocab_size is not None and cfg.model.vocab_size != args.vocab_size:
        warnings.warn(
            f"model.vocab_size={cfg.model.vocab_size} is ignored: the vocabulary of the "
            f"checkpoint.initial_load_hf model is {args.vocab_size} ({path / 'config.json'})",
            stacklevel=2,
        )
    if cfg.training.seq_len > args.max_seq_len:
        raise ValueError(
            f"training.seq_len={cfg.training.seq_len} exceeds the max_position_embeddings="
            f"{args.max_seq_len} of {path / 'config.json'}"
        )
    return dataclasses.replace(args, attention=cfg.model.attention)


def matching_flavor(args: ModelArgs) -> str | None:
    """The first named flavor with `args`' architecture, the vocabulary size aside (a run sets
    that with `--model.vocab_size`)."""
    mine = model_info(args, "")["args"]
    for name, flavor in FLAVORS.items():
        theirs = model_info(flavor, "")["args"]
        if all(theirs[f] == mine[f] for f in ARCH_FIELDS if f != "vocab_size"):
            return name
    return None


def _check_flavor(flavor: str, args: ModelArgs, where: str) -> None:
    if flavor not in FLAVORS:
        raise ValueError(f"--flavor {flavor!r} is unknown; choose one of {sorted(FLAVORS)}")
    diff = arch_diff(model_info(FLAVORS[flavor], "")["args"], args)
    diff = [d for d in diff if not d.startswith("vocab_size ")]
    if diff:
        diff = [d.replace("in the checkpoint", f"for flavor {flavor!r}") for d in diff]
        raise ValueError(f"{where} is not model.flavor {flavor!r}: " + "; ".join(diff))


# -- destinations --------------------------------------------------------------------------


@contextlib.contextmanager
def staged(dst: Path, *, replace: bool = False) -> Iterator[Path]:
    """A temporary folder beside `dst` to write into, renamed to `dst` on success and removed
    on any failure (Ctrl-C included). An existing `dst` is refused (an empty folder is taken)
    unless `replace`, in which case it is swapped out only once the new one is complete."""
    dst = dst.expanduser()
    if dst.exists() and not replace:
        if not dst.is_dir() or any(dst.iterdir()):
            raise FileExistsError(f"destination {dst} already exists; choose a new path")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an earlier failed attempt
    tmp.mkdir()
    try:
        yield tmp
        if dst.exists():
            old = dst.with_name(f"{dst.name}.replaced.partial")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(dst, old)
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
        layout.fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_tokenizer(tokenizer: Any, folder: Path, *, missing_ok: bool = False) -> list[str]:
    """Put a tokenizer beside exported weights: a `tokenizer.json` path or a folder holding one
    (with it go the TOKENIZER_FILES next to it), or an object with `save(path)` (a trained
    BPE). Returns the file names written.

    Raises:
        FileNotFoundError: no tokenizer.json at the path (unless `missing_ok`).
    """
    if tokenizer is None:
        return []
    if isinstance(tokenizer, str | os.PathLike):
        src = Path(tokenizer).expanduser()
        src = src / "tokenizer.json" if src.is_dir() else src
        if not src.is_file():
            if missing_ok:
                return []
            raise FileNotFoundError(f"tokenizer file not found: {src}")
        written = []
        for name in TOKENIZER_FILES:
            f = src if name == "tokenizer.json" else src.parent / name
            if f.is_file():
                shutil.copyfile(f, folder / name)
                written.append(name)
        return written
    if callable(getattr(tokenizer, "save", None)):
        tokenizer.save(folder / "tokenizer.json")
        return ["tokenizer.json"]
    return []


# -- DCP -> Hugging Face -------------------------------------------------------------------


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder, or the newest complete `step-N` inside a folder of them (tidal's,
    or else another tool's such as torchtitan's, which mark no completion).

    Raises:
        CheckpointError: nothing there, or no checkpoint in it.
    """
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if layout.is_checkpoint(path):
        return path
    found = layout.scan(path)
    if found.complete:
        return found.complete[max(found.complete)]
    foreign = tt.newest_foreign_step(path)
    if foreign is not None:
        return foreign
    if tt.is_hf_folder(path):
        raise CheckpointError(
            f"{path} is a Hugging Face folder (config.json and safetensors), not a DCP checkpoint"
        )
    extra = f" (incomplete: {found.describe_incomplete()})" if found.incomplete else ""
    raise CheckpointError(
        f"{path} is not a checkpoint (no {layout.MARKER} marker or DCP {layout.DCP_METADATA}) "
        f"nor a folder of complete step-N checkpoints{extra}"
    )


def read_model(
    path: StrPath,
    args: ModelArgs | None = None,
    *,
    layout_name: str | None = None,
    flag: str = "--layout",
    log: Log = print,
    progress: bool = True,
) -> tuple[ModelArgs, dict[str, torch.Tensor], dict[str, Any]]:
    """The architecture and the full model state dict (plain CPU tensors in their saved
    dtypes, in tidal's layout) of a DCP checkpoint, read in one process whatever parallel
    layout saved it.

    Args:
        path: a checkpoint folder, or a folder of step-N checkpoints (the newest is taken).
        args: the model; None takes the one tidal.json records. Given as well as recorded,
            the two must agree.
        layout_name: "tidal" or "torchtitan", the order of the saved weights; None takes the
            one tidal.json records (a folder without tidal.json is refused, naming `flag`).

    Returns:
        (args, state dict, tidal.json's content with the "layout" read).

    Raises:
        CheckpointError: a missing, incomplete, truncated or corrupt checkpoint, a model that
            differs from `args`, neither tidal.json nor `args` naming the model, or a layout
            neither recorded nor named.
    """
    path = resolve_checkpoint(Path(path).expanduser())
    weights = tt.resolve_layout(path, layout_name, flag)
    if progress:
        how = "named" if tt.folder_layout(path) is None else f"recorded in {layout.INFO}"
        log(f"{path}: {weights} layout ({how})")
    info = layout.verify(path)
    saved = args_from_info(info, path)
    if args is None and saved is None:
        raise CheckpointError(
            f"{path} has no {layout.INFO} recording its model (a DCP folder of another tool): "
            "name the model with --flavor or --config"
        )
    if args is not None and saved is not None:
        diff = arch_diff(model_info(saved, "")["args"], args)
        if diff:
            raise CheckpointError(
                f"checkpoint {path} holds another model than the one named: " + "; ".join(diff)
            )
        args = dataclasses.replace(args, extra=saved.extra or args.extra)
    args = args or saved
    assert args is not None
    metadata = read_metadata(path)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    wrong, missing = shape_diff(shapes, metadata)
    if wrong or missing:
        raise CheckpointError(mismatch_message(path, wrong, missing, []))
    state_dict: dict[str, torch.Tensor] = {}
    for key in shapes:
        md = metadata.state_dict_metadata[key]
        assert isinstance(md, TensorStorageMetadata), key
        state_dict[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)

    def read(chunk: dict[str, torch.Tensor]) -> None:
        load_flat(chunk, path, no_dist=True)  # this process alone, whatever the process group

    read_in_chunks(state_dict, read, path, log if progress else None)
    if weights == tt.TORCHTITAN:
        state_dict = tt.to_tidal(state_dict, args)
    return args, state_dict, {**info, "layout": weights}


def read_in_chunks(
    state_dict: dict[str, torch.Tensor],
    read: Callable[[dict[str, torch.Tensor]], None],
    where: Path,
    log: Log | None,
    *,
    chunk_bytes: int = READ_CHUNK_BYTES,
) -> None:
    """Fill the tensors of `state_dict` in place by calling `read` on successive sub-dicts of
    about `chunk_bytes` each (in key order; a chunk ends at the first tensor that reaches the
    size). With `log`, a line per chunk gives the percentage read of a state dict larger than
    one chunk, and a last line the tensors, megabytes and seconds read from `where` (the
    source named in those lines).

    Example (what the DCP -> Hugging Face conversion does)::

        read_in_chunks(sd, lambda chunk: load_flat(chunk, src, no_dist=True), src, print)
    """
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    start, done, size = time.perf_counter(), 0, 0
    chunk: dict[str, torch.Tensor] = {}
    keys = list(state_dict)
    for i, key in enumerate(keys):
        chunk[key] = state_dict[key]
        size += state_dict[key].numel() * state_dict[key].element_size()
        if size >= chunk_bytes or i == len(keys) - 1:
            read(chunk)
            done += size
            # Progress of large models; the summary below says when all is read.
            if log is not None and total >= chunk_bytes and i < len(keys) - 1:
                log(
                    f"  read {100 * done // total:3d}% ({done / 1e9:.2f} / {total / 1e9:.2f} "
                    f"GB) of {where}"
                )
            chunk, size = {}, 0
    if log is not None:
        log(
            f"read {len(keys)} tensors ({total / 1e6:,.1f} MB) from {where} in "
            f"{time.perf_counter() - start:.1f}s"
        )


def dcp_to_hf(
    src: StrPath,
    dst: StrPath,
    *,
    args: ModelArgs | None = None,
    dtype: torch.dtype | None = None,
    tokenizer: Any = None,
    max_shard_size: int | None = None,
    replace: bool = False,
    tokenizer_missing_ok: bool = False,
    layout_name: str | None = None,
    log: Log = print,
) -> Path:
    """Write the model of a DCP checkpoint as a Hugging Face folder.

    Args:
        src: a checkpoint folder (model-only or a full training save), or a folder of step-N
            checkpoints (the newest complete one).
        dst: the Hugging Face folder to create; it must not exist (an empty folder is taken)
            unless `replace`.
        args: the model, when the checkpoint has no tidal.json (else checked against it).
        dtype: cast every tensor; None keeps the saved dtypes.
        tokenizer: copied beside the weights (see `copy_tokenizer`); None writes none.
        tokenizer_missing_ok: a `tokenizer` path without a tokenizer.json is skipped, not an
            error.
        max_shard_size: bytes per safetensors file (None: save_hf's default).
        layout_name: the checkpoint's layout, as `read_model` takes it.

    Returns:
        `dst`.

    Raises:
        CheckpointError: as `read_model`.
        FileExistsError: `dst` exists.

    Example::

        dcp_to_hf("outputs/ft/checkpoint", "outputs/ft/hf", tokenizer="smollm2-135m")
    """
    from tidal.models.hf import save_hf_state_dict
    from tidal.models.hf.checkpoint import DEFAULT_MAX_SHARD_SIZE

    dst = Path(dst).expanduser()
    if dst.exists() and not replace and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"destination {dst} already exists; choose a new path")
    args, state_dict, _ = read_model(src, args, layout_name=layout_name, log=log)
    start = time.perf_counter()
    with staged(dst, replace=replace) as tmp:
        shard = max_shard_size or DEFAULT_MAX_SHARD_SIZE
        save_hf_state_dict(state_dict, args, tmp, dtype=dtype, max_shard_size=shard)
        extra = copy_tokenizer(tokenizer, tmp, missing_ok=tokenizer_missing_ok)
    files = sorted(p.name for p in dst.iterdir())
    size = sum(p.stat().st_size for p in dst.iterdir())
    log(
        f"wrote {dst} ({size / 1e6:,.1f} MB: {', '.join(files)}) in "
        f"{time.perf_counter() - start:.1f}s" + ("" if extra else "; no tokenizer")
    )
    return dst


# -- Hugging Face -> DCP -------------------------------------------------------------------


def hf_to_dcp(
    src: StrPath,
    dst: StrPath,
    *,
    flavor: str | None = None,
    dtype: torch.dtype | None = None,
    layout_name: str = tt.TIDAL,
    log: Log = print,
) -> Path:
    """Write a Hugging Face folder as a model-only DCP checkpoint folder.

    Args:
        src: config.json and safetensors (one file or sharded), Llama or Qwen 3.
        dst: the checkpoint folder to create (it holds .metadata, the DCP data, tidal.json and
            COMPLETE, and loads with `--checkpoint.initial_load_path dst`); it must not exist
            (an empty folder is taken).
        flavor: the tidal flavor this model is (checked; the vocabulary may differ, as
            `--model.vocab_size` allows); None records the first flavor that matches, if any.
        dtype: cast every tensor; None keeps the stored dtypes.
        layout_name: "tidal", or "torchtitan" for a checkpoint that torchtitan's model of
            this architecture loads (`--checkpoint.initial_load_path`), recorded in tidal.json.

    Returns:
        `dst`.

    Raises:
        FileNotFoundError: a missing folder, config.json or safetensors file.
        ValueError: an unsupported config, a missing, extra or misshapen tensor, a truncated
            or corrupt file (all before any tensor data is read), or `flavor` differs.
        FileExistsError: `dst` exists.
    """
    from tidal.models.hf import check_hf

    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    _check_new(dst)
    _check_layout(layout_name)
    args = check_hf(src)
    if flavor is not None:
        _check_flavor(flavor, args, str(src / "config.json"))
    else:
        flavor = matching_flavor(args)
        if flavor is not None:
            log(f"{src}: the architecture of model.flavor {flavor!r}")
    state_dict = _read_hf(src, args, dtype, log)
    return _write_dcp(state_dict, args, dst, flavor or f"hf:{src.name}", src, layout_name, log)


def dcp_to_dcp(
    src: StrPath,
    dst: StrPath,
    *,
    args: ModelArgs | None = None,
    layout_name: str | None = None,
    to_layout: str = tt.TIDAL,
    dtype: torch.dtype | None = None,
    log: Log = print,
) -> Path:
    """Write the model of a DCP checkpoint as a model-only checkpoint in `to_layout`: a
    torchtitan checkpoint as tidal's (which `tidal generate --checkpoint` reads), or tidal's
    as torchtitan's (which torchtitan's `--checkpoint.initial_load_path` reads).

    Args:
        src, args, layout_name: as `read_model` takes them.
        dst: the checkpoint folder to create (tidal.json records `to_layout`); it must not
            exist (an empty folder is taken).
        dtype: cast every tensor; None keeps the saved dtypes.

    Raises:
        CheckpointError: as `read_model`.
        FileExistsError: `dst` exists.
    """
    dst = Path(dst).expanduser()
    _check_new(dst)
    _check_layout(to_layout)
    args, state_dict, info = read_model(src, args, layout_name=layout_name, log=log)
    if dtype is not None:
        state_dict = {k: v.to(dtype) for k, v in state_dict.items()}
    flavor = info.get("model", {}).get("flavor") or matching_flavor(args) or "custom"
    source = resolve_checkpoint(Path(src).expanduser())
    return _write_dcp(state_dict, args, dst, flavor, source, to_layout, log)


def _check_new(dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"destination {dst} already exists; choose a new path")


def _check_layout(name: str) -> None:
    if name not in tt.LAYOUTS:
        raise ValueError(f"layout {name!r} is unknown; choose {' or '.join(tt.LAYOUTS)}")


def _write_dcp(
    state_dict: dict[str, torch.Tensor],
    args: ModelArgs,
    dst: Path,
    flavor: str,
    source: Path,
    layout_name: str,
    log: Log,
) -> Path:
    """Save a tidal-layout model state dict as the model-only checkpoint `dst` in
    `layout_name`, with tidal.json and COMPLETE."""
    note = "" if flavor not in FLAVORS else f" (--model.flavor {flavor}"
    if flavor in FLAVORS and FLAVORS[flavor].vocab_size != args.vocab_size:
        note += f" --model.vocab_size {args.vocab_size}"
    note += ")" if note else ""
    if layout_name == tt.TORCHTITAN:
        state_dict = tt.to_torchtitan(state_dict, args)
    start = time.perf_counter()
    log(f"writing {dst} ({layout_name} layout)")
    with staged(dst) as tmp:
        saved = save_model(
            state_dict,
            tmp,
            0,
            info={
                "model": model_info(args, flavor),
                "source": str(source),
                "layout": layout_name,
            },
        )
        for f in saved.iterdir():  # tmp/step-0/* -> tmp/*: dst is the checkpoint itself
            os.rename(f, tmp / f.name)
        saved.rmdir()
    if layout_name == tt.TORCHTITAN:
        hint = f"torchtitan loads it with --checkpoint.initial_load_path {dst}"
    else:
        hint = f"start a run from it with --checkpoint.initial_load_path {dst}{note}"
    log(f"wrote {dst} in {time.perf_counter() - start:.1f}s; {hint}")
    return dst


def _read_hf(
    src: Path, args: ModelArgs, dtype: torch.dtype | None, log: Log
) -> dict[str, torch.Tensor]:
    """Every tensor of a checked Hugging Face folder under its tidal name, in its stored dtype
    (or `dtype`), read in chunks with progress."""
    from tidal.models.hf import load_hf_state_dict
    from tidal.models.hf.checkpoint import adapter_for
    from tidal.models.hf.common import FLOAT_DTYPES, read_folder

    entries = read_folder(src)
    names = adapter_for(args).hf_names(args)
    state_dict = {}
    for key, hf in names.items():
        first = entries[hf if isinstance(hf, str) else hf[0]]
        shape = first.shape if isinstance(hf, str) else (len(hf), *first.shape)  # stacked
        state_dict[key] = torch.empty(shape, dtype=dtype or FLOAT_DTYPES[first.dtype])
    # strict=False: each chunk is a subset; check_hf has matched the whole folder already.
    read_in_chunks(state_dict, lambda chunk: load_hf_state_dict(src, chunk, strict=False), src, log)
    return state_dict


def export_last_save(
    checkpoint: Path,
    args: ModelArgs,
    *,
    dtype: torch.dtype | None,
    tokenizer: Any,
    log: Log,
) -> Path:
    """`checkpoint.last_save_in_hf`: the model of the checkpoint just saved, as
    `<folder>/step-N-hf` beside it (an earlier export of the step is replaced)."""
    dst = checkpoint.with_name(f"{checkpoint.name}-hf")
    return dcp_to_hf(
        checkpoint,
        dst,
        args=args,
        dtype=dtype,
        tokenizer=tokenizer,
        replace=True,
        tokenizer_missing_ok=True,
        log=log,
    )


def tokenizer_source(path: str, tokenizer: Any) -> Any:
    """What an export copies for a run's tokenizer: the `data.tokenizer` file, or the trained
    tokenizer object when `data.tokenizer` is 'bpe'."""
    return path if path != "bpe" else tokenizer


__all__: Sequence[str] = [
    "dcp_to_dcp",
    "dcp_to_hf",
    "export_last_save",
    "hf_args_for",
    "hf_to_dcp",
    "matching_flavor",
    "read_model",
    "resolve_checkpoint",
]
