"""What every family adapter shares: config.json fields, RoPE settings and safetensors folders.

A Hugging Face checkpoint folder holds `config.json` and either one `model.safetensors` or
shards listed by `model.safetensors.index.json`. A safetensors file is an 8-byte little-endian
header length, a JSON header (name -> dtype, shape, byte range) and the raw tensor bytes.
Everything here checks before it reads: `read_folder` parses the config and every shard's
header (a few KB each) so that names, shapes and dtypes can be matched before any tensor byte
is touched; `SliceReader` then reads only the requested slice of each tensor.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

import torch

from tidal.models.transformer import ModelArgs, RopeScaling

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# safetensors dtype codes: the float ones tidal loads, and every code's item size (for checks).
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
DTYPE_CODES = {v: k for k, v in FLOAT_DTYPES.items()}
_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_MAX_HEADER = 100 * 2**20  # safetensors refuses headers above 100 MB too


def require_safetensors():
    """The `safetensors` module, or an ImportError that says what to install."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError as e:
        raise ImportError(
            "reading and writing Hugging Face checkpoints needs the `safetensors` package: "
            "pip install 'tidal[hf]'"
        ) from e
    return safetensors


HFName = str | tuple[str, ...]
"""A tidal tensor's Hugging Face name, or the names of its slices along dim 0 (stacked experts)."""


class Adapter(Protocol):
    """One model family's mapping (a module: tidal/models/hf/llama.py, qwen2.py, qwen3.py, ...)."""

    MODEL_TYPE: str
    """`model_type` in config.json."""
    FAMILY: str
    """`ModelArgs.family`."""

    def model_args(self, config: ConfigFields) -> ModelArgs: ...

    def hf_config(self, args: ModelArgs) -> dict[str, Any]: ...

    def hf_names(self, args: ModelArgs) -> Mapping[str, HFName]: ...


# ---------------------------------------------------------------------------------------
# config.json


class ConfigFields:
    """The fields of one config.json, read with errors that name the file, field and value."""

    def __init__(self, raw: Mapping[str, Any], source: str):
        self.raw, self.source = raw, source

    def refuse(self, key: str, value: Any, expected: str) -> NoReturn:
        raise ValueError(
            f"{self.source}: field {key!r} = {value!r} is not supported; tidal expects {expected}"
        )

    def required(self, key: str) -> int:
        """A positive integer field that must be present."""
        if key not in self.raw:
            raise ValueError(f"{self.source}: required field {key!r} is missing")
        return self.integer(key, None)

    def integer(self, key: str, default: int | None) -> int:
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise ValueError(f"{self.source}: required field {key!r} is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            self.refuse(key, value, "a positive integer")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            self.refuse(key, value, "a positive number")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.refuse(key, value, "true or false")
        return value

    def expect(self, key: str, allowed: tuple[Any, ...]) -> None:
        """Refuse the field unless it is absent or one of `allowed` (None counts as absent)."""
        value = self.raw.get(key)
        if value is not None and value not in allowed:
            self.refuse(key, value, " or ".join(repr(a) for a in allowed) + " (or no value)")


def read_config(folder: Path) -> ConfigFields:
    """Parse `<folder>/config.json`.

    Raises:
        FileNotFoundError: the folder or its config.json is missing.
        ValueError: config.json is not a JSON object.
    """
    if not folder.is_dir():
        raise FileNotFoundError(f"Hugging Face checkpoint folder {folder} does not exist")
    path = folder / CONFIG
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} has no {CONFIG}; a Hugging Face checkpoint folder holds config.json "
            "and model.safetensors (or shards with model.safetensors.index.json)"
        )
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a {type(raw).__name__}, expected a JSON object")
    return ConfigFields(raw, str(path))


