"""The checkpoint history from the command line: retention, ``--step N`` on the read-only
commands, ``--resume-from`` as a new branch of the run, and a damaged latest checkpoint
whose refusal says how to continue from the one before it."""

from __future__ import annotations

import json

import pytest
import torch
from trainer_helpers import small_toml

from k3_checkpoint import read_payload
from k3_trainer.cli import main
from k3_trainer.observe.metrics import read_events

CONFIG = small_toml(train=dict(batch_size=4, seq_len=16, log_interval=1, eval_interval=100,
                                eval_batches=1, warmup_steps=1, decay_steps=8,
                                checkpoint_interval=2))


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "small.toml"
    path.write_text(CONFIG)
    return path


def _train(run, data_dir, config_file, *extra) -> int:
    return main(["train", "--run-dir", str(run), "--data", str(data_dir), "--config",
                 str(config_file), *extra])


def _kept(run) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def _step_of(folder) -> int:
    return read_payload(folder / "k3.ckpt")["counters"]["step"]


def test_retention_and_every_read_only_command_at_a_kept_step(tmp_path, data_dir,
                                                              config_file, capsys):
    run = tmp_path / "run"
    assert _train(run, data_dir, config_file, "--max-steps", "8", "--keep-last", "2",
                  "--keep-every", "4") == 0
    # 2 is pruned; 4 and 8 are milestones; 6 and 8 the newest two.
    assert _kept(run) == ["latest", "step-00000004", "step-00000006", "step-00000008"]
    assert (run / "checkpoints" / "latest").resolve().name == "step-00000008"
    capsys.readouterr()
    assert main(["inspect", str(run), "--step", "4"]) == 0
    assert "step-00000004" in capsys.readouterr().out
    assert main(["eval", "--run-dir", str(run), "--step", "6", "--batches", "1"]) == 0
    assert "step 6" in capsys.readouterr().out
    assert main(["sample", "--run-dir", str(run), "--step", "4", "--max-new-tokens", "4",
                 "--prompt", "The"]) == 0
    out = tmp_path / "hub"
    assert main(["export", "--run-dir", str(run), "--out", str(out), "--step", "4"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"]
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(run), "--step", "2"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of step 2; it keeps steps 4, 6, 8" in err


def test_resume_from_an_older_checkpoint_is_a_new_branch(tmp_path, data_dir, config_file):
    run = tmp_path / "run"
    assert _train(run, data_dir, config_file, "--max-steps", "8", "--keep-last", "10") == 0
    checkpoints = run / "checkpoints"
    older = checkpoints / "step-00000004"
    assert main(["train", "--run-dir", str(run), "--resume-from", str(older)]) == 0
    # The checkpoints after the branch point moved aside whole; the branch wrote its own.
    moved = checkpoints / "superseded-1"
    assert sorted(p.name for p in moved.iterdir()) == ["step-00000006", "step-00000008"]
    assert _step_of(checkpoints / "latest") == 8
    # Training is deterministic: the branch retraced the abandoned steps bitwise.
    first, again = read_payload(moved / "step-00000008" / "k3.ckpt"), read_payload(
        checkpoints / "step-00000008" / "k3.ckpt")
    assert all(torch.equal(t, again["model"][k]) for k, t in first["model"].items())

    record = json.loads((run / "run.json").read_text())
    assert record["sessions"][-1]["branch"] == 4
    [branch] = record["branches"]
    assert branch["step"] == 4 and branch["from"].endswith("step-00000004")
    assert branch["superseded_records"] > 0
    events = read_events(run / "metrics.jsonl")
    assert [e["step"] for e in events if e["event"] == "branch"] == [4]
    trains = [e for e in events if e["event"] == "train"]
    # The first session's steps 5-8 are kept, marked superseded; the branch's are current.
    old = [e["step"] for e in trains if e.get("superseded")]
    new = [e["step"] for e in trains if not e.get("superseded")]
    assert old == [5, 6, 7, 8] and new == [1, 2, 3, 4, 5, 6, 7, 8]


def test_resume_from_refuses_what_is_not_a_checkpoint_of_the_run(tmp_path, data_dir,
                                                                config_file, capsys):
    run = tmp_path / "run"
    assert _train(run, data_dir, config_file, "--max-steps", "4", "--keep-last", "2") == 0
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run), "--resume-from",
                 str(run / "checkpoints" / "step-00000009")]) == 2
    err = capsys.readouterr().err
    assert "no such checkpoint" in err and "keeps steps 2, 4" in err


def test_a_damaged_latest_names_the_older_checkpoint_and_the_command(tmp_path, data_dir,
                                                                     config_file, capsys):
    run = tmp_path / "run"
    assert _train(run, data_dir, config_file, "--max-steps", "6", "--keep-last", "3") == 0
    latest = (run / "checkpoints" / "latest").resolve() / "k3.ckpt"
    data = bytearray(latest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    latest.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run), "--resume", "--max-steps", "8"]) == 2
    err = capsys.readouterr().err.strip()
    older = run / "checkpoints" / "step-00000004"
    assert len(err.splitlines()) == 1 and "checksum" in err
    command = f"k3-train train --run-dir {run} --resume-from {older}"
    assert f"the newest older checkpoint is {older} (step 4)" in err and command in err
    # The command it gives continues the run.
    assert main([*command.split()[1:], "--max-steps", "8"]) == 0
    assert _step_of(run / "checkpoints" / "latest") == 8
    assert (run / "checkpoints" / "superseded-1" / "step-00000006").is_dir()
