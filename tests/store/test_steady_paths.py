"""A steady writer's puts and a steady reader's gets skip the per-tensor fingerprint, checks
and job building (tidal/store/writer.py ``Writer._last``, tidal/store/reader.py
``BoundRead``), and anything that could make a kept put or read wrong makes it check again."""

from __future__ import annotations

import pytest
import torch

from tidal.store import reader, testing, writer


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


def test_a_steady_writer_copies_the_current_bytes_every_time(store):
    sd = _sd()
    into = {k: torch.empty_like(v) for k, v in sd.items()}
    for step in range(5):  # the same tensor objects, rewritten in place (an optimizer step)
        for t in sd.values():
            t.fill_(float(step))
        store.put_state_dict(sd, "m")
        store.get_state_dict("m", into=into)
        assert all(torch.equal(into[k], sd[k]) for k in sd), step
    assert store.plans_declared == 1


def test_a_writers_changed_tensors_are_put_as_they_are_now(store):
    sd = _sd(1)
    store.put_state_dict(sd, "m")
    store.put_state_dict(sd, "m")  # kept from here on
    # Memory replaced under the same object: the new memory's bytes are stored.
    sd["l2.w"].data = torch.full((8, 4), 7.0)
    store.put_state_dict(sd, "m")
    assert torch.equal(store.get_state_dict("m")["l2.w"], torch.full((8, 4), 7.0))
    # The same tensors under swapped names: each name stores its own tensor.
    swapped = dict(sd)
    swapped["l0.w"], swapped["l1.w"] = sd["l1.w"], sd["l0.w"]
    store.put_state_dict(swapped, "m")
    got = store.get_state_dict("m")
    assert torch.equal(got["l0.w"], sd["l1.w"]) and torch.equal(got["l1.w"], sd["l0.w"])
    # A tensor given another shape in place: a new layout is declared, not the kept one.
    declared = store.plans_declared
    sd["l3.w"].set_(torch.full((16, 4), 3.0))
    store.put_state_dict(sd, "m")
    assert store.plans_declared == declared + 1
    assert torch.equal(store.get_state_dict("m")["l3.w"], torch.full((16, 4), 3.0))


def test_a_handle_remembers_the_tensors_of_a_few_keys(store, monkeypatch):
    monkeypatch.setattr(writer, "MAX_LAST", 2)
    sds = {key: _sd() for key in ("a", "b", "c")}
    for _ in range(2):
        for key, sd in sds.items():
            store.put_state_dict(sd, key)
    for key, sd in sds.items():  # each key's tensors changed in place: still read right
        sd["l0.w"].fill_(9.0)
        store.put_state_dict(sd, key)
        assert torch.equal(store.get_state_dict(key)["l0.w"], torch.full((8, 4), 9.0))


def test_sparse_tensors_are_refused_clearly_also_after_kept_puts_and_reads(store):
    sd = _sd()
    into = {k: torch.empty_like(v) for k, v in sd.items()}
    for _ in range(2):  # kept from here on
        store.put_state_dict(sd, "m")
        store.get_state_dict("m", into=into)
    sparse = torch.eye(8, 4).to_sparse()
    with pytest.raises(TypeError, match="l0.w is a torch.sparse_coo tensor; tidal.store holds"):
        store.put_state_dict({**sd, "l0.w": sparse}, "m")
    with pytest.raises(TypeError, match="l0.w is a torch.sparse_coo tensor"):
        store.get_state_dict("m", into={**into, "l0.w": sparse})
    with pytest.raises(TypeError, match="the tensor is a torch.sparse_coo tensor"):
        store.put("w", sparse)
    assert store.versions("m") == [0, 1] and "w" not in store.keys()
