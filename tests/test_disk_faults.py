"""Guarantee 6: a disk that fills up or a run directory that cannot be written fails the
save with a clear one-line error (exit status 1, no traceback) and keeps the previous
checkpoint, which still loads and resumes.

Faults are real where a test can make them real without privileges: RLIMIT_FSIZE makes the
kernel refuse a write past a size (EFBIG, like ENOSPC mid-write), and an audit hook makes
every write inside the run directory fail with EACCES (a read-only directory, which root
would otherwise ignore). A patched ``torch.save`` reproduces ENOSPC exactly as torch's zip
writer reports it: a ``RuntimeError`` about stream positions caused by the ``OSError``.
"""

from __future__ import annotations

import errno
import io
import os

import pytest
import torch
from harness import (
    assert_bitwise_equal,
    assert_one_line_error,
    build_run,
    k3_train,
    latest_checkpoint,
    refusal_lines,
    train_config,
    tree_bytes,
)

import k3_checkpoint
from k3_checkpoint import read_payload
from k3_trainer import Trainer, TrainState
from k3_trainer.checkpoint import CheckpointWriteError
from k3_trainer.cli import main

FLAGS = ["--checkpoint-interval", "1", "--warmup-steps", "1", "--decay-steps", "6"]


def _disk_full_at(monkeypatch, write: int, *, like_torch: bool) -> None:
    """The ``write``-th checkpoint payload of this process hits a full disk half-way."""
    real_save, seen = torch.save, [0]

    def save(obj, f, *args, **kwargs):
        if not (isinstance(obj, dict) and "format_version" in obj):  # not a checkpoint's
            return real_save(obj, f, *args, **kwargs)
        seen[0] += 1
        if seen[0] != write:
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        f.write(buffer.getvalue()[:1000])
        full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if not like_torch:
            raise full
        try:
            raise full
        except OSError:  # what torch's inline_container does with a failed write
            # torch chains it implicitly (no ``from``), as here
            raise RuntimeError(  # noqa: B904
                "[enforce fail at inline_container.cc:672] . unexpected pos 1064 vs 1000")

    monkeypatch.setattr(torch, "save", save)


def _cli(argv, capsys) -> tuple[int, list[str]]:
    """The exit code and stderr's lines less the progress lines (the refusals under test
    are the lines that remain)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    return code, refusal_lines(capsys.readouterr().err)


@pytest.mark.parametrize("like_torch", [False, True], ids=["oserror", "torch-runtimeerror"])
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(
        like_torch, tmp_path, data_dir, small_toml, capsys, monkeypatch):
    run, clean = tmp_path / "run", tmp_path / "clean"
    common = ["--data", data_dir, "--config", small_toml, *FLAGS]
    _disk_full_at(monkeypatch, 3, like_torch=like_torch)
    code, err = _cli(["train", "--run-dir", run, *common, "--max-steps", 6], capsys)
    assert code == 1, err
    assert len(err) == 1 and err[0].startswith("k3-train: error: cannot write checkpoint "), err
    assert "No space left on device" in err[0]
    assert err[0].endswith(f"the latest checkpoint, {run / 'checkpoints' / 'step-00000002'}, "
                           "is unchanged"), err
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.jsonl",
                                                      "run.json"]
    assert _history(run) == ["latest", "step-00000002"]  # no .tmp left behind
    assert read_payload(latest_checkpoint(run))["counters"]["step"] == 2

    monkeypatch.undo()  # space is back: the run resumes from step 2 and loses nothing
    assert _cli(["train", "--run-dir", run, "--resume"], capsys)[0] == 0
    assert _cli(["train", "--run-dir", clean, *common, "--max-steps", 6], capsys)[0] == 0
    assert_bitwise_equal(read_payload(latest_checkpoint(clean)),
                         read_payload(latest_checkpoint(run)))


def _history(run) -> list[str]:
    """What the run's checkpoint history holds, hidden entries included."""
    return sorted(p.name for p in (run / "checkpoints").iterdir())


# The two renames of a save: the staged file into place inside its hidden step folder
# (os.replace), then that folder to its step name (os.rename), which publishes it.
RENAMES = {"file": ("replace", "k3.ckpt.tmp"), "folder": ("rename", ".step-00000003.tmp")}


