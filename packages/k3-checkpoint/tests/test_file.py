"""The file: formats, integrity, hostile input, atomic writes and what a save refuses."""

from __future__ import annotations

import collections
import errno
import io
import os
import pickle
import pickletools
import stat
import subprocess
import sys
import textwrap
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_helpers import (
    assert_same_payload,
    eventually,
    make_run,
    run_fingerprint,
    write_enveloped,
)

from k3_checkpoint import (
    CheckpointError,
    fsync_directory,
    load_checkpoint,
    read_payload,
    save_checkpoint,
)
from k3_checkpoint import buffer as buffer_module
from k3_checkpoint import payload as payload_module
from k3_checkpoint.payload import HEADER_SIZE


@pytest.fixture(scope="module")
def checkpoint_bytes(tmp_path_factory) -> bytes:
    """A small, valid checkpoint's bytes, for corrupting copies of it."""
    path = tmp_path_factory.mktemp("valid") / "ckpt.k3"
    run = make_run()
    run.step()
    save_checkpoint(path, **run.save_kwargs())
    return path.read_bytes()


# -- formats -----------------------------------------------------------------------------


@pytest.mark.parametrize("version", [3, 4, 5, 6])
def test_historical_formats_are_refused_by_name(version, tmp_path):
    bare = tmp_path / "bare.pt"  # what the earlier trainer wrote: a plain torch.save
    torch.save({"format_version": version, "model": {"w": torch.zeros(2)}, "step": 9}, bare)
    enveloped = tmp_path / "enveloped.k3"
    write_enveloped({"format_version": version}, enveloped, format_version=version)
    for path in (bare, enveloped):
        with pytest.raises(CheckpointError, match=f"historical recipe format {version} is not"):
            read_payload(path)


@pytest.mark.parametrize("version", [1, 2, 8, 70])
def test_unknown_formats_are_refused(version, tmp_path):
    bare = tmp_path / "bare.pt"
    torch.save({"format_version": version}, bare)
    enveloped = tmp_path / "enveloped.k3"
    write_enveloped({"format_version": version}, enveloped, format_version=version)
    for path in (bare, enveloped):
        with pytest.raises(CheckpointError, match=f"unknown checkpoint format {version}"):
            read_payload(path)


def test_payload_version_must_agree_with_the_header(tmp_path):
    path = tmp_path / "ckpt.k3"
    write_enveloped({"format_version": 6}, path, format_version=7)
    with pytest.raises(CheckpointError, match="payload format_version 6 disagrees"):
        read_payload(path)


def test_bare_format_7_payload_is_refused_as_unverifiable(tmp_path, checkpoint_bytes):
    path = tmp_path / "ckpt.k3"
    path.write_bytes(checkpoint_bytes)
    bare = tmp_path / "bare.pt"
    torch.save(read_payload(path), bare)
    with pytest.raises(CheckpointError, match="bare format-7 payload without the k3-checkpoint"):
        read_payload(bare)


# -- integrity ---------------------------------------------------------------------------


def test_single_bit_flips_are_detected_anywhere(tmp_path, checkpoint_bytes):
    # Every header byte, the zip's local headers and pickle at the start of the payload, its
    # central directory at the end, and every 29th byte between: a different bit each time.
    path = tmp_path / "flipped.k3"
    size = len(checkpoint_bytes)
    ends = set(range(HEADER_SIZE + 512)) | set(range(size - 512, size))
    for position in sorted(ends | set(range(0, size, 29))):
        corrupt = bytearray(checkpoint_bytes)
        corrupt[position] ^= 1 << (position % 8)
        path.write_bytes(corrupt)
        with pytest.raises(CheckpointError) as raised:
            read_payload(path)
        assert str(path) in str(raised.value)


def test_truncation_is_detected_at_every_cut(tmp_path, checkpoint_bytes):
    path = tmp_path / "cut.k3"
    cuts = [1, 7, 8, 40, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1]
    cuts += [*range(HEADER_SIZE + 2, len(checkpoint_bytes), 97), len(checkpoint_bytes) - 1]
    for cut in cuts:
        path.write_bytes(checkpoint_bytes[:cut])
        with pytest.raises(CheckpointError, match="truncated"):
            read_payload(path)