def check_common_fields(
    c: ConfigFields, architecture: str, *, attention_bias: bool = False
) -> None:
    """Fields every family refuses unless they have the value tidal's math implements.
    `attention_bias`: the value the family's attention has (True for Qwen 2, whose q/k/v
    projections always carry biases)."""
    archs = c.raw.get("architectures")
    if archs is not None and archs != [architecture]:
        c.refuse("architectures", archs, f"[{architecture!r}] (a causal language model)")
    c.expect("hidden_act", ("silu",))
    c.expect("attention_bias", (attention_bias,))
    c.expect("mlp_bias", (False,))
    c.expect("rope_interleaved", (False,))
    c.expect("partial_rotary_factor", (1.0,))
    if c.raw.get("quantization_config") is not None:
        c.refuse("quantization_config", c.raw["quantization_config"], "an unquantized checkpoint")
    dropout = c.raw.get("attention_dropout")
    if dropout:
        import warnings

        warnings.warn(
            f"{c.source}: attention_dropout={dropout} is ignored (tidal has no dropout)",
            stacklevel=3,
        )


def rope_from_config(c: ConfigFields, max_seq_len: int) -> tuple[float, RopeScaling | None]:
    """rope_theta and Llama 3.1 scaling from either config style: `rope_theta` and
    `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5). Like transformers,
    `rope_scaling` wins over `rope_parameters`, and a missing theta is 10000."""
    key = "rope_scaling" if c.raw.get("rope_scaling") is not None else "rope_parameters"
    rope = c.raw.get(key) or {}
    if not isinstance(rope, dict):
        c.refuse(key, rope, "an object")
    theta = rope.get("rope_theta")
    if theta is None:
        theta = c.number("rope_theta", 10_000.0)
    elif isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        c.refuse(f"{key}.rope_theta", theta, "a positive number")
    if rope.get("partial_rotary_factor") not in (None, 1.0):
        c.refuse(f"{key}.partial_rotary_factor", rope["partial_rotary_factor"], "1.0")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        c.refuse(f"{key}.rope_type", kind, "'default' or 'llama3'")
    for field in ("factor", "low_freq_factor", "high_freq_factor"):
        if not isinstance(rope.get(field), int | float) or isinstance(rope.get(field), bool):
            c.refuse(f"{key}.{field}", rope.get(field), "a number (llama3 RoPE scaling)")
    original = rope.get("original_max_position_embeddings", max_seq_len)
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        c.refuse(f"{key}.original_max_position_embeddings", original, "a positive integer")
    return float(theta), RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_seq_len=original,
    )


def rope_to_config(args: ModelArgs) -> dict[str, Any]:
    """`rope_theta` and `rope_scaling` as transformers 4 and 5 both read them."""
    s = args.rope_scaling
    scaling = None
    if s is not None:
        scaling = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_seq_len,
        }
    return {"rope_theta": args.rope_theta, "rope_scaling": scaling}


# Config fields kept in ModelArgs.extra["hf"] on load and written back on save: they mean
# nothing to the math but a generator and transformers want them.
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def token_ids(c: ConfigFields) -> dict[str, Any]:
    return {k: c.raw[k] for k in TOKEN_ID_FIELDS if c.raw.get(k) is not None}


def build_args(c: ConfigFields, **fields: Any) -> ModelArgs:
    """ModelArgs(**fields), its validation errors prefixed with the config file."""
    try:
        return ModelArgs(**fields)
    except ValueError as e:
        raise ValueError(f"{c.source}: {e}") from None


