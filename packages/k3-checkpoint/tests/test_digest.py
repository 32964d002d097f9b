"""The block digest: the parallel file reader, the serial reference and the formula agree."""

from __future__ import annotations

import hashlib
import random

import pytest
from ckpt_helpers import make_run

from k3_checkpoint import CheckpointError, read_payload, save_checkpoint
from k3_checkpoint import digest as digest_module
from k3_checkpoint.digest import digest_of_bytes, digest_of_file
from k3_checkpoint.payload import HEADER_SIZE


def _formula(data: bytes, block: int) -> bytes:
    """The scheme as the README states it, written out independently."""
    hashes = [hashlib.sha256(data[i : i + block]).digest() for i in range(0, len(data), block)]
    return hashlib.sha256(b"".join(hashes)).digest()


@pytest.mark.parametrize("threads", [1, 3])
def test_file_digest_matches_the_formula_at_every_block_boundary(tmp_path, monkeypatch, threads):
    block = 64
    monkeypatch.setattr(digest_module, "BLOCK", block)
    monkeypatch.setattr(digest_module, "_threads", lambda: threads)
    generator = random.Random(threads)
    stored = tmp_path / "data"
    for length in [1, block - 1, block, block + 1, 5 * block, 5 * block + 17]:
        data = generator.randbytes(length)
        expected = _formula(data, block)
        assert digest_of_bytes(data) == expected
        stored.write_bytes(b"xy" + data + b"z")  # the digest covers exactly [offset, +length)
        with open(stored, "rb") as file:
            assert digest_of_file(file, 2, length) == expected
        flipped = bytearray(data)
        flipped[-1] ^= 1
        assert digest_of_bytes(bytes(flipped)) != expected


def test_checkpoint_header_holds_the_documented_digest(tmp_path):
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    returned = save_checkpoint(path, **run.save_kwargs())
    raw = path.read_bytes()
    expected = _formula(raw[HEADER_SIZE:], 4 << 20)
    assert raw[24:56] == expected
    assert returned == expected.hex()


def test_multi_block_checkpoints_round_trip_on_several_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(digest_module, "BLOCK", 1000)  # a small checkpoint spans many blocks
    monkeypatch.setattr(digest_module, "_threads", lambda: 4)
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    save_checkpoint(path, **run.save_kwargs())
    raw = path.read_bytes()
    assert len(raw) > 10 * 1000
    assert raw[24:56] == _formula(raw[HEADER_SIZE:], 1000)
    assert read_payload(path)["counters"]["step"] == 1
    corrupt = bytearray(raw)
    corrupt[len(raw) // 2] ^= 4  # one block among many
    path.write_bytes(corrupt)
    with pytest.raises(CheckpointError, match="digest mismatch"):
        read_payload(path)


def test_a_file_that_shrinks_while_read_is_refused(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"short")
    with open(short, "rb") as file, pytest.raises(CheckpointError, match="changed while read"):
        digest_of_file(file, 0, 100)
