"""The batched device copier's choices, on any machine: no driver call, a failing one."""

import warnings

import pytest

from tidal.store.transports.cuda.batch import Batch, BatchCopier


def test_without_a_batched_call_every_pair_goes_through_the_loop():
    calls = []
    copier = BatchCopier(None, lambda pairs, stream: calls.append((pairs, stream)))
    assert not copier.batching
    pairs = [(16, 32, 8), (48, 64, 8)]
    prepared = copier.prepare(pairs, 0)
    assert prepared is pairs
    copier.run(prepared, 7)
    assert calls == [(pairs, 7)] and copier.batches == 0


def test_a_failing_batch_falls_back_to_the_loop_once_and_for_good():
    calls = []
    tried = []
    copier = BatchCopier(
        None,
        lambda pairs, stream: calls.append((pairs, stream)),
        call=lambda batch, stream: tried.append(batch.count) or 1,  # CUDA_ERROR_INVALID_VALUE
    )
    pairs = [(16, 32, 8), (48, 64, 24), (80, 96, 4)]
    prepared = copier.prepare(pairs, 0)
    assert isinstance(prepared, Batch) and list(prepared.sizes) == [8, 24, 4]
    assert list(prepared.dsts) == [16, 48, 80] and list(prepared.srcs) == [32, 64, 96]
    with pytest.warns(RuntimeWarning, match="cuMemcpyBatchAsync failed"):
        copier.run(prepared, 3)
    assert tried == [3] and calls == [(pairs, 3)]
    assert not copier.batching  # later plans are prepared for the loop
    assert copier.prepare(pairs, 0) is pairs


def test_one_pair_needs_no_batch():
    copier = BatchCopier(None, lambda pairs, stream: None, call=lambda batch, stream: 0)
    pairs = [(16, 32, 8)]
    assert copier.prepare(pairs, 0) is pairs
    batch = copier.prepare(pairs * 2, 0)
    copier.run(batch, 5)
    assert copier.batches == 1


def test_the_legacy_default_stream_is_refused_before_the_driver_sees_it():
    copier = BatchCopier(None, lambda pairs, stream: None, call=lambda batch, stream: 0)
    with pytest.raises(ValueError, match="legacy default stream"):
        copier.run(copier.prepare([(16, 32, 8)] * 2, 0), 0)


def test_a_batch_prepared_before_a_failure_goes_through_the_loop_without_a_second_warning():
    calls = []
    copier = BatchCopier(None, lambda pairs, stream: calls.append(pairs), call=lambda b, s: 1)
    first, second = copier.prepare([(16, 32, 8)] * 2, 0), copier.prepare([(48, 64, 8)] * 3, 0)
    with pytest.warns(RuntimeWarning):
        copier.run(first, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copier.run(second, 3)
    assert calls == [first.pairs, second.pairs]


def test_gather_rows_cut_copies_into_chunks_of_words():
    from tidal.store.transports.cuda.gather import CHUNK_BYTES, chunk_rows, word_aligned

    rows = chunk_rows([(1 << 32, 1 << 33, 2 * CHUNK_BYTES + 8), (4096, 8192, 12)])
    assert rows == [
        (1 << 32, 1 << 33, CHUNK_BYTES // 4),
        ((1 << 32) + CHUNK_BYTES, (1 << 33) + CHUNK_BYTES, CHUNK_BYTES // 4),
        ((1 << 32) + 2 * CHUNK_BYTES, (1 << 33) + 2 * CHUNK_BYTES, 2),
        (4096, 8192, 3),
    ]
    assert not word_aligned((4096, 8194, 8)) and not word_aligned((4096, 8192, 6))


def test_gather_copier_leaves_single_pairs_and_a_failed_kernel_to_the_batch_copier():
    from tidal.store.transports.cuda.gather import GatherCopier

    calls = []
    gather = GatherCopier(BatchCopier(None, lambda pairs, stream: calls.append(pairs)))
    one = [(16, 32, 8)]
    gather.run(gather.prepare(one, 0), 3)
    gather.failed = True
    two = [(16, 32, 8), (48, 64, 8)]
    gather.run(gather.prepare(two, 0), 3)
    assert calls == [one, two] and gather.launches == 0