def test_appended_bytes_are_detected(tmp_path, checkpoint_bytes):
    path = tmp_path / "long.k3"
    path.write_bytes(checkpoint_bytes + b"\0")
    with pytest.raises(CheckpointError, match="1 unexpected bytes after the payload"):
        read_payload(path)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "is empty"),
        (b"step: 100\nmodel: weights.bin\n", "is not a k3 checkpoint"),
        (bytes(range(256)) * 4, "is not a k3 checkpoint"),
        (bytes(HEADER_SIZE) + b"PK\x03\x04partial", "interrupted before it finished"),
    ],
    ids=["empty", "text", "random", "unfinished-tmp"],
)
def test_non_checkpoints_are_refused(tmp_path, content, match):
    path = tmp_path / "file"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=match):
        read_payload(path)


def test_other_files_are_refused(tmp_path):
    npy = tmp_path / "array.npy"
    np.save(npy, np.arange(4))
    torch_file = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2)}, torch_file)
    cases = [
        (npy, "is not a k3 checkpoint"),
        (torch_file, "torch file but not a k3 checkpoint"),
        (tmp_path, "cannot be read"),
        (tmp_path / "missing.k3", "cannot be read: No such file"),
    ]
    for path, match in cases:
        with pytest.raises(CheckpointError, match=match):
            read_payload(path)


# -- hostile input -----------------------------------------------------------------------


class _CreatesFile:
    """Unpickling this calls open(target, "w"): a file appears if the pickle runs code."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (str(self.target), "w"))


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "torch.load"])
def test_malicious_pickles_never_run(tmp_path, monkeypatch, zero_copy):
    if not zero_copy:  # the copying path a platform without zero-copy loading takes
        monkeypatch.setattr(buffer_module, "zero_copy_supported", lambda: False)
    target = tmp_path / "pwned"
    raw = pickle.dumps({"format_version": 7, "model": _CreatesFile(target)})
    pickle.loads(raw)  # control: the payload really does run when unpickled naively
    assert target.exists()
    target.unlink()

    raw_file = tmp_path / "raw.pkl"
    raw_file.write_bytes(raw)
    zipped = tmp_path / "zipped.pt"
    torch.save({"format_version": 5, "model": _CreatesFile(target)}, zipped)
    enveloped = tmp_path / "enveloped.k3"  # header and digest are correct: only loading guards
    write_enveloped({"format_version": 7, "model": _CreatesFile(target)}, enveloped)

    for path in (raw_file, zipped, enveloped):
        with pytest.raises(CheckpointError):
            read_payload(path)
        assert not target.exists(), f"{path.name} ran code"

    run = make_run()
    run.step()
    before = run_fingerprint(run)
    with pytest.raises(CheckpointError, match=r"weights_only=True.*Unsupported global"):
        load_checkpoint(enveloped, **run.load_kwargs())
    assert not target.exists()
    assert run_fingerprint(run) == before

    with open(enveloped, "rb") as file:  # control: torch's unsafe mode would have run it
        file.seek(HEADER_SIZE)
        torch.load(file, weights_only=False)
    assert target.exists()


# -- atomic writes -----------------------------------------------------------------------


def test_save_fsyncs_the_file_then_the_directory_after_the_rename(tmp_path, monkeypatch):
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor: int) -> None:
        mode = os.fstat(descriptor).st_mode
        events.append("fsync-dir" if stat.S_ISDIR(mode) else "fsync-file")
        real_fsync(descriptor)

    def replace(source: str, target: str) -> None:
        events.append("replace")
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    run = make_run()
    run.step()
    save_checkpoint(tmp_path / "sub" / "ckpt.k3", **run.save_kwargs())
    assert events == ["fsync-file", "replace", "fsync-dir"]
    assert os.listdir(tmp_path / "sub") == ["ckpt.k3"]


@pytest.mark.skipif(os.name == "nt", reason="Windows cannot replace an open file")
def test_the_replaced_checkpoint_is_freed_on_another_thread(tmp_path, monkeypatch):
    """Freeing the old file's blocks (done by the rename when nothing holds it) happens at a
    close on a background thread, once the new file is in place."""
    path = tmp_path / "ckpt.k3"
    closed: list[tuple[bool, int, bytes]] = []
    real_close = payload_module._close_replaced

    def close(descriptor: int) -> None:
        content = os.pread(descriptor, 64, 0)
        links = os.fstat(descriptor).st_nlink
        closed.append((threading.current_thread() is threading.main_thread(), links, content))
        real_close(descriptor)

    monkeypatch.setattr(payload_module, "_close_replaced", close)
    run = make_run()
    run.step()
    save_checkpoint(path, **run.save_kwargs())
    assert closed == []  # nothing was replaced
    first = path.read_bytes()[:64]
    run.step()
    save_checkpoint(path, **run.save_kwargs())
    assert eventually(lambda: closed)
    # The first checkpoint's file, no longer linked anywhere, closed off the caller's thread.
    assert closed == [(False, 0, first)]
    assert read_payload(path)["counters"]["step"] == 2


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs and symbolic links")
def test_a_save_over_a_fifo_or_a_link_replaces_it_without_opening_it(tmp_path, monkeypatch):
    """Only a regular file is held open across the rename: opening a FIFO for reading would
    wait for a writer forever, and a link's target is not what the rename replaces."""
    held: list[int] = []
    monkeypatch.setattr(
        payload_module, "_close_replaced", lambda fd: (held.append(fd), os.close(fd))
    )
    run = make_run()
    run.step()
    fifo, target, link = tmp_path / "fifo.k3", tmp_path / "target.k3", tmp_path / "link.k3"
    os.mkfifo(fifo)
    saver = threading.Thread(
        target=save_checkpoint, args=(fifo,), kwargs=run.save_kwargs(), daemon=True
    )
    saver.start()
    saver.join(60)
    assert not saver.is_alive(), "the save waited on the FIFO"
    save_checkpoint(target, **run.save_kwargs())
    link.symlink_to(target)
    run.step()
    save_checkpoint(link, **run.save_kwargs())
    assert stat.S_ISREG(os.lstat(fifo).st_mode) and stat.S_ISREG(os.lstat(link).st_mode)
    assert read_payload(target)["counters"]["step"] == 1  # the link was replaced, not its target
    assert read_payload(link)["counters"]["step"] == 2
    assert held == []


