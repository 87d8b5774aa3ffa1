"""The marker's CRC32 checksums: every piece of every saved chunk is covered, a byte changed
anywhere fails the load naming the file, the key and the piece, and an intact checkpoint
loads as before."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from tidal.train.checkpoint import CheckpointError, checksum, load_model, save_model
from tidal.train.checkpoint.dcp_io import read_metadata


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(64, 100, generator=g), "small": torch.randn(7, generator=g)}


@pytest.fixture
def saved(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(checksum, "PIECE", 4096)  # `big` (25,600 bytes) spans 7 pieces
    return save_model(state(), tmp_path / "ckpt", 1, info={})


def chunk_of(path: Path, key: str):
    storage = read_metadata(path).storage_data
    return next(s for k, s in storage.items() if k.fqn == key)


def test_every_piece_of_every_chunk_has_a_checksum(saved):
    crc32 = json.loads((saved / "COMPLETE").read_text())["crc32"]
    assert crc32["piece_bytes"] == 4096
    big = chunk_of(saved, "big")
    crcs = crc32["files"][big.relative_path][str(big.offset)]
    assert len(crcs) == -(-big.length // 4096) >= 7
    out = {k: torch.zeros_like(v) for k, v in state().items()}
    load_model(out, saved)
    assert all(torch.equal(out[k], v) for k, v in state().items())


def test_a_changed_byte_names_the_file_key_and_piece(saved):
    big = chunk_of(saved, "big")
    data = saved / big.relative_path
    offset = big.offset + 2 * 4096 + 100  # inside piece 2 of the chunk
    raw = bytearray(data.read_bytes())
    raw[offset] ^= 1
    data.write_bytes(bytes(raw))
    out = {k: torch.zeros_like(v) for k, v in state().items()}
    with pytest.raises(
        CheckpointError,
        match=rf"{data} \(key big\): bytes 8,192\.\.12,288 "
        r"of the chunk fail their checksum",
    ):
        load_model(out, saved)


def _verify_pieces(folder: Path) -> None:
    data = bytes(range(256)) * 64
    (folder / "data").write_bytes(data)
    crcs = [zlib.crc32(data[o : o + 4096]) for o in range(0, len(data), 4096)]
    sums = {"piece_bytes": 4096, "files": {"data": {"0": crcs}}}
    checksum.verify(folder, sums, [("data", 0, len(data), "x")])


def test_a_forked_child_checks_with_threads_of_its_own(tmp_path):
    """The hashing threads do not survive a fork: a child that inherited the pool would wait
    on them forever (RL roles and data workers fork after a load)."""
    import multiprocessing as mp

    _verify_pieces(tmp_path)  # the pool exists here, its threads idle
    child = mp.get_context("fork").Process(target=_verify_pieces, args=(tmp_path,))
    child.start()
    child.join(timeout=60)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0


def test_the_writer_process_hashes_pieces_as_it_writes(tmp_path):
    """writer_child's HashingStream gives the checksums that reading the file back gives, for
    chunks smaller than a piece, spanning several, and written in uneven calls."""
    from tidal.train.checkpoint.writer_child import HashingStream

    g = torch.Generator().manual_seed(0)
    writes = [
        [b"x" * 10],
        [bytes(1000)],
        [torch.randn(700, generator=g).numpy().tobytes()],
        [b"a" * 300, b"b" * 900, b"c" * 2500, b"d"],
    ]
    path = tmp_path / "data"
    spans = []
    with open(path, "wb") as raw:
        stream = HashingStream(raw, piece=1000)
        for chunk in writes:
            stream.begin()
            start = stream.tell()
            for w in chunk:
                stream.write(w)
            spans.append((start, stream.tell() - start, stream.crcs))
    for start, length, crcs in spans:
        chunk = path.read_bytes()[start : start + length]
        want = [zlib.crc32(chunk[o : o + 1000]) for o in range(0, length, 1000)]  # its pieces
        assert crcs == want, (start, length)
