"""Guarantee 2: ``kill -9`` at any moment loses at most the steps since the last checkpoint,
never corrupts the run, and the run resumed after every kill ends bitwise equal to the
uninterrupted run. No session ever reads a ``.tmp`` or a partial file.

One CLI run (``--checkpoint-interval 1``, so most moments are near a checkpoint write) is
killed with SIGKILL again and again and resumed with ``--resume`` each time: at random
(seeded) moments of startup and training, and at moments inside a checkpoint write (half
the payload written; the ``.tmp`` complete but not renamed; the step folder complete but
``latest`` not moved; published but the directory not yet fsynced). Some sessions write
their checkpoints in the background (``--async-checkpoint``): their kills land while a
write runs on the worker thread and training goes on. The sessions run through
``cli_driver.py``, the CLI's own ``main`` plus an audit hook that logs every open of a
checkpoint file and the test-only kill points.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import DRIVER, assert_bitwise_equal, k3_train, latest_checkpoint, subprocess_env

from k3_checkpoint import CheckpointError, read_payload
from k3_trainer import read_events
from k3_trainer.cli import main

STEPS = 80
KILL_PLAN = [  # (moment, kill point, background saves)
    ("startup", None, False),  # before or while the first session starts: nothing to resume
    ("write", "mid-payload:1", False),  # inside the very first checkpoint write: still nothing
    *[("training", None, False)] * 2,
    ("write", "before-rename:2", False),
    ("write", "mid-payload:2", True),  # a background write cut short while training runs
    ("startup", None, False),  # while a resumed session loads its checkpoint
    ("write", "mid-payload:3", False),
    ("write", "before-latest:2", True),  # written in the background, latest not yet moved
    ("training", None, True),
    ("write", "after-rename:2", False),
    ("training", None, False),
]
FINAL = re.compile(r".*/checkpoints/step-\d{8}(\.\d+)?/k3\.ckpt")


def _flags(data_dir, config) -> list[str]:
    return ["--data", str(data_dir), "--config", str(config), "--max-steps", str(STEPS),
            "--checkpoint-interval", "1", "--warmup-steps", "5", "--decay-steps", str(STEPS),
            "--log-interval", "10", "--eval-interval", "25"]


def _session_starts(run: Path) -> list[dict]:
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [e for e in read_events(metrics) if e["event"] == "session_start"]


def _latest(run: Path) -> Path | None:
    link = run / "checkpoints" / "latest"
    return latest_checkpoint(run) if link.is_symlink() else None


def _staged(run: Path) -> dict[str, int]:
    """The hidden folders of checkpoint writes under way, with their files' newest mtime."""
    found = {}
    for folder in (run / "checkpoints").glob(".step-*.tmp"):
        times = [p.stat().st_mtime_ns for p in folder.iterdir()] or [0]
        found[folder.name] = max(times)
    return found


