"""torchtitan's DCP checkpoints: which layout a folder holds, and the model's weights moved
between torchtitan's layout and tidal's.

A folder holds one of three layouts:

- `tidal`: a DCP checkpoint tidal wrote (tidal.json, COMPLETE). q/k projections in the
  rotate-half order that tidal's RoPE and Hugging Face checkpoints use.
- `torchtitan`: a DCP checkpoint of torchtitan 0.2 (a `step-N` folder of `.metadata` and
  `__R_0.distcp` files; no marker). Its model keys are tidal's names (`tok_embeddings.weight`,
  `layers.0.attention.wq.weight`, ..., `output.weight`) at the top level, in a model-only save
  (`last_save_model_only`, torchtitan's default for the last step) and in a training save,
  which adds `optimizer.state.<name>.exp_avg` ..., `lr_scheduler.*`, `dataloader.*` and
  `train_state.*` entries. Its Llama 3 applies RoPE to interleaved pairs (complex numbers,
  Meta's original layout), so each head's rows of wq and wk are in another order than
  tidal's: the names match but the tensors do not, and reading them as tidal's gives a model
  whose logits differ. Its Qwen 3 uses the rotate-half order (no permutation) and, with
  tied embeddings, saves `output.weight` beside `tok_embeddings.weight`.
- `hf`: a Hugging Face folder (config.json and safetensors); see tidal/models/hf/.

Since the names are the same, a DCP folder without tidal.json cannot tell tidal's order from
torchtitan's: such a folder is refused unless the layout is named (`--layout`,
`checkpoint.initial_load_layout`). tidal.json records `"layout"` (absent in folders of
earlier versions: tidal).

Conversions are exact (row permutations and copies, no arithmetic): `to_tidal` and
`to_torchtitan` on full tensors (`tidal convert`), `to_tidal_sharded` on the DTensor shards a
training run loads into (`checkpoint.initial_load_path`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from tidal.models.transformer import ModelArgs
from tidal.train.checkpoint import layout
from tidal.train.checkpoint.layout import CheckpointError

TIDAL, TORCHTITAN, HF = "tidal", "torchtitan", "hf"
LAYOUTS = (TIDAL, TORCHTITAN)
"""The DCP layouts tidal reads and writes (`hf` folders go through tidal/models/hf/)."""

_QK_RE = re.compile(r"^layers\.\d+\.attention\.w([qk])\.weight$")


# -- which layout a folder holds ------------------------------------------------------------


def is_hf_folder(path: Path) -> bool:
    """A Hugging Face folder: config.json beside safetensors weights."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def folder_layout(path: Path) -> str | None:
    """The layout `path` says it holds: tidal.json's `layout` (a tidal checkpoint of an earlier
    version, without it: tidal), `hf` for a Hugging Face folder, None when it does not say
    (a DCP folder of another tool, or a folder that is both).

    Raises:
        CheckpointError: an unreadable tidal.json, or one naming an unknown layout.
    """
    dcp = (path / layout.DCP_METADATA).is_file()
    hf = is_hf_folder(path)
    if (path / layout.INFO).is_file():
        info = layout.read_info(path)
        saved = info.get("layout", TIDAL)
        if saved not in LAYOUTS:
            raise CheckpointError(
                f"{path / layout.INFO}: layout {saved!r} is not one of {', '.join(LAYOUTS)}"
            )
        return str(saved)
    if hf and not dcp:
        return HF
    return None


def resolve_layout(path: Path, given: str | None, flag: str = "--layout") -> str:
    """The layout of the DCP checkpoint `path`: `given` (checked against what tidal.json
    records), else the recorded one.

    Raises:
        CheckpointError: a Hugging Face folder, a folder that does not say (one line naming
            `flag`), or `given` contradicting tidal.json.
    """
    if given is not None and given not in LAYOUTS:
        raise CheckpointError(f"{flag} {given!r}: choose {' or '.join(LAYOUTS)}")
    saved = folder_layout(path)
    if saved == HF:
        raise CheckpointError(
            f"{path} is a Hugging Face folder (config.json and safetensors), not a DCP checkpoint"
        )
    if saved is not None and given is not None and saved != given:
        raise CheckpointError(f"{flag} {given} but {path / layout.INFO} records layout {saved}")
    if saved is not None:
        return saved
    if given is not None:
        return given
    both = " and config.json with safetensors" if is_hf_folder(path) else ""
    raise CheckpointError(
        f"{path} is a DCP checkpoint without {layout.INFO}{both}, so its layout is unknown "
        f"(torchtitan's Llama orders q/k rows unlike tidal's): pass {flag} torchtitan or "
        f"{flag} tidal"
    )