@pytest.mark.parametrize("refusal", [errno.EINVAL, errno.ENOTSUP])
def test_fsync_directory_syncs_and_tolerates_filesystems_that_refuse(
    tmp_path, monkeypatch, refusal
):
    synced: list[bool] = []

    def fsync(descriptor: int) -> None:
        synced.append(stat.S_ISDIR(os.fstat(descriptor).st_mode))
        raise OSError(refusal, os.strerror(refusal))

    monkeypatch.setattr(os, "fsync", fsync)
    fsync_directory(tmp_path)  # the filesystem refused: not an error
    assert synced == [True]

    monkeypatch.setattr(
        os, "fsync", lambda descriptor: (_ for _ in ()).throw(OSError(errno.EIO, "I/O"))
    )
    with pytest.raises(OSError, match="I/O"):  # a real failure still is
        fsync_directory(tmp_path)


_CRASH_BEFORE_RENAME = """
import os, sys
sys.path.insert(0, {tests!r})
from ckpt_helpers import make_run
from k3_checkpoint import save_checkpoint
run = make_run()
for _ in range(3):
    run.step()
run.counters["step"] = 99  # the newer state a crash must not half-publish
os.replace = lambda *args: os._exit(17)  # power cut after the .tmp is complete and fsynced
save_checkpoint({path!r}, **run.save_kwargs())
"""


def test_crash_between_tmp_and_rename_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    save_checkpoint(path, **run.save_kwargs())
    previous = path.read_bytes()

    script = textwrap.dedent(_CRASH_BEFORE_RENAME).format(
        tests=str(Path(__file__).parent), path=str(path)
    )
    crashed = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert crashed.returncode == 17, crashed.stderr.decode()[-2000:]

    assert Path(f"{path}.tmp").exists()  # what the crash left behind
    assert path.read_bytes() == previous
    resumed = make_run(seed=4)
    load_checkpoint(path, **resumed.load_kwargs())
    assert resumed.counters["step"] == 1


