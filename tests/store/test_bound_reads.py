"""A steady reader's gets skip the per-tensor checks and planning (tidal/store/reader.py
``BoundRead``), and anything that could make a kept read wrong makes it check again."""

from __future__ import annotations

import pytest
import torch

from tidal.store import reader, testing


def _sd(step: float = 0.0) -> dict[str, torch.Tensor]:
    return {f"l{i}.w": torch.full((8, 4), float(i) + step) for i in range(6)}


def test_a_steady_reader_is_checked_once_and_reads_every_version(store):
    into = {k: torch.empty_like(v) for k, v in _sd().items()}
    for step in range(5):  # keep=2: the versions' slots come from a ring
        store.put_state_dict(_sd(step), "m")
        store.get_state_dict("m", into=into)
        for k, v in _sd(step).items():
            assert torch.equal(into[k], v), (step, k)
    assert testing.reads_bound(store) == 1


def test_other_tensors_names_or_shapes_are_checked_again(store):
    store.put_state_dict(_sd(1), "m")
    into = {k: torch.empty_like(v) for k, v in _sd().items()}
    store.get_state_dict("m", into=into)
    # The same tensors under swapped names: each name still gets its own tensor's bytes.
    swapped = dict(into)
    swapped["l0.w"], swapped["l1.w"] = into["l1.w"], into["l0.w"]
    store.get_state_dict("m", into=swapped)
    assert torch.equal(swapped["l0.w"], _sd(1)["l0.w"]) and testing.reads_bound(store) == 2
    # A tensor's memory replaced under the same object (as `param.data = ...` does): the
    # next version goes into the new memory, the old memory keeps the last one's bytes.
    old_memory = into["l2.w"].data
    into["l2.w"].data = torch.zeros(8, 4)
    store.put_state_dict(_sd(2), "m")
    store.get_state_dict("m", into=into)
    assert torch.equal(into["l2.w"], _sd(2)["l2.w"])
    assert torch.equal(old_memory, _sd(1)["l2.w"])
    assert testing.reads_bound(store) == 3
    # A tensor shrunk in place: the shape check runs again and refuses it.
    into["l3.w"].resize_(4, 4)
    with pytest.raises(ValueError, match="l3.w: destination has global shape"):
        store.get_state_dict("m", into=into)


def test_reads_that_allocate_their_tensors_are_not_kept(store):
    store.put_state_dict(_sd(), "m")
    for _ in range(3):
        store.get_state_dict("m")  # fresh tensors every time: nothing to keep
    assert testing.reads_bound(store) == 3


def test_a_handle_keeps_the_reads_of_a_few_keys(store, monkeypatch):
    monkeypatch.setattr(reader, "MAX_BOUND", 2)
    intos = {}
    for key in ("a", "b", "c"):
        store.put_state_dict(_sd(), key)
        intos[key] = {k: torch.empty_like(v) for k, v in _sd().items()}
        store.get_state_dict(key, into=intos[key])
    assert testing.reads_bound(store) == 3
    store.get_state_dict("c", into=intos["c"])  # kept
    assert testing.reads_bound(store) == 3
    store.get_state_dict("a", into=intos["a"])  # the oldest, dropped for "c"
    assert testing.reads_bound(store) == 4