def newest_foreign_step(folder: Path) -> Path | None:
    """The newest `step-N` folder of `folder` that another tool wrote (DCP `.metadata`, no
    tidal.json: torchtitan marks no completion, it writes `.metadata` last), or None.
    A tidal save cut short keeps its tidal.json and is never taken."""
    found = {}
    for entry in folder.iterdir() if folder.is_dir() else ():
        m = re.fullmatch(r"step-(\d+)", entry.name)
        if (
            m
            and (entry / layout.DCP_METADATA).is_file()
            and not (entry / layout.INFO).exists()
            and not (entry / layout.MARKER).exists()
        ):
            found[int(m.group(1))] = entry
    return found[max(found)] if found else None


# -- the weights ---------------------------------------------------------------------------


def _permuted(w: torch.Tensor, heads: int, to: str) -> torch.Tensor:
    """wq or wk ([heads * K, D]) with each head's rows reordered between interleaved pairs
    (torchtitan, Meta: rows 2i and 2i+1 rotate together) and halves (tidal, Hugging Face: rows
    i and i + K/2), as transformers' convert_llama_weights_to_hf does."""
    rows, cols = w.shape
    half = rows // heads // 2
    if to == TIDAL:
        return w.reshape(heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)
    return w.reshape(heads, 2, half, cols).transpose(1, 2).reshape(rows, cols)


def _permutes(args: ModelArgs) -> bool:
    """Whether torchtitan's model of this family orders q/k rows unlike tidal's."""
    return args.family == "llama3"


def _heads(key: str, args: ModelArgs) -> int | None:
    m = _QK_RE.match(key)
    if m is None:
        return None
    return args.n_heads if m.group(1) == "q" else args.n_kv_heads


def to_tidal(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """The model state dict of a torchtitan checkpoint (full tensors) in tidal's layout: q/k
    rows reordered for Llama, the `output.weight` of a tied model dropped."""
    out = {}
    for key, value in state_dict.items():
        if key == "output.weight" and args.tie_embeddings:
            continue
        heads = _heads(key, args)
        if heads is not None and _permutes(args):
            value = _permuted(value, heads, TIDAL).contiguous()
        out[key] = value
    return out


def to_torchtitan(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """A tidal model state dict (full tensors) in torchtitan's layout: q/k rows reordered for
    Llama, and a tied model's embedding saved as `output.weight` too (torchtitan's Qwen 3
    saves both names; its Llama 3 has no tying and reads it as its own output matrix)."""
    out = {}
    for key, value in state_dict.items():
        heads = _heads(key, args)
        if heads is not None and _permutes(args):
            value = _permuted(value, heads, TORCHTITAN).contiguous()
        out[key] = value
    if args.tie_embeddings and "output.weight" not in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def to_tidal_sharded(state_dict: dict[str, Any], args: ModelArgs) -> None:
    """Reorder, in `state_dict` (model keys -> tensors or DTensors, as a training run loads
    them), the q/k rows that were just read from a torchtitan checkpoint. A DTensor is
    gathered, reordered and split again into the same placements (every rank of its mesh
    calls this, with the same keys in the same order); a plain tensor is reordered in place.
    Only wq and wk move: a small part of the model."""
    if not _permutes(args):
        return
    from torch.distributed.tensor import DTensor, distribute_tensor

    for key in sorted(state_dict):
        heads = _heads(key, args)
        value = state_dict[key]
        if heads is None or not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, DTensor):
            full = _permuted(value.full_tensor(), heads, TIDAL)
            mine = distribute_tensor(full, value.device_mesh, value.placements, src_data_rank=None)
            value.to_local().copy_(mine.to_local())
        else:
            value.copy_(_permuted(value.clone(), heads, TIDAL))


def check_loadable(path: Path, layout_name: str, model_only: bool, flag: str) -> None:
    """Refuse what cannot be read from a torchtitan checkpoint: its optimizer, schedule and
    data states are in torchtitan's own formats (and its optimizer's q/k moments in its row
    order), so only the model starts a run."""
    if layout_name == TORCHTITAN and not model_only:
        raise CheckpointError(
            f"{path} is in torchtitan's layout ({flag} torchtitan): only its model loads; "
            "leave checkpoint.initial_load_model_only true"
        )