def test_save_with_a_live_gradient_is_refused_and_writes_nothing(tmp_path):
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    save_checkpoint(path, **run.save_kwargs())
    previous = path.read_bytes()
    run.step()
    run.model.head.weight.grad = torch.zeros_like(run.model.head.weight)
    with pytest.raises(CheckpointError, match=r"head\.weight.*zero_grad\(set_to_none=True\)"):
        save_checkpoint(path, **run.save_kwargs())
    assert path.read_bytes() == previous
    assert os.listdir(tmp_path) == ["ckpt.k3"]


@pytest.mark.parametrize(
    ("section", "key", "value", "match"),
    [
        ("metadata", "train_config", {"lr": 1e-3, "schedule": object()}, r"train_config\.schedule"),
        ("metadata", "model_config", {"dims": {1, 2}}, r"model_config\.dims is a builtins\.set"),
        ("metadata", "tau", torch.tensor(100.0), r"metadata\.tau is a torch"),
        ("metadata", "rng", 1, r"payload key 'rng' is both reserved by the library and a meta"),
        ("metadata", "counters", 1, r"payload key 'counters' is both a component and a metadata"),
        ("metadata", "optimizer_layout", [], r"'optimizer_layout' is both an optimizer record"),
        ("components", "stats", {"a": 1}, r"component 'stats.a' is a int: give an object"),
        ("components", "bad.name", torch.nn.Linear(1, 1), r"without '\.', got 'bad\.name'"),
    ],
    ids=["object", "set", "tensor", "reserved", "component", "layout", "no-state", "dotted"],
)
def test_save_refuses_what_the_loader_would_refuse(tmp_path, section, key, value, match):
    run = make_run()
    run.step()
    path = tmp_path / "ckpt.k3"
    kwargs = run.save_kwargs()
    kwargs[section] = {**kwargs[section], key: value}
    with pytest.raises(CheckpointError, match=match):
        save_checkpoint(path, **kwargs)
    assert os.listdir(tmp_path) == []

    save_checkpoint(path, **run.save_kwargs())
    before = run_fingerprint(run)
    with pytest.raises(CheckpointError, match=match) as refused:  # checked while it hashes
        load_checkpoint(path, **kwargs)
    assert str(path) in str(refused.value) and run_fingerprint(run) == before

    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(raw)
    with pytest.raises(CheckpointError, match="digest mismatch"):  # the file's problem first
        load_checkpoint(path, **kwargs)


def test_component_state_must_be_plain_data_or_tensors(tmp_path):
    run = make_run()
    run.step()
    run.grad_scaler = {"scale": {1.0, 2.0}}
    with pytest.raises(CheckpointError, match=r"grad_scaler\.scale is a builtins\.set"):
        save_checkpoint(tmp_path / "ckpt.k3", **run.save_kwargs())
    assert os.listdir(tmp_path) == []


def test_plain_data_that_contains_itself_is_refused_by_name(tmp_path):
    """A cycle is named like any other refusal (not a RecursionError); a value that merely
    appears twice is not a cycle."""
    run = make_run()
    run.step()
    shared = [1, 2]
    run.grad_scaler = {"scale": 1.0, "a": shared, "b": shared}
    save_checkpoint(tmp_path / "ckpt.k3", **run.save_kwargs())
    looped: dict[str, object] = {"scale": 1.0}
    looped["again"] = [looped]
    run.grad_scaler = looped
    with pytest.raises(CheckpointError, match=r"grad_scaler\.again\[0\] contains itself"):
        save_checkpoint(tmp_path / "other.k3", **run.save_kwargs())
    run.grad_scaler = {"scale": 1.0}
    kwargs = run.save_kwargs()
    config: list[object] = []
    config.append(config)
    kwargs["metadata"] = {**kwargs["metadata"], "train_config": {"layers": config}}
    with pytest.raises(CheckpointError, match=r"train_config\.layers\[0\] contains itself"):
        save_checkpoint(tmp_path / "other.k3", **kwargs)
    assert os.listdir(tmp_path) == ["ckpt.k3"]


