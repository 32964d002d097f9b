"""Ctrl-C and SIGTERM through ``k3-train train``: the session stops at an update boundary,
saves there, says so in one line, exits 130/143, and ``--resume`` ends bitwise equal to
the uninterrupted run — one process (Ctrl-C), and 2 ranks under torchrun (SIGTERM to one
rank: every rank stops at the same step), data-parallel or two pipeline stages. Both
signals in one process, with their exit statuses: packages/k3-trainer/tests/test_interrupt.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import assert_bitwise_equal, k3_train, latest_checkpoint, subprocess_env
from test_distributed_checkpoints import _final_state
from test_distributed_training import (
    _torchrun,
    distributed,
    needs_torchrun,
    one_launch_at_a_time,
)

from k3_checkpoint import read_payload
from k3_trainer import read_events
from k3_trainer.cli import main

# Its torchrun launches run with every other module's, one at a time.
pytestmark = one_launch_at_a_time

STEPS = 24


def _flags(data_dir: Path, config: Path) -> list[str]:
    return ["--data", str(data_dir), "--config", str(config), "--max-steps", str(STEPS),
            "--warmup-steps", "2", "--decay-steps", str(STEPS), "--log-interval", "1",
            "--eval-interval", "1000", "--checkpoint-interval", "1000"]


def _trained_steps(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        return 0
    return max((e["step"] for e in read_events(metrics) if e["event"] == "train"), default=0)


def _interrupt(command: list[str], run: Path, signum: int) -> subprocess.CompletedProcess[str]:
    """Start ``command``, send ``signum`` once it has trained two steps, and wait."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=subprocess_env())
    deadline = time.monotonic() + 300
    while _trained_steps(run) < 2:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the run never trained"
        time.sleep(0.02)
    process.send_signal(signum)
    out, err = process.communicate(timeout=300)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130)])  # SIGTERM: below
def test_a_signal_saves_and_the_resume_is_bitwise(tmp_path, data_dir, small_toml, signum,
                                                  status):
    reference = tmp_path / "reference"
    assert main(["train", "--run-dir", str(reference), *_flags(data_dir, small_toml)]) == 0

    run = tmp_path / "run"
    command = [sys.executable, "-m", "k3_trainer.cli", "train", "--run-dir", str(run),
               *_flags(data_dir, small_toml)]
    stopped = _interrupt(command, run, signum)
    lines = [line for line in stopped.stderr.splitlines() if line.startswith("k3-train")]
    assert stopped.returncode == status, stopped.stderr[-3000:]
    step = read_payload(latest_checkpoint(run))["counters"]["step"]
    assert 2 <= step < STEPS
    assert lines[-1] == (f"k3-train: interrupted at step {step}; checkpoint saved; "
                         "continue with --resume")
    end = [e for e in read_events(run / "metrics.jsonl") if e["event"] == "session_end"]
    assert end[-1]["interrupted"] == signal.Signals(signum).name

    resumed = k3_train("train", "--run-dir", run, "--resume", *_flags(data_dir, small_toml))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bitwise_equal(read_payload(latest_checkpoint(reference)),
                         read_payload(latest_checkpoint(run)))


def test_an_interrupt_before_training_names_no_checkpoint(tmp_path, data_dir, small_toml,
                                                          capsys, monkeypatch):
    """Ctrl-C while the session starts (here: while the model is built) says that nothing
    was written, never "continue from the last checkpoint"."""
    import dataclasses

    from k3_trainer.models import get_model_spec, registry

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setitem(registry._registered, "k3",
                        dataclasses.replace(get_model_spec("k3"), build=interrupted))
    code = main(["train", "--run-dir", str(tmp_path / "run"), *_flags(data_dir, small_toml)])
    assert code == 130
    assert capsys.readouterr().err.strip().endswith("interrupted; no checkpoint was written")


@distributed
@needs_torchrun
@pytest.mark.parametrize("layout", [("--parallel", "ddp"), ("--parallel", "fsdp", "--pp", "2")],
                         ids=["ddp", "pp2"])
