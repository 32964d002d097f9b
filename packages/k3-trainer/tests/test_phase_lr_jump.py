"""A phase that jumps the learning rate warns: ``k3-train train --phase`` compares the run's
schedule and the phase's at the checkpoint's step, says by how much the LR jumps and which
``decay_fraction`` or ``decay_steps`` would continue it; the suggestion is applied here and
warns no more. A phase that keeps the LR continuous says nothing."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from test_mixture_cli import RECIPE, _run  # the wsd recipe: decay_steps 6, decay_fraction 0.5

from k3_trainer import TrainConfig, learning_rate_at_step
from k3_trainer.schedule import phase_lr_warning

JUMP = "jumps the learning rate"


def _recorded(run) -> TrainConfig:
    return TrainConfig.from_dict(json.loads((run / "run.json").read_text())["train_config"])


def _jump_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if JUMP in line]


def _expected(before: TrainConfig, after: TrainConfig, step: int) -> str:
    old, new = learning_rate_at_step(before, step), learning_rate_at_step(after, step)
    return f"{old:.4g} (the run's schedule) → {new:.4g} (the phase's), " \
           f"{(new - old) / old * 100:+.1f}%"


def _suggested(line: str) -> list[list[str]]:
    """Each ``pass …`` alternative of the line, as command-line flags."""
    options = line.split(": pass ", 1)[1].split(" or ")
    return [re.findall(r"--[a-z-]+ \S+", option) for option in options]


def test_a_phase_that_jumps_the_lr_warns_with_numbers_and_a_fix_that_works(
        data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = _run(capsys, ["train", "--run-dir", run, "--data", data_dir, *RECIPE,
                                 "--max-steps", "2"])
    assert code == 0, err
    before = _recorded(run)
    copies = [tmp_path / f"copy{i}" for i in range(3)]
    for copy in copies:  # the same run at step 2, for each phase tried below
        shutil.copytree(run, copy, symlinks=True)

    # decay_steps 3 (fraction 0.5): the decay starts at step 1, so step 2 is already in it.
    code, _, err = _run(capsys, ["train", "--run-dir", run, "--resume", "--phase", "anneal",
                                 "--decay-steps", "3", "--max-steps", "3"])
    assert code == 0, err  # a warning, not a refusal
    after = _recorded(run)
    assert (after.decay_steps, after.decay_start) == (3, 1)
    (line,) = _jump_lines(err)
    assert line.startswith("k3-train: warning: phase anneal jumps the learning rate at the "
                           "checkpoint's step 2: ")
    assert _expected(before, after, 2) in line
    assert learning_rate_at_step(after, 2) < learning_rate_at_step(before, 2)  # a drop
    record = json.loads((run / "run.json").read_text())
    assert [(p["name"], p["step"]) for p in record["phases"]] == [("anneal", 2)]
    assert "decay_steps − round(decay_fraction·decay_steps) ≥ 2" in line
    fraction, steps = _suggested(line)
    assert fraction == ["--decay-fraction 0.333333"]
    assert steps == ["--decay-steps 4"]

    # Either suggestion, with the phase's other values, continues at the run's LR.
    for copy, fix in zip(copies, (fraction, steps)):
        flags = [part for flag in fix for part in flag.split()]
        code, _, err = _run(capsys, ["train", "--run-dir", copy, "--resume", "--phase",
                                     "anneal", "--decay-steps", "3", *flags,
                                     "--max-steps", "3"])
        assert code == 0, err
        assert _jump_lines(err) == [], err
        fixed = _recorded(copy)
        assert fixed.decay_start >= 2
        assert learning_rate_at_step(fixed, 2) == learning_rate_at_step(before, 2)

    # A phase that only moves the decay later keeps the LR at the peak: nothing to say.
    code, _, err = _run(capsys, ["train", "--run-dir", copies[2], "--resume", "--phase",
                                 "longer", "--decay-steps", "8", "--max-steps", "3"])
    assert code == 0, err
    assert "phase longer starts at the checkpoint's step: it changes decay_steps" in err
    assert _jump_lines(err) == [], err


WSD = TrainConfig(lr_schedule="wsd", decay_steps=100, decay_fraction=0.2, warmup_steps=5,
                  peak_lr=3e-3, max_steps=100)


@pytest.mark.parametrize(("before", "changes", "step"), [
    (WSD, {"decay_steps": 80}, 70),                            # decay moved before the step
    (WSD, {"decay_steps": 90, "decay_fraction": 0.5}, 50),
    (WSD, {"decay_shape": "linear", "decay_steps": 60}, 55),
    (WSD, {"lr_schedule": "cosine"}, 50),                      # cosine has left the peak
    (WSD, {"decay_steps": 200}, 90),                           # mid-decay: back to the peak
    (WSD, {"decay_steps": 200}, 120),                          # at the floor
    (WSD, {"min_lr_ratio": 0.0}, 120),
    (WSD.replace(lr_schedule="cosine"), {"decay_steps": 300}, 40),
    (WSD.replace(lr_schedule="constant"), {"lr_schedule": "wsd", "decay_steps": 60}, 50),
])
def test_every_suggestion_is_checked_against_the_schedule(before, changes, step):
    after = before.replace(**changes)
    line = phase_lr_warning("p", before, after, step)
    assert line is not None and _expected(before, after, step) in line
    fixes = _suggested(line) if ": pass " in line else [
        re.findall(r"--[a-z-]+ \S+", line.rsplit("keep the run's decay", 1)[1])]
    assert fixes and all(fixes), line
    for fix in fixes:
        fixed = after.replace(**{
            name.removeprefix("--").replace("-", "_"): _value(value)
            for name, value in (flag.split() for flag in fix)})
        assert phase_lr_warning("p", before, fixed, step) is None, (fix, line)
        assert learning_rate_at_step(fixed, step) == pytest.approx(
            learning_rate_at_step(before, step), rel=1e-6)


def _value(text: str) -> object:
    text = text.rstrip(")")
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


@pytest.mark.parametrize(("changes", "step"), [
    ({"decay_steps": 200}, 50),                      # the decay moves later: still the peak
    ({"decay_steps": 90, "decay_fraction": 0.25}, 67),  # starts exactly at the step
    ({"decay_shape": "linear"}, 80),                 # another shape, not yet decaying
    ({"decay_steps": 50}, 120),                      # both at the floor
    ({"lr_schedule": "constant"}, 60),
])
def test_a_continuous_lr_says_nothing(changes, step):
    after = WSD.replace(**changes)
    assert learning_rate_at_step(after, step) == pytest.approx(
        learning_rate_at_step(WSD, step), rel=1e-6)
    assert phase_lr_warning("p", WSD, after, step) is None


def test_the_wording_of_a_jump():
    line = phase_lr_warning("anneal", WSD, WSD.replace(decay_steps=90), 75)
    assert line == (
        "phase anneal jumps the learning rate at the checkpoint's step 75: 0.003 (the run's "
        "schedule) → 0.001898 (the phase's), -36.7%; to continue at 0.003, the wsd decay "
        "must start at or after step 75 (decay_steps − round(decay_fraction·decay_steps) ≥ "
        "75): pass --decay-fraction 0.166667 (with decay_steps 90: the decay then starts at "
        "step 75) or --decay-steps 94 (with decay_fraction 0.2)")
