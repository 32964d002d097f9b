"""Callbacks hear of a failing run (``on_error``) and are closed at the end of every
``fit()`` (``close``): trained, stopped or failed; a file logger writes on in a later
session of the same trainer."""

from __future__ import annotations

import json

import pytest
from trainer_helpers import build_parts, train_config

from k3_trainer import Callback, MetricsLog, Trainer


class Recorder(Callback):
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.errors: list[BaseException] = []

    def on_session_start(self, trainer, record):
        self.calls.append("start")

    def on_error(self, trainer, error):
        self.calls.append("error")
        self.errors.append(error)

    def close(self):
        self.calls.append("close")


class FailAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_attempt_start(self, trainer, step):
        if step == self.step:
            raise RuntimeError(f"boom at {step}")


def _trainer(data_dir, *callbacks, **config):
    config = train_config(max_steps=3, eval_interval=100, checkpoint_interval=100, **config)
    model, optimizer, train, val = build_parts(config, data_dir)
    return Trainer(model, optimizer, (train, val), config, callbacks=list(callbacks))


def test_a_trained_session_closes_every_callback_once_and_reports_no_error(data_dir):
    recorder = Recorder()
    _trainer(data_dir, recorder).fit()
    assert recorder.calls == ["start", "close"]


def test_a_failing_session_reports_the_error_then_closes(data_dir):
    recorder = Recorder()
    with pytest.raises(RuntimeError, match="boom at 2"):
        _trainer(data_dir, recorder, FailAt(2)).fit()
    assert recorder.calls == ["start", "error", "close"]
    assert str(recorder.errors[0]) == "boom at 2"


def test_a_callback_whose_on_error_raises_does_not_hide_the_runs_error(data_dir):
    class Broken(Callback):
        def on_error(self, trainer, error):
            raise ValueError("listener broke")

    recorder = Recorder()
    with pytest.raises(RuntimeError, match="boom at 1"):
        _trainer(data_dir, Broken(), recorder, FailAt(1)).fit()
    assert recorder.calls[-2:] == ["error", "close"]  # the next one still heard of it


def test_a_metrics_file_closed_by_one_session_is_written_by_the_next(data_dir, tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    trainer = _trainer(data_dir, log, log_interval=1)
    trainer.fit()
    assert log._file is None  # closed at the end of the session
    trainer.config = trainer.config.replace(max_steps=5)
    trainer.fit()
    steps = [json.loads(line).get("step") for line in
             (tmp_path / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["event"] == "train"]
    assert steps == [1, 2, 3, 4, 5]
