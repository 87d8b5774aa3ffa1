"""Weights into a generator's model, in place: from a state dict (`copy_weights`) or a tidal
store (`read_weights`). The parameters are never reallocated, so CUDA graphs captured over
them stay valid (`Generator.load_weights` and `Generator.load_from_store` call these)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from tidal.models.transformer import Transformer


def copy_weights(model: Transformer, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy `state_dict` into `model`'s parameters in place (see `Generator.load_weights`:
    the same keys, global shapes, dtypes converted, plain tensors sliced into DTensors).

    Raises:
        KeyError: missing or unexpected keys (both listed).
        ValueError: a shape differs (key and both shapes named).
    """
    own = model.state_dict()
    missing, unexpected = (
        sorted(own.keys() - state_dict.keys()),
        sorted(state_dict.keys() - own.keys()),
    )
    if missing or unexpected:
        raise KeyError(
            f"weights do not match the model: missing {_few(missing)}, "
            f"unexpected {_few(unexpected)}"
        )
    for name, dst in own.items():
        src = state_dict[name]
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(src.shape)}, the model expects "
                f"{tuple(dst.shape)}"
            )
    with torch.no_grad():
        for name, dst in own.items():
            src = state_dict[name]
            if isinstance(dst, DTensor) and not isinstance(src, DTensor):
                src = distribute_tensor(
                    src.to(device=dst.to_local().device, dtype=dst.dtype),
                    dst.device_mesh,
                    dst.placements,
                    src_data_rank=None,  # every rank holds the full tensor: slice it
                )
            dst.copy_(src)


def read_weights(
    model: Transformer, store: Any, key: str, *, version: int | None, timeout: float
) -> int:
    """Read version `version` of state dict `key` from `store` into `model`'s parameters, in
    place; returns the version read (see `Generator.load_from_store` for the arguments and
    errors). The store is duck-typed (`versions`, `get_state_dict`): its KeyNotFoundError
    and VersionNotFoundError are KeyErrors, its StoreError a RuntimeError."""
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds, got {timeout}")
    if version is None:
        try:
            version = store.versions(key)[-1]
        except (KeyError, IndexError):  # no version of the key yet: wait for 0
            version = 0
    assert version is not None
    start = time.monotonic()
    try:
        store.get_state_dict(key, into=model.state_dict(), version=version, wait=timeout)
    except (KeyError, RuntimeError) as e:  # VersionNotFoundError, StoreError
        if time.monotonic() - start >= timeout:
            raise TimeoutError(
                f"version {version} of {key!r} did not arrive in the store within {timeout:g} s"
            ) from e
        raise
    return version


def _few(names: list[str], n: int = 8) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return (", ".join(names[:n]) or "none") + more
