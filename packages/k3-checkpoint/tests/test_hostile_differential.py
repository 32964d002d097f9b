"""Hostile files against torch's own judgement: whatever ``torch.load(weights_only=True)``
refuses under the installed torch, ``load_checkpoint`` refuses too (with a
``CheckpointError``), and it also refuses what the format's own checks catch. A refused file
changes nothing; an accepted one restores exactly the state that was saved.

Each case is a torch zip a forger built (a pickle written by hand, or torch's own file with
a member rewritten), given a correct trailer and checksum, so only the loading can refuse
it. The verdicts are torch's, asked at test time, never hard-coded: when a torch release
starts refusing something (as 2.14 did for out-of-range sparse indices), this test follows.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from ckpt_helpers import assert_same_payload, envelope, make_run, run_fingerprint

from k3_checkpoint import CheckpointError, load_checkpoint, read_payload, save_checkpoint
from k3_checkpoint.payload import TRAILER_SIZE


class _Runs:
    """Unpickling this calls ``open(target, "w")``: a file appears if the pickle runs code."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (str(self.target), "w"))


def _rewritten(payload: object, member: str, change: Callable[[bytes], bytes]) -> bytes:
    """torch.save's zip of ``payload`` with one member's bytes changed."""
    source = io.BytesIO()
    torch.save(payload, source)
    out = io.BytesIO()
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith(member):
                data = change(data)
            zout.writestr(info, data)
    return out.getvalue()


def _sparse(indices: list[list[int]], size: tuple[int, ...]) -> torch.Tensor:
    values = torch.ones(len(indices[0]))
    return torch.sparse_coo_tensor(torch.tensor(indices), values, size, check_invariants=False)


CASES: dict[str, Callable[[Path, Path], bytes]] = {}
FORMAT_REFUSES: set[str] = set()
"""Cases the format's own checks refuse whatever torch says of them."""


def case(name: str, *, format_refuses: bool = False):
    def register(build: Callable[[Path, Path], bytes]):
        CASES[name] = build
        if format_refuses:
            FORMAT_REFUSES.add(name)
        return build
    return register


@case("global-that-runs-code")
def _global(checkpoint: Path, marker: Path) -> bytes:
    payload = read_payload(checkpoint)
    payload["model"] = _Runs(marker)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


@case("sparse-index-out-of-range", format_refuses=True)  # sparse where dense was saved
def _sparse_out_of_range(checkpoint: Path, marker: Path) -> bytes:
    payload = read_payload(checkpoint)
    payload["model"] = {**payload["model"], "head.weight": _sparse([[0, 99], [0, 1]], (4, 4))}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


