"""Resume under another runtime: refused by default (the spec), accepted only on request.

The runtime signature (torch version, device, thread count, ...) is what a bitwise
continuation depends on. ``--allow-runtime-change`` accepts a portable difference, still
validates everything else, records a ``runtime_changed`` event and warns in one line.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from harness import latest_checkpoint, tree_bytes

from k3_checkpoint import read_payload
from k3_trainer.cli import main
from k3_trainer.observe.metrics import read_events


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, data_dir, small_toml):
    run = tmp_path_factory.mktemp("runtime") / "run"
    assert main(["train", "--run-dir", str(run), "--data", str(data_dir), "--config",
                 str(small_toml), "--max-steps", "2", "--warmup-steps", "1",
                 "--decay-steps", "4"]) == 0
    return run


@pytest.fixture
def other_thread_count(monkeypatch):
    """This process now reports another thread count than the one the run was saved with."""
    saved = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: saved + 5)
    return saved, saved + 5


def test_another_runtime_is_refused_by_default(tmp_path, two_steps, other_thread_count,
                                               capsys):
    run = tmp_path / "run"
    shutil.copytree(two_steps, run, symlinks=True)
    before = tree_bytes(run)
    assert main(["train", "--run-dir", str(run), "--resume", "--max-steps", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "num_threads" in err[0] and "runtime" in err[0]
    saved, _ = other_thread_count
    # How to continue, in command-line terms: the run's own setting, or the opt-in.
    assert err[0].endswith(f"; relaunch with OMP_NUM_THREADS={saved} as the run's last session "
                           "ran, or pass --allow-runtime-change to continue anyway (no bitwise "
                           "promise)")
    assert "runtime_may_differ" not in err[0]  # a library policy's name means nothing here
    assert tree_bytes(run) == before


def test_allow_runtime_change_continues_and_says_what_changed(tmp_path, two_steps,
                                                              other_thread_count, capsys):
    saved, current = other_thread_count
    run = tmp_path / "run"
    shutil.copytree(two_steps, run, symlinks=True)
    assert main(["train", "--run-dir", str(run), "--resume", "--max-steps", "4",
                 "--allow-runtime-change"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1
    assert f"num_threads {saved} → {current}" in warnings[0]
    assert "no longer bitwise-identical" in warnings[0]
    events = read_events(run / "metrics.jsonl")
    changed = [e for e in events if e["event"] == "runtime_changed"]
    assert len(changed) == 1 and changed[0]["step"] == 2
    assert changed[0]["changes"] == {"num_threads": {"saved": saved, "current": current}}
    assert read_payload(latest_checkpoint(run))["counters"]["step"] == 4


def test_the_opt_in_does_not_relax_anything_else(tmp_path, two_steps, capsys):
    run = tmp_path / "run"
    shutil.copytree(two_steps, run, symlinks=True)
    before = tree_bytes(run)
    assert main(["train", "--run-dir", str(run), "--resume", "--max-steps", "4",
                 "--allow-runtime-change", "--peak-lr", "0.5"]) == 2
    assert "train_config.peak_lr" in capsys.readouterr().err
    assert tree_bytes(run) == before