def test_every_rank_stops_at_the_same_step_and_resumes_bitwise(tmp_path, data_dir, small_toml,
                                                                layout):
    """SIGTERM reaches one rank only (as when one node is preempted first): both ranks (or
    both pipeline stages, rank 1 holding the last) agree on the step, the run is saved
    there (sharded under stages), and the resume ends as the uninterrupted run does. The
    uninterrupted run and the resume are forked launches (the ``--nproc`` launcher is the
    next test's)."""
    flags = [*_flags(data_dir, small_toml), *layout, "--batch-size", "2"]
    reference = tmp_path / "reference"
    _torchrun("-m", "k3_trainer.cli", "train", "--run-dir", reference, *flags)

    run = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "-m", "k3_trainer.cli", "train", "--run-dir", str(run),
               *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=subprocess_env())
    deadline = time.monotonic() + 300
    while _trained_steps(run) < 2:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    rank1 = _rank_pid(process.pid, rank=1)
    subprocess.run(["kill", "-TERM", str(rank1)], check=True)
    out, err = process.communicate(timeout=300)
    step = _final_state(run, tmp_path)["counters"]["step"]
    assert f"interrupted at step {step}; checkpoint saved" in err, err[-3000:]
    ends = [e for e in read_events(run / "metrics.jsonl") if e["event"] == "session_end"]
    assert ends[-1]["step"] == step and ends[-1]["interrupted"] == "SIGTERM"
    _torchrun("-m", "k3_trainer.cli", "train", "--run-dir", run, "--resume", *flags)
    assert_bitwise_equal(_final_state(reference, tmp_path),
                         _final_state(run, tmp_path))


@distributed
@needs_torchrun
@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_on_a_nproc_launch_saves_and_exits_130(inherited, tmp_path, data_dir,
                                                      small_toml):
    """Ctrl-C in a terminal reaches the whole foreground group: the ``--nproc`` launcher,
    torchrun and both ranks (here with the experts split over them). The ranks stop at one
    step and save there; the launcher waits for them instead of dying with a traceback,
    and exits 130. ``ignored``: the launcher started with SIGINT ignored, as a script's
    background job is; the ranks stop on a SIGINT regardless, and so the launcher's status
    must say so (it said torchrun's 1)."""
    import os

    run = tmp_path / "run"
    command = [sys.executable, "-m", "k3_trainer.cli", "train", "--run-dir", str(run),
               *_flags(data_dir, small_toml), "--max-steps", "400", "--decay-steps", "400",
               "--parallel", "fsdp", "--expert-parallel", "2", "--batch-size", "2",
               "--nproc", "2"]
    if inherited == "ignored":  # the shell's own way: `trap '' INT`, then exec
        command = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *command]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=subprocess_env(), start_new_session=True)
    deadline = time.monotonic() + 300
    while _trained_steps(run) < 2:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGINT)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 130, err[-3000:]
    # The sharded checkpoint keeps its counters in DCP: read them back through DCP's own
    # converter, and check them against the folder's name and the logged checkpoint event.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    latest = run / "checkpoints" / "latest"
    assert latest.is_symlink() and (latest / ".metadata").is_file(), sorted(
        p.name for p in (run / "checkpoints").iterdir())
    dcp_to_torch_save(latest, tmp_path / "gathered.pt")
    step = torch.load(tmp_path / "gathered.pt", weights_only=True)["counters"]["step"]
    assert 2 <= step < 400
    assert os.readlink(latest) == f"step-{step:08d}"
    saved = [e for e in read_events(run / "metrics.jsonl") if e["event"] == "checkpoint"]
    assert saved[-1]["step"] == step
    assert read_payload(latest / "k3.ckpt")["data_parallel"] == {
        "mode": "fsdp", "world_size": 2, "expert_parallel": 2}
    assert f"k3-train[rank 0]: interrupted at step {step}; checkpoint saved" in err
    assert "KeyboardInterrupt" not in err  # the launcher waited for its ranks


def _rank_pid(parent: int, rank: int) -> int:
    """The pid of torchrun's worker ``rank`` (its environment names the rank)."""
    for child in Path("/proc").glob("[0-9]*"):
        try:
            environ = (child / "environ").read_bytes().split(b"\0")
            status = (child / "status").read_text()
        except OSError:
            continue
        ppid = next((int(line.split()[1]) for line in status.splitlines()
                     if line.startswith("PPid:")), None)
        if ppid == parent and f"RANK={rank}".encode() in environ and \
                b"LOCAL_RANK=" + str(rank).encode() in environ:
            return int(child.name)
    raise AssertionError(f"no worker of rank {rank} under torchrun (pid {parent})")
