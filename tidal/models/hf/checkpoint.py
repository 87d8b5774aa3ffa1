"""Hugging Face checkpoints in and out: `load_hf`, `save_hf` and the sharded loader.

Who calls what:

- `load_hf(path)` builds a whole `Transformer` in one process (tests, conversion, generation
  on one device): config.json -> ModelArgs -> a model on the meta device -> `to_empty` ->
  tensors copied in from the safetensors memory maps, one at a time.
- A training job builds its model from `hf_model_args(path)` on the meta device, parallelizes
  it (FSDP2, TP, pipeline stages) and `to_empty`s it as usual, then calls
  `load_hf_state_dict(path, model.state_dict())` on every rank instead of `init_weights()`:
  each rank reads only the slices of the tensors it holds (`safe_open(...).get_slice`), with no
  communication. Pipeline stages pass `strict=False`, since they hold a subset of the tensors.
- `save_hf(model, path)` (or `save_hf_state_dict(sd, args, path)` for a state dict gathered
  elsewhere, e.g. from DCP) runs in one process and writes what
  `transformers.AutoModelForCausalLM.from_pretrained(path)` loads.

Every check happens before the first tensor byte is read: config fields, safetensors headers,
names, shapes and dtypes. Each family's names and config fields live in its adapter
(tidal/models/hf/llama.py, qwen2.py, qwen3.py, qwen3_moe.py, over the fields and names they
share in decoder.py); no tensor needs a permutation, since tidal's attention uses the
rotate-half RoPE layout of Hugging Face checkpoints. A stacked tensor (an MoE layer's experts,
[E, ...]) maps to E checkpoint tensors, one per expert: each is read into, or written from, its
slice along the first dim.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from tidal.models.hf import llama, qwen2, qwen3, qwen3_moe
from tidal.models.hf.common import (
    DTYPE_CODES,
    FLOAT_DTYPES,
    Adapter,
    ConfigFields,
    HFName,
    TensorEntry,
    read_config,
    read_folder,
    slice_reader,
    write_folder,
)
from tidal.models.transformer import ModelArgs, Transformer, rope_tables

ADAPTERS: dict[str, Adapter] = {
    llama.MODEL_TYPE: llama,
    qwen2.MODEL_TYPE: qwen2,
    qwen3.MODEL_TYPE: qwen3,
    qwen3_moe.MODEL_TYPE: qwen3_moe,
}
"""config.json `model_type` -> the family's adapter module."""

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
"""Bytes per safetensors file above which `save_hf` shards (transformers 4's default)."""

StrPath = str | os.PathLike[str]


def _adapter(c: ConfigFields) -> Adapter:
    model_type = c.raw.get("model_type")
    if model_type not in ADAPTERS:
        c.refuse("model_type", model_type, f"one of {sorted(ADAPTERS)}")
    return ADAPTERS[model_type]


def adapter_for(args: ModelArgs) -> Adapter:
    """The Hugging Face adapter of `args.family` (one of `ADAPTERS`): its config.json fields
    (`hf_config`) and tensor names (`hf_names`, tidal name -> Hugging Face name).

    Example::

        names = adapter_for(args).hf_names(args)
        names["tok_embeddings.weight"]  # "model.embed_tokens.weight"

    Raises:
        ValueError: no adapter for the family."""
    for adapter in ADAPTERS.values():
        if adapter.FAMILY == args.family:
            return adapter
    raise ValueError(f"no Hugging Face adapter for family {args.family!r}")


def _canonical(key: str) -> str:
    """A state-dict key without the segments wrappers add (activation checkpointing, compile)."""
    return key.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def hf_model_args(path: StrPath) -> ModelArgs:
    """The ModelArgs of a Hugging Face checkpoint folder, from its config.json alone.

    The token ids of config.json (bos/eos/pad) go to `args.extra["hf"]`, and `save_hf` writes
    them back.

    Raises:
        FileNotFoundError: no folder or no config.json.
        ValueError: an unknown model_type or an unsupported field (the message names the file,
            the field and its value).
    """
    c = read_config(Path(path).expanduser())
    return _adapter(c).model_args(c)