def _pickle_ops(raw: bytes) -> list[tuple[str, object]]:
    """The opcodes (name, argument) of a checkpoint's pickle (the zip member ``*/data.pkl``)."""
    with zipfile.ZipFile(io.BytesIO(raw[HEADER_SIZE:])) as archive:
        (member,) = [name for name in archive.namelist() if name.endswith("/data.pkl")]
        return [(op.name, argument) for op, argument, _ in pickletools.genops(archive.read(member))]


def test_tensors_are_written_without_torchs_empty_hook_dicts(checkpoint_bytes):
    """torch writes an empty OrderedDict per tensor for the hooks it never saves (a GLOBAL and
    a call for the weights-only unpickler to check); the payload writes None instead, so every
    tensor loads without hooks, as a new tensor has, in torch.load and this package alike."""
    names = [argument for name, argument in _pickle_ops(checkpoint_bytes) if name == "GLOBAL"]
    theirs = torch.load(io.BytesIO(checkpoint_bytes[HEADER_SIZE:]), weights_only=True)
    tensors = [value for value in _flat(theirs).values() if isinstance(value, torch.Tensor)]
    assert len(tensors) > 5 and all(tensor._backward_hooks is None for tensor in tensors)
    assert names.count("torch._utils _rebuild_tensor_v2") == len(tensors)
    assert names.count("collections OrderedDict") == _ordered_dicts(theirs)  # the states' own


def _ordered_dicts(value: object) -> int:
    """OrderedDicts in ``value``, attributes included (a module state's ``_metadata``)."""
    if isinstance(value, dict):
        children = [*value.values(), *getattr(value, "__dict__", {}).values()]
    elif isinstance(value, (list, tuple)):
        children = list(value)
    else:
        return 0
    return int(type(value) is collections.OrderedDict) + sum(map(_ordered_dicts, children))


def test_the_payload_pickle_has_no_memo_and_still_loads_in_torch(tmp_path, checkpoint_bytes):
    """The memo opcodes are what torch's weights-only unpickler tests for last; a tree needs
    none. The payload stays an ordinary pickle: torch.load reads it to the same values."""
    opcodes = {name for name, _ in _pickle_ops(checkpoint_bytes)}
    assert "REDUCE" in opcodes and "BINPERSID" in opcodes  # tensors were written
    assert not opcodes & {"BINPUT", "LONG_BINPUT", "MEMOIZE", "BINGET", "LONG_BINGET"}
    path = tmp_path / "ckpt.k3"
    path.write_bytes(checkpoint_bytes)
    ours = read_payload(path)
    assert_same_payload(
        ours, torch.load(io.BytesIO(checkpoint_bytes[HEADER_SIZE:]), weights_only=True)
    )


def _flat(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        return {
            k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}.{key}").items()
        }
    if isinstance(value, (list, tuple)):
        return {
            k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}[{i}]").items()
        }
    return {prefix: value}


def test_a_state_that_contains_itself_is_refused_and_writes_nothing(tmp_path):
    """Without the memo a reference cycle cannot be written; the save says so, and the
    previous checkpoint stays."""

    class Looped(torch.nn.Module):
        def get_extra_state(self) -> object:
            looped: list[object] = [1]
            looped.append(looped)
            return looped

        def set_extra_state(self, state: object) -> None:
            pass

    run = make_run()
    run.step()
    path = tmp_path / "ckpt.k3"
    save_checkpoint(path, **run.save_kwargs())
    previous = path.read_bytes()
    kwargs = run.save_kwargs()
    kwargs["components"] = {**kwargs["components"], "looped": Looped()}
    with pytest.raises(CheckpointError, match="reference cycle") as refused:
        save_checkpoint(path, **kwargs)
    assert str(path) in str(refused.value)
    assert path.read_bytes() == previous and os.listdir(tmp_path) == ["ckpt.k3"]
