"""The checksum: XXH3-128 of every byte before the trailer, as documented; the paths that
compute it agree; a corrupt file is refused as corrupt whatever torch makes of it, whether
the checksum runs before the load or beside it; an in-place rewrite is caught."""

from __future__ import annotations

import io
import os
import threading

import pytest
import torch
import xxhash
from ckpt_helpers import make_run

from k3_checkpoint import (
    CheckpointError,
    file_checksum,
    load_checkpoint,
    read_payload,
    save_checkpoint,
)
from k3_checkpoint import payload as payload_module
from k3_checkpoint.integrity import checksum_of_bytes, checksum_of_file
from k3_checkpoint.payload import TRAILER_SIZE, write_payload


def test_the_trailer_holds_the_documented_checksum(tmp_path):
    """Reproducible without this package: xxh3_128 of every byte before the 64-byte trailer,
    whose layout the payload module's docstring gives."""
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    returned = save_checkpoint(path, **run.save_kwargs())
    raw = path.read_bytes()
    zip_bytes, trailer = raw[:-TRAILER_SIZE], raw[-TRAILER_SIZE:]
    expected = xxhash.xxh3_128(zip_bytes).digest()
    assert trailer[:8] == b"\x89K3CKPT\n" and trailer[8:12] == (7).to_bytes(4, "little")
    assert trailer[12:16] == (2).to_bytes(4, "little")
    assert trailer[16:24] == len(zip_bytes).to_bytes(8, "little") and trailer[24:40] == expected
    assert returned == expected.hex()
    assert load_checkpoint(path, **run.save_kwargs()).digest == returned


@pytest.mark.parametrize(
    "pieces",
    [[1 << 30], [1], [21], [22], [23], [1, 2, 21, 22, 23, 4096, 3]],
    ids=["at-once", "bytes", "21", "22", "23", "mixed"],
)
def test_the_checksum_taken_while_writing_is_the_files_whatever_the_write_sizes(
    tmp_path, monkeypatch, pieces
):
    """The save hashes what torch.save writes as it writes it and holds the zip's end record
    back to set its comment length; however torch.save cuts its writes, the file is
    torch.save's zip with that one field set, then the trailer, and the trailer's checksum
    is the file's."""
    real_save = torch.save
    payload = {"format_version": 7, "w": torch.arange(3000.0), "s": torch.ones(3), "n": "x"}
    body = io.BytesIO()
    real_save(payload, body)
    zip_bytes = bytearray(body.getvalue())
    zip_bytes[-2:] = TRAILER_SIZE.to_bytes(2, "little")  # the comment: the trailer

    def in_pieces(obj, file, *args, **kwargs):
        data, start, turn = memoryview(body.getvalue()), 0, 0
        while start < len(data):
            size = pieces[turn % len(pieces)]
            file.write(data[start : start + size])
            start, turn = start + size, turn + 1
        file.flush()

    monkeypatch.setattr(torch, "save", in_pieces)
    path = tmp_path / "ckpt.k3"
    checksum = write_payload(path, payload)
    raw = path.read_bytes()
    assert raw[:-TRAILER_SIZE] == zip_bytes
    assert raw[-TRAILER_SIZE:] == payload_module.pack_trailer(
        7, len(zip_bytes), xxhash.xxh3_128(bytes(zip_bytes)).digest()
    )
    assert checksum == xxhash.xxh3_128(bytes(zip_bytes)).hexdigest()
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.equal(read_payload(path)["w"], payload["w"])


@pytest.mark.parametrize("size", [0, 1, (1 << 20) - 1, 1 << 20, (3 << 20) + 17])
def test_every_checksum_path_agrees(tmp_path, size):
    data = os.urandom(size)
    path = tmp_path / "blob"
    path.write_bytes(data)
    expected = xxhash.xxh3_128(data).digest()
    assert checksum_of_bytes(data) == expected
    assert file_checksum(path) == expected.hex()
    with open(path, "rb") as file:
        assert checksum_of_file(file, 0, size) == expected
        assert checksum_of_file(file, 0, size + 1) is None  # the file ends first
        if size > 10:
            assert checksum_of_file(file, 3, size - 5) == xxhash.xxh3_128(data[3:-5]).digest()
        for chunk in (4093, payload_module.OVERLAP_CHUNK):  # odd boundaries; the overlapped reads
            assert checksum_of_file(file, 0, size, chunk) == expected
            assert checksum_of_file(file, 0, size + 1, chunk) is None


@pytest.mark.parametrize(
    "payload",
    [
        {},  # no tensors at all
        {"notes": "plain state only", "step": 3, "nested": {"a": [1, 2.5, None]}},
        {"w": torch.arange(7, dtype=torch.int16), "empty": torch.zeros(0), "s": torch.tensor(2.0)},
        {"big": torch.randn(3000, 700), "view": torch.arange(100)[::3], "step": 9},
    ],
    ids=["no-tensors", "plain-only", "tiny-tensors", "large"],
)
def test_payloads_of_every_shape_round_trip(tmp_path, payload, hashing):
    path = tmp_path / "ckpt.k3"
    checksum = write_payload(path, {"format_version": 7, **payload})
    loaded, read_checksum = payload_module.read_verified(path)
    assert read_checksum == checksum
    assert set(loaded) == {"format_version", *payload}
    for key, value in payload.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value) and loaded[key].dtype == value.dtype
        else:
            assert loaded[key] == value