@pytest.mark.parametrize("which", sorted(RENAMES))
def test_a_failed_rename_keeps_the_previous_checkpoint(which, tmp_path, data_dir, small_toml,
                                                       capsys, monkeypatch):
    run = tmp_path / "run"
    assert _cli(["train", "--run-dir", run, "--data", data_dir, "--config", small_toml,
                 *FLAGS, "--max-steps", 2], capsys)[0] == 0
    before = latest_checkpoint(run).read_bytes()
    name, suffix = RENAMES[which]
    real, failed = getattr(os, name), []

    def rename(source, destination, *args, **kwargs):
        if os.fspath(source).endswith(suffix):
            failed.append(os.fspath(source))
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(destination))
        return real(source, destination, *args, **kwargs)

    monkeypatch.setattr(os, name, rename)
    code, err = _cli(["train", "--run-dir", run, "--resume", "--max-steps", 4], capsys)
    assert failed, f"the checkpoint write never called os.{name} on a {suffix}"
    assert code == 1 and len(err) == 1, err
    assert "cannot write checkpoint" in err[0] and "Read-only file system" in err[0]
    assert os.readlink(run / "checkpoints" / "latest") == "step-00000002"
    assert latest_checkpoint(run).read_bytes() == before
    assert _history(run) == ["latest", "step-00000002"]  # no .tmp left behind


def test_library_save_reports_the_oserror_and_keeps_the_previous_file(tmp_path, data_dir,
                                                                       monkeypatch):
    config = train_config(max_steps=2, checkpoint_interval=100)
    model, opt, tl, vl = build_run(config, data_dir)
    trainer = Trainer(model, opt, (tl, vl), config, checkpoint_path=tmp_path / "ck.pt")
    state = trainer.fit()
    before = (tmp_path / "ck.pt").read_bytes()
    _disk_full_at(monkeypatch, 1, like_torch=True)
    with pytest.raises(CheckpointWriteError) as failed:
        trainer.checkpointer.save(tmp_path / "ck.pt", step=state.step)
    assert isinstance(failed.value, OSError) and failed.value.errno == errno.ENOSPC
    assert "\n" not in str(failed.value) and "unchanged" in str(failed.value)
    assert (tmp_path / "ck.pt").read_bytes() == before
    assert os.listdir(tmp_path) == ["ck.pt"]

    # k3-checkpoint itself: a write error stays an OSError, even behind torch's RuntimeError
    monkeypatch.undo()
    _disk_full_at(monkeypatch, 1, like_torch=True)
    with pytest.raises(OSError) as raw:
        k3_checkpoint.save_checkpoint(
            tmp_path / "ck.pt", {"model": model, "optimizer": opt, "train": tl, "val": vl},
            {"train_config": config.to_dict(), "model_config": model.config.to_dict()})
    assert raw.value.errno == errno.ENOSPC and str(raw.value.filename).endswith("ck.pt.tmp")
    assert (tmp_path / "ck.pt").read_bytes() == before
    assert TrainState(step=2).step == read_payload(tmp_path / "ck.pt")["counters"]["step"]


@pytest.fixture
def run_at_step_2(tmp_path, data_dir, small_toml):
    run = tmp_path / "run"
    code = main(["train", "--run-dir", str(run), "--data", str(data_dir), "--config",
                 str(small_toml), *FLAGS, "--max-steps", "2"])
    assert code == 0
    return run


def test_a_file_size_limit_fails_the_save_in_a_real_process(run_at_step_2):
    """The kernel refuses the write past 200 kB (the checkpoint is about 460 kB)."""
    run = run_at_step_2
    before = latest_checkpoint(run).read_bytes()
    assert len(before) > 300_000
    resumed = k3_train("train", "--run-dir", run, "--resume", "--max-steps", 4, driver=True,
                       env={"K3_TEST_FSIZE": "200000"})
    line = assert_one_line_error(resumed, "cannot write checkpoint", code=1)
    assert "File too large" in line and "step-00000002, is unchanged" in line
    assert latest_checkpoint(run).read_bytes() == before
    assert _history(run) == ["latest", "step-00000002"]  # no .tmp left behind
    assert k3_train("train", "--run-dir", run, "--resume", "--max-steps", 4).returncode == 0


def test_a_read_only_run_directory_fails_in_one_line_and_changes_nothing(run_at_step_2,
                                                                         data_dir, small_toml):
    run = run_at_step_2
    before = tree_bytes(run)
    resumed = k3_train("train", "--run-dir", run, "--resume", "--max-steps", 4, driver=True,
                       env={"K3_TEST_READONLY": str(run)})
    line = assert_one_line_error(resumed, "is not writable (Permission denied", code=2)
    assert "fix its permissions or choose another --run-dir" in line
    assert tree_bytes(run) == before

    parent = run.parent / "read-only"
    parent.mkdir()
    fresh = k3_train("train", "--run-dir", parent / "new", "--data", data_dir, "--config",
                     small_toml, "--max-steps", 2, driver=True,
                     env={"K3_TEST_READONLY": str(parent)})
    assert_one_line_error(fresh, "is not writable (Permission denied", code=2)
    assert list(parent.iterdir()) == []
