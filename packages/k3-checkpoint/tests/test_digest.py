"""The block digest: the streaming writer, the parallel reader, the reference and the formula
agree."""

from __future__ import annotations

import hashlib
import io
import random

import pytest
from ckpt_helpers import make_run

from k3_checkpoint import CheckpointError, read_payload, save_checkpoint
from k3_checkpoint import digest as digest_module
from k3_checkpoint.digest import HashingWriter, digest_of_bytes, digest_of_view
from k3_checkpoint.payload import HEADER_SIZE


def _formula(data: bytes, block: int) -> bytes:
    """The scheme as the README states it, written out independently."""
    hashes = [hashlib.sha256(data[i : i + block]).digest() for i in range(0, len(data), block)]
    return hashlib.sha256(b"".join(hashes)).digest()


@pytest.mark.parametrize("threads", [1, 3])
def test_parallel_and_streaming_digests_match_the_formula(monkeypatch, threads):
    block = 64
    monkeypatch.setattr(digest_module, "BLOCK", block)
    monkeypatch.setattr(digest_module, "_threads", lambda: threads)
    generator = random.Random(threads)
    for length in [0, 1, block - 1, block, block + 1, 5 * block, 5 * block + 17]:
        data = generator.randbytes(length)
        expected = _formula(data, block)
        assert digest_of_bytes(data) == expected
        assert digest_of_view(data) == expected
        # Writes of every size, across and along block boundaries, in any mix.
        for sizes in ([length], [1] * length, [block - 1, 2 * block + 3, 1, block], [3, block]):
            sink = io.BytesIO()
            with HashingWriter(sink) as writer:
                position = 0
                for size in sizes * (length + 1):
                    if position >= length:
                        break
                    writer.write(bytearray(data[position : position + size]))
                    position += size
                writer.write(data[position:])
                assert writer.digest() == expected and writer.length == length
            assert sink.getvalue() == data
        flipped = bytearray(data or b"x")
        flipped[-1] ^= 1
        assert digest_of_bytes(bytes(flipped)) != _formula(data or b"x", block)


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