@case("truncated-zip")
def _truncated(checkpoint: Path, marker: Path) -> bytes:
    data = checkpoint.read_bytes()[:-TRAILER_SIZE]
    cut = bytearray(data[: len(data) // 2])
    return bytes(cut) + _end_record()


@case("corrupted-central-directory")
def _corrupt_directory(checkpoint: Path, marker: Path) -> bytes:
    data = bytearray(checkpoint.read_bytes()[:-TRAILER_SIZE])
    data[-22 + 16 : -22 + 20] = (len(data) + 4096).to_bytes(4, "little")  # directory offset
    data[-2:] = b"\0\0"
    return bytes(data)


@case("wrong-byte-order")
def _byte_order(checkpoint: Path, marker: Path) -> bytes:
    return _rewritten(read_payload(checkpoint), "byteorder", lambda _: b"middle")


@case("storage-larger-than-its-data")
def _storage_size(checkpoint: Path, marker: Path) -> bytes:
    def shrink(data: bytes) -> bytes:
        return data[: len(data) // 2]
    return _rewritten(read_payload(checkpoint), "data/0", shrink)


@case("storage-offset-out-of-range")
def _storage_offset(checkpoint: Path, marker: Path) -> bytes:
    payload = read_payload(checkpoint)
    weight = payload["model"]["head.weight"]
    storage = torch.zeros(weight.numel() + 77)
    storage[77:] = weight.flatten()
    payload["model"] = {**payload["model"], "head.weight": storage[77:].view(weight.shape)}

    def move_offset(data: bytes) -> bytes:  # the pickled offset 77 (BININT1 "M") -> 65535
        assert data.count(b"KM") == 1
        return data.replace(b"KM", b"M\xff\xff")
    return _rewritten(payload, "data.pkl", move_offset)


@case("unknown-storage-type")
def _storage_type(checkpoint: Path, marker: Path) -> bytes:
    def retype(data: bytes) -> bytes:  # GLOBAL "torch FloatStorage" -> "torch Module"
        assert b"\nFloatStorage\n" in data
        return data.replace(b"\nFloatStorage\n", b"\nModule\n", 1)
    return _rewritten(read_payload(checkpoint), "data.pkl", retype)


@case("pickle-not-a-dict", format_refuses=True)
def _not_a_dict(checkpoint: Path, marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save([read_payload(checkpoint)], buffer)
    return buffer.getvalue()


@case("raw-pickle-in-a-zip")
def _raw_pickle(checkpoint: Path, marker: Path) -> bytes:
    return _rewritten(read_payload(checkpoint), "data.pkl",
                      lambda _: pickle.dumps({"format_version": 7, "x": _Runs(marker)}))


def _end_record() -> bytes:
    """An empty zip's end record: what a cut-and-patched file ends with."""
    return b"PK\x05\x06" + bytes(18)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "valid.k3"
    run = make_run()
    run.step()
    save_checkpoint(path, **run.save_kwargs())
    return path


def _torch_refuses(zip_path: Path) -> bool:
    try:
        torch.load(zip_path, weights_only=True, map_location="cpu")
    except Exception:  # torch's refusals: UnpicklingError, RuntimeError, ValueError, ...
        return True
    return False


@pytest.mark.parametrize("name", sorted(CASES))
def test_what_torch_refuses_load_checkpoint_refuses_and_nothing_changes(name, checkpoint,
                                                                         tmp_path):
    marker = tmp_path / "ran"
    zip_bytes = CASES[name](checkpoint, marker)
    bare = tmp_path / "bare.pt"
    bare.write_bytes(zip_bytes)
    torch_refuses = _torch_refuses(bare)
    assert not marker.exists(), "torch's weights-only load ran code"
    hostile = tmp_path / "hostile.k3"
    hostile.write_bytes(envelope(zip_bytes))

    run = make_run()
    run.step()
    before = run_fingerprint(run)
    try:
        load_checkpoint(hostile, **run.load_kwargs())
        refused = None
    except CheckpointError as error:
        refused = error
    assert not marker.exists(), f"{name}: loading ran code"
    # The run already holds the saved state: refused, nothing may change; accepted, the
    # restore must give back exactly that state (not, e.g., a storage padded with whatever
    # memory held).
    verdict = "refused" if refused is not None else "accepted"
    assert run_fingerprint(run) == before, f"{name}: {verdict}, but the run's state changed"
    if torch_refuses or name in FORMAT_REFUSES:
        assert refused is not None, f"{name}: accepted (torch.load refuses it: {torch_refuses})"
        assert str(hostile) in str(refused)
    elif refused is None:  # accepted: then exactly what torch reads, nothing else
        assert_same_payload(read_payload(hostile), torch.load(bare, weights_only=True))


def test_a_mapped_load_does_not_check_a_storage_against_its_record(checkpoint, tmp_path):
    """Why ``load_checkpoint`` does not pass ``mmap=True`` (README, ``_load_checked``): the
    mapped load takes a storage whose zip record is shorter than the pickle says, and would
    read the bytes after the record as its data, where the copying load refuses the file.
    If this fails, the installed torch checks mapped storages too, and that reason is gone."""
    bare = tmp_path / "bare.pt"
    bare.write_bytes(CASES["storage-larger-than-its-data"](checkpoint, tmp_path / "ran"))

    assert _torch_refuses(bare)
    torch.load(bare, weights_only=True, map_location="cpu", mmap=True)  # no data touched