def check_hf(path: StrPath) -> ModelArgs:
    """Check a Hugging Face checkpoint folder without reading any tensor data: config.json,
    every safetensors header, and the names, shapes and dtypes of the tensors against the
    model its config describes. Returns that model's ModelArgs (as `hf_model_args`).

    A trainer calls it before it builds anything, so a bad folder fails at once.

    Raises:
        As `load_hf`.
    """
    folder = Path(path).expanduser()
    c = read_config(folder)
    adapter = _adapter(c)
    args = adapter.model_args(c)
    with torch.device("meta"):
        shapes = Transformer(args).state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied lm_head warning comes again at the load
        _plan(shapes, adapter, args, read_folder(folder), folder, strict=True)
    return args


def load_hf(
    path: StrPath, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Transformer:
    """Build a tidal Transformer from a Hugging Face checkpoint folder.

    Args:
        path: folder with config.json and model.safetensors, or shards with
            model.safetensors.index.json (Llama 2/3/3.1/3.2, Qwen 2/2.5 or Qwen 3).
        device: where the parameters go.
        dtype: cast every parameter to this dtype; None keeps each tensor's stored dtype
            (so `save_hf` writes the same bytes back).

    Returns:
        The model, its parameters filled and its RoPE tables computed.

    Raises:
        FileNotFoundError: a missing folder, config.json, safetensors file or shard.
        ValueError: an unsupported config; a missing, extra, wrongly shaped or non-float
            tensor; a truncated or corrupt safetensors file. All raised before any tensor
            data is read.
        TypeError: `dtype` is not a floating-point dtype.

    Example:
        >>> model = load_hf("~/.cache/tidal/models/smollm2-135m")  # doctest: +SKIP
        >>> logits = model(torch.tensor([[1, 2, 3]]))  # doctest: +SKIP
    """
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    folder = Path(path).expanduser()
    c = read_config(folder)
    adapter = _adapter(c)
    args = adapter.model_args(c)
    entries = read_folder(folder)
    with torch.device("meta"):
        model = Transformer(args)
    plan = _plan(model.state_dict(), adapter, args, entries, folder, strict=True)
    # Each parameter takes the stored dtype (or `dtype`) while still on the meta device.
    stored = {key: entry if isinstance(entry, TensorEntry) else entry[0] for key, _, entry in plan}
    for module_name, module in model.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            key = f"{module_name}.{name}" if module_name else name
            want = dtype or FLOAT_DTYPES[stored[key].dtype]
            if p.dtype != want:
                setattr(module, name, nn.Parameter(torch.empty_like(p, dtype=want)))
    model.to_empty(device=device)
    model.rope.copy_(rope_tables(args, device=model.rope.device))
    sd = model.state_dict()
    _fill([(key, sd[key], entry) for key, _, entry in plan])
    return model


def load_hf_state_dict(
    path: StrPath, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Fill a tidal state dict in place from a Hugging Face checkpoint folder.

    The tensors may be DTensors (FSDP2, TP, both): each rank reads only the slice of each
    tensor that its local shard holds, through `safe_open(...).get_slice(name)[...]`, with no
    collective. Call it on every rank after `to_empty` and `init_weights()`: the RoPE tables
    are a buffer outside the state dict that `init_weights` fills (or copy
    `rope_tables(args)` into `model.rope`); every parameter is then overwritten.

    Args:
        path: the checkpoint folder.
        state_dict: tidal keys (wrapper segments such as `_orig_mod.` are ignored) to plain
            tensors or DTensors with Shard/Replicate placements, already allocated.
        strict: refuse checkpoint tensors that no key of `state_dict` takes. Pipeline stages
            hold a subset of the model and pass False; a key the checkpoint lacks is an
            error either way.

    Raises:
        As `load_hf`, before any tensor data is read.
    """
    folder = Path(path).expanduser()
    c = read_config(folder)
    adapter = _adapter(c)
    args = adapter.model_args(c)
    _fill(_plan(state_dict, adapter, args, read_folder(folder), folder, strict=strict))


Planned = TensorEntry | tuple[TensorEntry, ...]
"""A checkpoint tensor, or the per-expert tensors of a stacked one (its slices along dim 0)."""


def _plan(
    state_dict: Mapping[str, torch.Tensor],
    adapter: Adapter,
    args: ModelArgs,
    entries: dict[str, TensorEntry],
    folder: Path,
    *,
    strict: bool,
) -> list[tuple[str, torch.Tensor, Planned]]:
    """Match every state-dict key to a checkpoint tensor of the same shape and a float dtype
    (a stacked key: to one tensor per slice, of the slice's shape and all of one dtype)."""
    names = adapter.hf_names(args)
    plan: list[tuple[str, torch.Tensor, Planned]] = []
    used: set[str] = set()
    for key, dst in state_dict.items():
        hf = names.get(_canonical(key))
        if hf is None:
            raise ValueError(
                f"state dict key {key!r} is not a tensor of the {adapter.MODEL_TYPE} model "
                f"that {folder / 'config.json'} describes"
            )
        stacked = isinstance(hf, tuple)
        if stacked and len(hf) != dst.shape[0]:
            raise ValueError(f"{key!r} stacks {dst.shape[0]} tensors, its names are {len(hf)}")
        shape = tuple(dst.shape[1:]) if stacked else tuple(dst.shape)
        found: list[TensorEntry] = []
        for name in hf if isinstance(hf, tuple) else (hf,):
            entry = entries.get(name)
            if entry is None:
                raise ValueError(
                    f"{folder}: checkpoint has no tensor {name!r} (for tidal's {key!r})"
                )
            if entry.dtype not in FLOAT_DTYPES or entry.dtype != (found or [entry])[0].dtype:
                raise ValueError(
                    f"{entry.file}: tensor {name!r} has dtype {entry.dtype}; expected one of "
                    f"{sorted(FLOAT_DTYPES)}"
                    + (f", the same as {found[0].name!r}'s" if found else "")
                )
            if entry.shape != shape:
                part = f"a slice of tidal's {key!r}" if stacked else f"tidal's {key!r}"
                raise ValueError(
                    f"{entry.file}: tensor {name!r} has shape {list(entry.shape)}, but {part} "
                    f"has shape {list(shape)}"
                )
            found.append(entry)
            used.add(name)
        plan.append((key, dst, tuple(found) if stacked else found[0]))
    unused = sorted(set(entries) - used)
    # Tolerated leftovers: RoPE tables some exporters save, and a copy of a tied embedding.
    derived = [n for n in unused if n.endswith("rotary_emb.inv_freq")]
    tied = [n for n in unused if n == "lm_head.weight" and args.tie_embeddings]
    if tied and strict:
        warnings.warn(
            f"{folder}: lm_head.weight is ignored: config.json ties it to the embedding",
            stacklevel=3,
        )
    extra = [n for n in unused if n not in derived and n not in tied]
    if strict and extra:
        raise ValueError(
            f"{folder}: checkpoint has {len(extra)} tensor(s) the {adapter.MODEL_TYPE} model "
            f"of its config.json does not: {extra[:5]}"
        )
    return plan


def _fill(plan: list[tuple[str, torch.Tensor, Planned]]) -> None:
    """Copy each checkpoint tensor, or the slice a DTensor's local shard holds, into place
    (stacked: each slice along dim 0 from its own tensor)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with slice_reader() as reader, torch.no_grad():
        for key, dst, entry in plan:
            if isinstance(dst, DTensor):
                _check_box_layout(key, dst.placements)
                local = dst.to_local()
                shape, offset = compute_local_shape_and_global_offset(
                    dst.shape, dst.device_mesh, dst.placements
                )
                assert tuple(local.shape) == tuple(shape), (
                    f"{key}: local shard {tuple(local.shape)} != computed {tuple(shape)}"
                )
                if local.numel() == 0:  # an uneven split left this rank nothing
                    continue
                box = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
                if isinstance(entry, tuple):
                    for i, e in enumerate(range(box[0].start, box[0].stop)):
                        local[i].copy_(reader.read(entry[e], box[1:]))
                else:
                    local.copy_(reader.read(entry, box))
            elif isinstance(entry, tuple):
                for e, part in enumerate(entry):
                    dst[e].copy_(reader.read(part))
            else:
                dst.copy_(reader.read(entry))


def _check_box_layout(key: str, placements) -> None:
    """Refuse layouts whose local shard is not one box of the global tensor.

    FSDP2 over TP shards a dim twice, recorded as _StridedShard(d) on the outer mesh dim and
    Shard(d) on the inner one: chunks of chunks, still one box (what DCP assumes too). A
    _StridedShard after a Shard of the same dim would interleave rows instead."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    sharded = set()
    for p in placements:
        if p.is_partial():
            raise ValueError(f"{key!r} has Partial placements {placements}; cannot load into it")
        if isinstance(p, _StridedShard) and p.dim in sharded:
            raise ValueError(
                f"{key!r}: placements {placements} give a local shard that is not "
                "one slice of the tensor; not supported"
            )
        if isinstance(p, Shard):
            sharded.add(p.dim)


def _split(hf: HFName, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one tidal tensor: itself, or its slices along dim 0."""
    if isinstance(hf, str):
        return {hf: t.contiguous()}
    return {name: t[e].contiguous() for e, name in enumerate(hf)}


def save_hf(
    model: Transformer,
    path: StrPath,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write a tidal Transformer as a Hugging Face checkpoint folder.

    The folder gets config.json and model.safetensors, or shards of at most `max_shard_size`
    bytes with model.safetensors.index.json; `transformers.AutoModelForCausalLM` loads it.
    Tokenizer files are not written. A model whose parameters are DTensors must be gathered
    first (see `save_hf_state_dict`).

    Args:
        model: a whole model (not a pipeline stage) with plain tensors.
        path: the folder, created if needed; safetensors files of an earlier save there are
            replaced.
        dtype: cast every tensor to this dtype; None keeps each parameter's dtype.
        max_shard_size: bytes per file before sharding.

    Returns:
        The folder.

    Example:
        >>> save_hf(load_hf("in_dir"), "out_dir", dtype=torch.bfloat16)  # doctest: +SKIP
    """
    return save_hf_state_dict(
        model.state_dict(), model.args, path, dtype=dtype, max_shard_size=max_shard_size
    )


def save_hf_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    args: ModelArgs,
    path: StrPath,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """`save_hf` for a full tidal state dict (plain tensors, on any device) and its args,
    e.g. one gathered from a sharded job with
    `get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
    cpu_offload=True))` on rank 0, or read from a DCP checkpoint.

    Raises:
        ValueError: a key is missing or unknown for `args`' family, `args` cannot be
            expressed in the family's config.json, or max_shard_size is not positive.
        TypeError: a tensor is a DTensor, on the meta device, or not floating point; or
            `dtype` is not a floating-point dtype.
    """
    from torch.distributed.tensor import DTensor

    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be a positive byte count, got {max_shard_size}")
    adapter = adapter_for(args)
    names = adapter.hf_names(args)
    sd = {_canonical(k): v for k, v in state_dict.items()}
    missing, unknown = [k for k in names if k not in sd], [k for k in sd if k not in names]
    if missing or unknown:
        raise ValueError(
            f"state dict does not match a {args.family} model of these args: missing "
            f"{missing[:5]}, unknown {unknown[:5]}"
        )
    tensors: dict[str, torch.Tensor] = {}
    for key, hf in names.items():
        t = sd[key]
        if isinstance(t, DTensor):
            raise TypeError(
                f"{key!r} is a DTensor: gather a full state dict first (get_model_state_dict "
                "with full_state_dict=True) and save it from one rank"
            )
        if t.is_meta or not t.is_floating_point():
            raise TypeError(f"{key!r} is a {t.dtype} tensor on {t.device}: nothing to save")
        t = t.detach().to(device="cpu", dtype=dtype or t.dtype)
        tensors |= _split(hf, t)
    dtypes = [t.dtype for t in tensors.values()]
    main = max(set(dtypes), key=dtypes.count)
    assert main in DTYPE_CODES, f"unexpected dtype {main}"
    config = adapter.hf_config(args) | args.extra.get("hf", {})
    config["torch_dtype"] = str(main).removeprefix("torch.")
    folder = Path(path).expanduser()
    write_folder(folder, tensors, config, max_shard_size)
    return folder
