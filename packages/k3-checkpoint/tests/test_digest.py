"""The block digest: the trailing writer, the in-memory reader and the formula agree; the
loader unpickles the very bytes it verified."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import time
import warnings

import pytest
import torch
from ckpt_helpers import eventually, make_run

from k3_checkpoint import CheckpointError, load_checkpoint, read_payload, save_checkpoint
from k3_checkpoint import digest as digest_module
from k3_checkpoint import payload as payload_module
from k3_checkpoint.buffer import PayloadBuffer
from k3_checkpoint.digest import (
    StreamDigest,
    TrailingHasher,
    digest_of_bytes,
    digest_of_view,
    read_and_digest,
)
from k3_checkpoint.payload import HEADER_SIZE, write_payload


def _formula(data: bytes, block: int) -> bytes:
    """The scheme as the README states it, written out independently."""
    hashes = [hashlib.sha256(data[i : i + block]).digest() for i in range(0, len(data), block)]
    return hashlib.sha256(b"".join(hashes)).digest()


@pytest.mark.parametrize(("threads", "chunk"), [(1, 16), (3, 16), (3, 64)])
def test_every_digest_path_matches_the_formula(monkeypatch, tmp_path, threads, chunk):
    block = 64
    monkeypatch.setattr(digest_module, "BLOCK", block)
    monkeypatch.setattr(digest_module, "CHUNK", chunk)  # blocks hashed in 4 pieces, or whole
    monkeypatch.setattr(digest_module, "_threads", lambda: threads)
    generator = random.Random(threads)
    for length in [0, 1, block - 1, block, block + 1, 5 * block, 5 * block + 17, 300 * block]:
        data = generator.randbytes(length)
        expected = _formula(data, block)
        assert digest_of_bytes(data) == expected
        assert digest_of_view(data) == expected
        # Writes of every size, across and along block boundaries, after a 64-byte header.
        for sizes in ([length], [1] * length, [block - 1, 2 * block + 3, 1, block], [3, block]):
            path = tmp_path / "trailing"
            with open(path, "w+b") as file:
                file.write(b"h" * HEADER_SIZE)
                with TrailingHasher(file, HEADER_SIZE) as writer:
                    position = 0
                    for size in sizes * (length + 1):
                        if position >= length:
                            break
                        writer.write(bytearray(data[position : position + size]))
                        position += size
                    writer.write(data[position:])
                    assert writer.finish() == expected and writer.length == length
            assert path.read_bytes() == b"h" * HEADER_SIZE + data
        source = tmp_path / "source"
        source.write_bytes(b"h" * HEADER_SIZE + data)
        with open(source, "rb") as file:
            file.seek(HEADER_SIZE)
            into = bytearray(length)
            assert read_and_digest(file, memoryview(into)) == expected and into == data
            file.seek(HEADER_SIZE + 1)  # one byte short
            short = read_and_digest(file, memoryview(bytearray(length)))
            assert short == (b"" if length else expected)
        flipped = bytearray(data or b"x")
        flipped[-1] ^= 1
        assert digest_of_bytes(bytes(flipped)) != _formula(data or b"x", block)


def test_each_block_is_hashed_behind_its_producer_a_chunk_or_more_at_a_time(monkeypatch):
    """The hash keeps up with the bytes as they appear, so a one-block checkpoint does not
    pay for its read and then its hash; bytes that are there are hashed in one call."""
    monkeypatch.setattr(digest_module, "BLOCK", 64)
    monkeypatch.setattr(digest_module, "CHUNK", 16)
    data = random.Random(0).randbytes(100)
    fed: list[tuple[int, int]] = []

    def update(hasher, start, stop):
        fed.append((start, stop))
        hasher.update(data[start:stop])

    with StreamDigest(update) as stream:
        stream.advance(10)  # less than a chunk: the worker waits for more
        time.sleep(0.05)
        assert fed == []
        stream.advance(40)  # two and a half chunks of the first block, hashed in one call
        assert eventually(lambda: fed == [(0, 40)]), fed
        time.sleep(0.05)
        assert fed == [(0, 40)]  # never past the bytes that exist
        stream.advance(100)
        assert stream.digest() == _formula(data, 64)
    assert sorted(fed) == [(0, 40), (40, 64), (64, 100)]


def test_a_producer_that_fails_leaves_no_worker_waiting(monkeypatch):
    monkeypatch.setattr(digest_module, "_threads", lambda: 1)  # a stuck worker would stall all
    monkeypatch.setattr(digest_module, "CHUNK", 4)
    fed: list[int] = []
    with (
        pytest.raises(OSError),
        StreamDigest(lambda hasher, start, stop: fed.append(stop)) as stream,
    ):
        stream.advance(10)
        assert eventually(lambda: fed == [10])  # the worker now waits for byte 14
        raise OSError("the read failed")
    assert eventually(lambda: stream.pending() == 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_hashes_on_threads_of_its_own(monkeypatch):
    """The hashing threads are started once per process; a child forked after they started
    inherits the pool but not its threads, and must not wait on them."""
    monkeypatch.setattr(digest_module, "BLOCK", 64)
    monkeypatch.setattr(digest_module, "_threads", lambda: 2)
    data = random.Random(1).randbytes(1000)
    expected = _formula(data, 64)
    assert digest_of_view(data) == expected  # the parent's threads now exist
    with warnings.catch_warnings():  # Python 3.12+ warns on forking a threaded process
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:  # pragma: no cover (runs in the child)
        os._exit(0 if digest_of_view(data) == expected else 1)
    statuses: list[int] = []

    def finished() -> bool:
        pid, status = os.waitpid(child, os.WNOHANG)
        statuses.append(status)
        return pid != 0

    if not eventually(finished, 60):
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        pytest.fail("the forked child never finished hashing")
    assert os.waitstatus_to_exitcode(statuses[-1]) == 0


def test_checkpoint_header_holds_the_documented_digest(tmp_path):
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    returned = save_checkpoint(path, **run.save_kwargs())
    raw = path.read_bytes()
    expected = _formula(raw[HEADER_SIZE:], 4 << 20)
    assert raw[24:56] == expected
    assert returned == expected.hex()
    assert load_checkpoint(path, **run.save_kwargs()).digest == returned


@pytest.mark.parametrize(
    "payload",
    [
        {},  # no tensors at all
        {"notes": "plain state only", "step": 3, "nested": {"a": [1, 2.5, None]}},
        {"w": torch.arange(7, dtype=torch.int16), "empty": torch.zeros(0), "s": torch.tensor(2.0)},
        {"big": torch.randn(3000, 700), "view": torch.arange(100)[::3], "step": 9},
    ],
    ids=["no-tensors", "plain-only", "tiny-tensors", "multi-block"],
)
def test_payloads_of_every_shape_round_trip(tmp_path, monkeypatch, payload):
    monkeypatch.setattr(digest_module, "BLOCK", 4096)  # "multi-block" spans ~2000 blocks
    monkeypatch.setattr(digest_module, "_threads", lambda: 3)
    path = tmp_path / "ckpt.k3"
    digest = write_payload(path, {"format_version": 7, **payload})
    raw = path.read_bytes()
    assert digest == _formula(raw[HEADER_SIZE:], 4096).hex()
    loaded, read_digest, _ = payload_module.read_verified(path)
    assert read_digest == digest
    assert set(loaded) == {"format_version", *payload}
    for key, value in payload.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value) and loaded[key].dtype == value.dtype
        else:
            assert loaded[key] == value


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
    for position in (HEADER_SIZE + 5, len(raw) // 2, len(raw) - 1):  # first, middle, last block
        corrupt = bytearray(raw)
        corrupt[position] ^= 4
        path.write_bytes(corrupt)
        with pytest.raises(CheckpointError, match="digest mismatch"):
            read_payload(path)


def test_corrupt_payloads_never_reach_torch_load(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.k3"
    write_payload(path, {"format_version": 7, "w": torch.ones(10_000)})
    raw = bytearray(path.read_bytes())
    raw[-200] ^= 1
    path.write_bytes(raw)
    calls = []
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: calls.append(args))
    monkeypatch.setattr(PayloadBuffer, "unpickle", lambda *args: calls.append(args))
    with pytest.raises(CheckpointError, match="digest mismatch"):
        read_payload(path)
    assert calls == []


def test_the_loader_unpickles_the_bytes_it_verified_not_the_file(tmp_path, monkeypatch):
    """A writer changing the file after it was hashed (same size, valid torch zip) must not
    reach torch.load: the loader unpickles only the bytes it verified."""
    path, other = tmp_path / "ckpt.k3", tmp_path / "other.k3"
    write_payload(path, {"format_version": 7, "w": torch.full((5000,), 1.0)})
    write_payload(other, {"format_version": 7, "w": torch.full((5000,), 2.0)})
    replacement = other.read_bytes()[HEADER_SIZE:]
    assert len(replacement) == path.stat().st_size - HEADER_SIZE

    def overwrite_payload() -> None:
        with open(path, "r+b") as file:
            file.seek(HEADER_SIZE)
            file.write(replacement)

    real = payload_module.read_and_digest

    def then_overwrite(*args):
        result = real(*args)
        overwrite_payload()
        return result

    monkeypatch.setattr(payload_module, "read_and_digest", then_overwrite)
    loaded = read_payload(path)
    assert torch.equal(loaded["w"], torch.full((5000,), 1.0))


def test_save_fails_cleanly_when_torch_save_fails_mid_write(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.k3"
    real_save = torch.save

    def failing(obj, file, *args, **kwargs):
        file.write(b"x" * 5000)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(digest_module, "BLOCK", 1000)
    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(OSError, match="No space"):
        write_payload(path, {"format_version": 7})
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(torch, "save", real_save)
    write_payload(path, {"format_version": 7, "step": 1})
    assert read_payload(path)["step"] == 1
