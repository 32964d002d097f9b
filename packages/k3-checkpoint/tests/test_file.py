"""The file: formats, integrity, hostile input, atomic writes and what a save refuses."""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
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
    make_run,
    run_fingerprint,
    write_enveloped,
    write_legacy,
)

from k3_checkpoint import (
    CheckpointError,
    fsync_directory,
    load_checkpoint,
    read_payload,
    save_checkpoint,
)
from k3_checkpoint.payload import TRAILER_SIZE


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
    enveloped, legacy = tmp_path / "enveloped.k3", tmp_path / "legacy.k3"
    write_enveloped({"format_version": version}, enveloped, format_version=version)
    write_legacy({"format_version": version}, legacy, format_version=version)
    for path in (bare, enveloped, legacy):
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


def test_payload_version_must_agree_with_the_trailer(tmp_path):
    path = tmp_path / "ckpt.k3"
    write_enveloped({"format_version": 6}, path, format_version=7)
    with pytest.raises(CheckpointError, match="payload format_version 6 disagrees with the "
                       "file's 7"):
        read_payload(path)


def test_bare_format_7_payload_is_refused_as_unverifiable(tmp_path, checkpoint_bytes):
    path = tmp_path / "ckpt.k3"
    path.write_bytes(checkpoint_bytes)
    bare = tmp_path / "bare.pt"
    torch.save(read_payload(path), bare)
    with pytest.raises(CheckpointError, match="bare format-7 payload without the k3-checkpoint"):
        read_payload(bare)


def test_a_checkpoint_is_an_ordinary_zip_that_torch_load_reads(tmp_path, checkpoint_bytes):
    """The trailer is the zip's comment: zipfile and torch.load (mmap too) read the file
    as it is, to the same payload this package returns."""
    path = tmp_path / "ckpt.k3"
    path.write_bytes(checkpoint_bytes)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None and len(archive.comment) == TRAILER_SIZE
    ours = read_payload(path)
    for mmap in (False, True):
        assert_same_payload(ours, torch.load(path, weights_only=True, mmap=mmap))


def test_checkpoints_written_by_0_1_still_load_and_are_verified(tmp_path):
    """0.1.x wrote a sha256 header before the zip; such a run still resumes, and its
    digest still guards it."""
    run = make_run()
    run.step()
    current = tmp_path / "current.k3"
    save_checkpoint(current, **run.save_kwargs())
    legacy = tmp_path / "legacy.k3"
    write_legacy(read_payload(current), legacy)
    resumed = make_run()
    loaded = load_checkpoint(legacy, **resumed.load_kwargs())
    assert run_fingerprint(resumed) == run_fingerprint(run) and len(loaded.digest) == 64
    data = bytearray(legacy.read_bytes())
    data[len(data) // 2] ^= 0x10
    legacy.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="digest mismatch"):
        read_payload(legacy)


def test_a_file_replaced_between_verification_and_load_is_refused(tmp_path, monkeypatch,
                                                                    checkpoint_bytes):
    """torch.load opens the path again after the checksum: a swap in between (another
    valid checkpoint renamed over it) must not be loaded as the verified file."""
    path, other = tmp_path / "ckpt.k3", tmp_path / "other.k3"
    path.write_bytes(checkpoint_bytes)
    run = make_run()
    run.step()
    run.step()
    save_checkpoint(other, **run.save_kwargs())
    real_load = torch.load

    def swapped_first(target, *args, **kwargs):
        os.replace(other, path)
        return real_load(target, *args, **kwargs)

    monkeypatch.setattr(torch, "load", swapped_first)
    with pytest.raises(CheckpointError, match="changed while it was read"):
        read_payload(path)


def test_the_package_uses_no_private_torch_api():
    """Only torch's public API: a private name breaks silently on the next release."""
    source = Path(load_checkpoint.__code__.co_filename).parent
    # torch._C, torch.serialization._open_zipfile_reader, ... (not dunders: __version__)
    private = re.compile(r"torch(\.\w+)*\._[A-Za-z]|_weights_only_unpickler|_rebuild_tensor")
    uses = [f"{file.name}:{number}: {line.strip()}"
            for file in sorted(source.glob("*.py"))
            for number, line in enumerate(file.read_text().splitlines(), 1)
            if private.search(line)]
    assert uses == []


# -- integrity ---------------------------------------------------------------------------


def test_single_bit_flips_are_detected_anywhere(tmp_path, checkpoint_bytes):
    # The zip's local headers and pickle at the start, its central directory and every
    # trailer byte at the end, and every 29th byte between: a different bit each time.
    path = tmp_path / "flipped.k3"
    size = len(checkpoint_bytes)
    ends = set(range(512)) | set(range(size - TRAILER_SIZE - 512, size))
    for position in sorted(ends | set(range(0, size, 29))):
        corrupt = bytearray(checkpoint_bytes)
        corrupt[position] ^= 1 << (position % 8)
        path.write_bytes(corrupt)
        with pytest.raises(CheckpointError) as raised:
            read_payload(path)
        assert str(path) in str(raised.value)