# ---------------------------------------------------------------------------------------
# safetensors folders


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors file, as its header describes it."""

    name: str
    file: Path
    dtype: str
    """safetensors dtype code: F32, BF16, ..."""
    shape: tuple[int, ...]


def read_header(file: Path) -> dict[str, TensorEntry]:
    """The tensors a safetensors file holds, from its header alone (reads a few KB).

    Raises:
        ValueError: the file is truncated or its header is corrupt (the message names the file).
    """
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file}: not a safetensors file (only {size} bytes)")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, _MAX_HEADER):
            raise ValueError(
                f"{file}: truncated or corrupt safetensors file (header of {n} bytes in a file "
                f"of {size} bytes)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_size, data_end = size - 8 - n, 0
    entries = {}
    for name, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            nbytes = math.prod(shape) * _ITEMSIZE[dtype] if dtype in _ITEMSIZE else end - start
            ok = 0 <= start <= end and end - start == nbytes
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{file}: corrupt safetensors header entry for {name!r}: {info}")
        data_end = max(data_end, end)
        entries[name] = TensorEntry(name, file, dtype, shape)
    if data_end > data_size:
        raise ValueError(
            f"{file}: truncated safetensors file: its header describes {data_end} bytes of "
            f"tensor data, the file holds {data_size}"
        )
    return entries


def read_folder(folder: Path) -> dict[str, TensorEntry]:
    """Every tensor of a checkpoint folder (one file, or shards listed by the index), from
    the headers alone.

    Raises:
        FileNotFoundError: no model.safetensors, no index, or a shard the index names is missing.
        ValueError: the index and the shards disagree, or a header is corrupt.
    """
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict) and all(
                isinstance(v, str) for v in weight_map.values()
            )
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AssertionError):
            raise ValueError(
                f"{index}: not a safetensors index (a JSON object with a 'weight_map' of "
                "tensor name -> file name)"
            ) from None
        entries: dict[str, TensorEntry] = {}
        for fname in sorted(set(weight_map.values())):
            if Path(fname).name != fname:
                raise ValueError(f"{index}: shard name {fname!r} is not a plain file name")
            shard = folder / fname
            if not shard.is_file():
                raise FileNotFoundError(f"{index} names shard {fname}, which does not exist")
            listed = {k for k, v in weight_map.items() if v == fname}
            header = read_header(shard)
            if set(header) != listed:
                diff = sorted(listed ^ set(header))
                raise ValueError(
                    f"{index} and {shard} disagree on which tensors the shard holds: {diff[:5]}"
                )
            entries.update(header)
        return entries
    single = folder / SINGLE_FILE
    if single.is_file():
        return read_header(single)
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    raise FileNotFoundError(
        f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}"
        + (f" (it has {found[:5]})" if found else "")
    )


class SliceReader:
    """Reads (slices of) tensors through `safe_open(...).get_slice(name)[...]`, one open
    handle per file, so that only the requested bytes are copied out of the memory map."""

    def __init__(self) -> None:
        self._handles: dict[Path, Any] = {}

    def read(self, entry: TensorEntry, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor, or its `box` (one slice per dim) when given."""
        handle = self._handles.get(entry.file)
        if handle is None:
            st = require_safetensors()
            try:
                handle = st.safe_open(str(entry.file), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise ValueError(f"{entry.file}: cannot open as safetensors: {e}") from e
            self._handles[entry.file] = handle
        if box is None:
            return handle.get_tensor(entry.name)
        return handle.get_slice(entry.name)[box]

    def close(self) -> None:
        for h in self._handles.values():
            if hasattr(h, "__exit__"):
                h.__exit__(None, None, None)
        self._handles.clear()


@contextmanager
def slice_reader() -> Iterator[SliceReader]:
    reader = SliceReader()
    try:
        yield reader
    finally:
        reader.close()


def write_folder(
    folder: Path, tensors: Mapping[str, torch.Tensor], config: dict[str, Any], max_shard_size: int
) -> list[Path]:
    """Write config.json and the tensors (HF names, in this order) as one model.safetensors,
    or as model-0000i-of-0000n.safetensors shards of at most `max_shard_size` bytes (a tensor
    larger than that gets a shard of its own) with model.safetensors.index.json. Files of an
    earlier save to the same folder that this one does not write are removed. Returns the
    safetensors files written."""
    st = require_safetensors()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    folder.mkdir(parents=True, exist_ok=True)
    n = len(shards)
    names = (
        [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    for old in folder.iterdir():  # a previous save's files would shadow or confuse this one
        if (old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.fullmatch(old.name)) and (
            old.name not in names
        ):
            old.unlink()
    paths = []
    for fname, shard in zip(names, shards, strict=True):
        path = folder / fname
        tmp = path.with_name(f".{fname}.tmp")
        st.torch.save_file(shard, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, 0o644)  # safetensors creates files readable by their owner only
        os.replace(tmp, path)
        paths.append(path)
    if n > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {name: fname for fname, s in zip(names, shards, strict=True) for name in s}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return paths
