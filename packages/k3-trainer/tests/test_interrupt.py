"""Stopping on a signal: the attempt finishes, the checkpoint is written at that update
boundary, and a resume continues bitwise as if nothing had happened."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from trainer_helpers import assert_same_state, build_parts, train_config

from k3_checkpoint import read_payload
from k3_trainer import Callback, MetricsLog, Trainer
from k3_trainer.interrupt import StopOnSignal, TrainingInterrupted


class SignalAt(Callback):
    """Sends this process ``signum`` after successful step ``step`` (a person's Ctrl-C)."""

    def __init__(self, step: int, signum: int = signal.SIGINT) -> None:
        self.step, self.signum = step, signum

    def on_step_end(self, trainer, stats) -> None:
        if trainer.state.step == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_at_the_boundary_and_the_resume_is_bitwise(data_dir, tmp_path, signum,
                                                                  status):
    config = train_config(max_steps=6, decay_steps=6, checkpoint_interval=4)
    model_a, opt_a, tl_a, vl_a = build_parts(config, data_dir)
    Trainer(model_a, opt_a, (tl_a, vl_a), config).fit()

    model, opt, tl, vl = build_parts(config, data_dir)
    log = MetricsLog(None)
    trainer = Trainer(model, opt, (tl, vl), config, checkpoint_path=tmp_path / "ck.pt",
                      callbacks=[log, SignalAt(3, signum)])
    previous = signal.getsignal(signum)
    with pytest.raises(TrainingInterrupted) as stopped, StopOnSignal(trainer):
        trainer.fit()
    assert signal.getsignal(signum) is previous  # the handlers are put back
    assert (stopped.value.step, stopped.value.exit_status) == (3, status)
    assert stopped.value.checkpoint == tmp_path / "ck.pt"
    assert read_payload(tmp_path / "ck.pt")["counters"]["step"] == 3
    assert [e["event"] for e in log.events][-2:] == ["checkpoint", "session_end"]
    assert log.events[-1]["interrupted"] == signal.Signals(signum).name

    model_b, opt_b, tl_b, vl_b = build_parts(config, data_dir, seed=99)
    resumed = Trainer(model_b, opt_b, (tl_b, vl_b), config)
    resumed.resume(tmp_path / "ck.pt")
    assert resumed.fit().step == 6
    assert_same_state(model_a, opt_a, model_b, opt_b)
    assert tl_a.state_dict() == tl_b.state_dict()


def test_a_stop_on_a_checkpoint_step_saves_once(data_dir, tmp_path):
    config = train_config(max_steps=6, checkpoint_interval=3)
    model, opt, tl, vl = build_parts(config, data_dir)
    log = MetricsLog(None)

    class StopAt3(Callback):
        def on_step_end(self, trainer, stats):
            if trainer.state.step == 3:
                trainer.request_stop()

    trainer = Trainer(model, opt, (tl, vl), config, checkpoint_path=tmp_path / "ck.pt",
                      callbacks=[log, StopAt3()])
    with pytest.raises(TrainingInterrupted, match="interrupted at step 3; checkpoint saved"):
        trainer.fit()
    assert [e["step"] for e in log.events if e["event"] == "checkpoint"] == [3]


def test_a_stop_is_honoured_once_and_a_later_fit_trains_on(data_dir, tmp_path):
    """The request is spent by the stop it caused: the next fit() on the same Trainer
    trains to max_steps instead of doing one update, saving and raising again."""
    config = train_config(max_steps=5)
    model, opt, tl, vl = build_parts(config, data_dir)
    log = MetricsLog(None)
    trainer = Trainer(model, opt, (tl, vl), config, checkpoint_path=tmp_path / "ck.pt",
                      callbacks=[log])
    trainer.request_stop()
    with pytest.raises(TrainingInterrupted):
        trainer.fit()
    assert trainer.state.step == 1
    assert trainer.fit().step == 5
    assert [e.get("interrupted") for e in log.events if e["event"] == "session_end"] == [
        "SIGINT", None]


def test_without_a_checkpoint_path_the_stop_says_nothing_was_saved(data_dir):
    config = train_config(max_steps=6)
    model, opt, tl, vl = build_parts(config, data_dir)
    trainer = Trainer(model, opt, (tl, vl), config, callbacks=[SignalAt(2)])
    with pytest.raises(TrainingInterrupted, match="step 2; nothing saved") as stopped, \
            StopOnSignal(trainer):
        trainer.fit()
    assert stopped.value.checkpoint is None
    assert torch.is_tensor(next(iter(model.parameters())))


def test_a_second_signal_ends_the_process_at_once(tmp_path):
    """The first signal asks for a stop; a second one, before the boundary is reached,
    ends the process with the signal's default action."""
    script = tmp_path / "second.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        from k3_trainer.interrupt import StopOnSignal

        class Trainer:
            def request_stop(self, signum):
                print("stop requested", flush=True)

        with StopOnSignal(Trainer(), last_words="the save is abandoned; the last one stays"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        print("not reached", flush=True)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == -signal.SIGTERM
    assert done.stdout.splitlines() == ["stop requested"]
    assert done.stderr.splitlines() == ["the save is abandoned; the last one stays"]