def test_truncation_is_detected_at_every_cut(tmp_path, checkpoint_bytes):
    path = tmp_path / "cut.k3"
    size = len(checkpoint_bytes)
    cuts = [1, 7, 8, 40, 64, *range(65, size, 97)]
    cuts += [*range(size - TRAILER_SIZE - 2, size - TRAILER_SIZE + 3), size - 8, size - 1]
    for cut in cuts:
        path.write_bytes(checkpoint_bytes[:cut])
        with pytest.raises(CheckpointError, match=r"truncated|cut short"):
            read_payload(path)


def test_a_cut_file_is_named_for_what_it_is(tmp_path, checkpoint_bytes):
    """Only a ``.tmp`` can be a save cut short; a published file cut short is a copy."""
    cut = checkpoint_bytes[: len(checkpoint_bytes) // 2]
    published, pending = tmp_path / "checkpoint.pt", tmp_path / "checkpoint.pt.tmp"
    published.write_bytes(cut)
    pending.write_bytes(cut)
    with pytest.raises(CheckpointError) as raised:
        read_payload(published)
    assert "a truncated copy" in str(raised.value) and ".tmp" not in str(raised.value)
    with pytest.raises(CheckpointError, match=r"a save cut short \(the previous checkpoint, "
                       r"if any, is checkpoint\.pt\)"):
        read_payload(pending)


def test_appended_bytes_are_detected(tmp_path, checkpoint_bytes):
    path = tmp_path / "long.k3"
    path.write_bytes(checkpoint_bytes + b"\0")
    with pytest.raises(CheckpointError, match="1 unexpected bytes after its k3 trailer"):
        read_payload(path)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "is empty"),
        (b"step: 100\nmodel: weights.bin\n", "is not a k3 checkpoint"),
        (bytes(range(256)) * 4, "is not a k3 checkpoint"),
        (b"PK\x03\x04partial", "not a complete torch file"),
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


def test_malicious_pickles_never_run(tmp_path):
    target = tmp_path / "pwned"
    raw = pickle.dumps({"format_version": 7, "model": _CreatesFile(target)})
    pickle.loads(raw)  # control: the payload really does run when unpickled naively
    assert target.exists()
    target.unlink()

    raw_file = tmp_path / "raw.pkl"
    raw_file.write_bytes(raw)
    zipped = tmp_path / "zipped.pt"
    torch.save({"format_version": 5, "model": _CreatesFile(target)}, zipped)
    enveloped = tmp_path / "enveloped.k3"  # trailer and checksum correct: only loading guards
    write_enveloped({"format_version": 7, "model": _CreatesFile(target)}, enveloped)
    legacy = tmp_path / "legacy.k3"  # the same, as 0.1.x wrote it
    write_legacy({"format_version": 7, "model": _CreatesFile(target)}, legacy)

    for path in (raw_file, zipped, enveloped, legacy):
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

    torch.load(enveloped, weights_only=False)  # control: torch's unsafe mode would run it
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


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_the_replaced_checkpoint_is_freed_before_the_save_returns(tmp_path):
    """The rename frees the file it replaces inside the save, on the caller's thread: no
    thread is left working after it and nothing in this process holds the old file open (a
    close left to another thread would overlap whatever follows the save, the next save's
    writing included)."""
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    save_checkpoint(path, **run.save_kwargs())
    old = os.stat(path)
    run.step()
    threads = set(threading.enumerate())
    save_checkpoint(path, **run.save_kwargs())
    assert set(threading.enumerate()) == threads
    held = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            status = os.stat(f"/proc/self/fd/{name}")
            if (status.st_dev, status.st_ino) == (old.st_dev, old.st_ino):
                held.append(name)
    assert held == []
    assert (os.stat(path).st_dev, os.stat(path).st_ino) != (old.st_dev, old.st_ino)
    assert read_payload(path)["counters"]["step"] == 2


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs and symbolic links")
def test_a_save_over_a_fifo_or_a_link_replaces_it_without_opening_it(tmp_path):
    """The rename replaces whatever is at the path without opening it: opening a FIFO for
    reading would wait for a writer forever, and a link's target is not what it replaces."""
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
    with pytest.raises(CheckpointError, match=match) as refused:
        load_checkpoint(path, **kwargs)
    assert str(path) in str(refused.value) and run_fingerprint(run) == before

    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    path.write_bytes(raw)
    with pytest.raises(CheckpointError, match="checksum mismatch"):  # the file's problem first
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