@pytest.fixture(params=["before-load", "beside-load"])
def hashing(request, monkeypatch):
    """Both ways ``read_verified`` checks a payload: hashed before ``torch.load`` (small
    files) or on a thread while torch parses it (large ones)."""
    overlapped = request.param == "beside-load"
    monkeypatch.setattr(payload_module, "OVERLAP_FROM", 0 if overlapped else 1 << 62)
    calls = []
    real = payload_module.checksum_of_file

    def recorded(*args):
        calls.append(threading.current_thread() is not threading.main_thread())
        return real(*args)

    monkeypatch.setattr(payload_module, "checksum_of_file", recorded)
    yield
    # Reads alone take checksums of the file (a write hashes its bytes as it writes them).
    assert calls and calls[-1] == overlapped


def _corrupt(path):
    raw = bytearray(path.read_bytes())
    raw[-200] ^= 1
    path.write_bytes(raw)


@pytest.mark.parametrize("torch_says", ["accepts", "refuses"])
def test_a_corrupt_payload_is_refused_as_corrupt_whatever_torch_makes_of_it(
    tmp_path, monkeypatch, hashing, torch_says
):
    path = tmp_path / "ckpt.k3"
    write_payload(path, {"format_version": 7, "w": torch.ones(10_000)})
    _corrupt(path)

    def load(*args, **kwargs):
        if torch_says == "refuses":
            raise RuntimeError("PytorchStreamReader failed reading zip archive")
        return {"format_version": 7, "w": torch.zeros(3)}

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_payload(path)


def test_a_small_corrupt_payload_never_reaches_torch_load(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.k3"
    write_payload(path, {"format_version": 7, "w": torch.ones(10_000)})
    _corrupt(path)
    assert path.stat().st_size < payload_module.OVERLAP_FROM
    calls = []
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: calls.append(args))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_payload(path)
    assert calls == []


def test_a_rewrite_in_place_after_the_checksum_is_refused(tmp_path, monkeypatch, hashing):
    """A writer changing the file's bytes after they were hashed (same inode, same size)
    must not be loaded as the verified file: its modification time gives it away."""
    path, other = tmp_path / "ckpt.k3", tmp_path / "other.k3"
    write_payload(path, {"format_version": 7, "w": torch.full((5000,), 1.0)})
    write_payload(other, {"format_version": 7, "w": torch.full((5000,), 2.0)})
    replacement = other.read_bytes()
    assert len(replacement) == path.stat().st_size
    real = payload_module.checksum_of_file

    def then_overwrite(*args):
        result = real(*args)
        stamp = os.stat(path).st_mtime_ns
        with open(path, "r+b") as file:
            file.write(replacement)
        os.utime(path, ns=(stamp + 1_000_000, stamp + 1_000_000))  # a coarse clock, too
        return result

    monkeypatch.setattr(payload_module, "checksum_of_file", then_overwrite)
    with pytest.raises(CheckpointError, match="changed while it was read"):
        read_payload(path)


def test_save_fails_cleanly_when_torch_save_fails_mid_write(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.k3"
    real_save = torch.save

    def failing(obj, file, *args, **kwargs):
        file.write(b"x" * 5000)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(OSError, match="No space"):
        write_payload(path, {"format_version": 7})
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(torch, "save", real_save)
    write_payload(path, {"format_version": 7, "step": 1})
    assert read_payload(path)["step"] == 1


def test_a_zip_whose_end_record_is_not_last_is_refused_by_the_save(tmp_path, monkeypatch):
    """The trailer becomes the zip's comment by patching the end record torch.save wrote
    last; a torch that wrote anything else is refused, not corrupted."""
    real_save = torch.save

    def with_a_comment(obj, file, *args, **kwargs):
        body = io.BytesIO()
        real_save(obj, body)
        data = bytearray(body.getvalue())
        data[-2:] = (3).to_bytes(2, "little")
        file.write(bytes(data) + b"abc")

    monkeypatch.setattr(torch, "save", with_a_comment)
    with pytest.raises(CheckpointError, match="end record is not last"):
        write_payload(tmp_path / "ckpt.k3", {"format_version": 7})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("change", ["inserted", "cut"])
def test_bytes_inserted_or_cut_mid_payload_are_refused_by_the_length(tmp_path, change):
    """The trailer intact (its CRC holds) but the payload longer or shorter than it says:
    refused by the trailer's length, before any hashing or unpickling."""
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    save_checkpoint(path, **run.save_kwargs())
    raw = path.read_bytes()
    middle = (len(raw) - TRAILER_SIZE) // 2
    if change == "inserted":
        edited = raw[:middle] + b"\x00" * 10 + raw[middle:]
    else:
        edited = raw[:middle] + raw[middle + 10:]
    assert edited[-TRAILER_SIZE:] == raw[-TRAILER_SIZE:]
    path.write_bytes(edited)
    with pytest.raises(CheckpointError, match="bytes were cut from or inserted"):
        read_payload(path)
    fresh = make_run(seed=1)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(CheckpointError, match="bytes were cut from or inserted"):
        load_checkpoint(path, **fresh.load_kwargs())
    assert all(torch.equal(v, before[k]) for k, v in fresh.model.state_dict().items())