def _wait_for_training(process: subprocess.Popen, run: Path, starts_before: int) -> bool:
    """Until this session logged its session_start (or exited); polls, asserts nothing."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if len(_session_starts(run)) > starts_before:
            return True
        time.sleep(0.005)
    raise TimeoutError("the session never started training")


def test_kill_9_torture_ends_bitwise_equal_to_the_uninterrupted_run(tmp_path, data_dir,
                                                                    small_toml, capsys):
    reference = tmp_path / "reference"  # uninterrupted (in this process: it is not killed)
    assert main(["train", "--run-dir", str(reference), *_flags(data_dir, small_toml)]) == 0

    run, log = tmp_path / "run", tmp_path / "opens.log"
    chance = random.Random(20250601)
    kills = kills_in_write = kills_in_background = fresh_restarts = 0
    resumed_steps: list[int] = []
    last_step = 0
    plan = list(KILL_PLAN)
    while True:
        checkpoint = _latest(run)
        resume = checkpoint is not None
        restart = not resume and (run / "run.json").is_file()
        if restart:
            # Killed before its first checkpoint: --resume has nothing to lose and starts
            # the recorded run from scratch (discarding the dead session's events), so the
            # supervisor just runs --resume again.
            fresh_restarts += 1
        step_before = read_payload(checkpoint)["counters"]["step"] if resume else 0
        staged_before = _staged(run)
        starts_before = 0 if restart else len(_session_starts(run))
        kind, point, background = plan.pop(0) if plan else ("finish", None, False)
        env = subprocess_env({"K3_TEST_OPEN_LOG": str(log)})
        if point is not None:
            env["K3_TEST_KILL"] = point
        argv = ["--run-dir", str(run), "--resume"] if run_started(run) else [
            "--run-dir", str(run), *_flags(data_dir, small_toml)]
        argv.append("--async-checkpoint" if background else "--no-async-checkpoint")
        process = subprocess.Popen([sys.executable, str(DRIVER), "train", *argv], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True)
        if kind == "startup":
            # The first one lands before any checkpoint can exist (importing torch alone
            # takes longer); later ones anywhere in startup, loading or early training.
            time.sleep(chance.uniform(0.05, 0.5 if kills == 0 else 1.5))
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
        elif kind == "training" and _wait_for_training(process, run, starts_before):
            time.sleep(chance.uniform(0.0, 0.25))
            process.send_signal(signal.SIGKILL)
        _, stderr = process.communicate(timeout=600)

        if kind == "finish" or process.returncode == 0:
            assert process.returncode == 0, stderr
            break
        assert process.returncode == -signal.SIGKILL, (kind, point, process.returncode, stderr)
        kills += 1
        staged = _staged(run)
        in_write = any(staged_before.get(name) != mtime for name, mtime in staged.items())
        if point is not None:
            assert in_write or point.startswith(("after-rename", "before-latest")), point
        kills_in_write += in_write or point is not None
        kills_in_background += background and point is not None
        # Whatever the moment, latest is absent or names a complete, verified checkpoint,
        # and it never goes back in time.
        checkpoint = _latest(run)
        if checkpoint is not None:
            step = read_payload(checkpoint)["counters"]["step"]
            assert step >= last_step
            last_step = step
        new_starts = _session_starts(run)[starts_before:]
        if resume and new_starts:  # the session resumed exactly where latest was
            assert new_starts[0]["step"] == step_before
            resumed_steps.append(step_before)

    print(f"{kills} kills, {kills_in_write} inside a write ({kills_in_background} in the "
          f"background); resumed at {resumed_steps}")
    assert kills >= 10 and kills_in_write >= 5, (kills, kills_in_write)
    assert kills_in_background == 2
    assert fresh_restarts >= 1  # the kill inside the very first write
    assert len(resumed_steps) >= 3, resumed_steps
    assert not _staged(run)

    final = read_payload(latest_checkpoint(run))
    assert final["counters"]["step"] == STEPS
    reference_final = read_payload(latest_checkpoint(reference))
    for payload in (final, reference_final):  # how the last session saved: not the run
        payload["train_config"].pop("async_checkpoint", None)
    assert_bitwise_equal(reference_final, final)

    # Never read a .tmp, never write a checkpoint in place: a final name is only ever
    # produced by the rename of a complete, fsynced .tmp inside a staging folder.
    opens = [line.split("\t") for line in log.read_text().splitlines()]
    assert opens
    for _pid, mode, flags, path in opens:
        writes = any(c in mode for c in "wax+") if mode != "None" else int(flags) & (
            os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        if path.endswith(".tmp"):
            assert writes, f"a .tmp was opened for reading: {path} {mode}"
        else:
            assert FINAL.fullmatch(path) and not writes, (path, mode)
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # no torn line, even with kills between events


def run_started(run) -> bool:
    """A supervisor's rule: --resume once the run has a checkpoint or a run record."""
    return (run / "checkpoints" / "latest").is_symlink() or (run / "run.json").is_file()


def test_a_tmp_left_by_a_kill_is_never_a_checkpoint(tmp_path, data_dir, small_toml, capsys):
    """A kill inside the first write leaves only a .tmp: it is refused by name if someone
    tries to load it, and --resume starts the run again (there is no checkpoint)."""
    run = tmp_path / "run"
    killed = k3_train("train", "--run-dir", run, "--data", data_dir, "--config", small_toml,
                      "--max-steps", 3, "--checkpoint-interval", 1, driver=True,
                      env={"K3_TEST_KILL": "mid-payload:1"})
    assert killed.returncode == -signal.SIGKILL
    leftover = run / "checkpoints" / ".step-00000001.tmp" / "k3.ckpt.tmp"
    assert leftover.exists() and sorted(p.name for p in leftover.parent.parent.iterdir()) == [
        ".step-00000001.tmp"]
    with pytest.raises(CheckpointError, match=r"no k3-checkpoint trailer .* a save cut short"):
        read_payload(leftover)
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run), "--resume"]) == 0  # nothing to lose: again
    assert "so the run starts from scratch" in capsys.readouterr().err
    assert read_payload(latest_checkpoint(run))["counters"]["step"] == 3
    assert not leftover.parent.exists()
