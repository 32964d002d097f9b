"""Checkpoints written in the background (``async_checkpoint``): the same checkpoints as a
synchronous save, written off the training thread, one at a time, and a failed write that
stops the run instead of vanishing."""

from __future__ import annotations

import errno
import threading

import pytest
from trainer_helpers import build_parts, train_config

from k3_checkpoint import CheckpointSnapshot, read_payload
from k3_trainer import Callback, Trainer
from k3_trainer.checkpoint import CheckpointHistory, CheckpointWriteError
from k3_trainer.interrupt import TrainingInterrupted


class Events(Callback):
    """Every event, in order, with the step training had reached when it came."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []
        self.trainer_steps: list[int] = []

    def _note(self, trainer, record) -> None:  # type: ignore[no-untyped-def]
        self.seen.append((record["event"], record))
        self.trainer_steps.append(trainer.state.step)

    on_checkpoint_saved = on_session_end = _note

    def checkpoints(self) -> list[dict]:
        return [record for name, record in self.seen if name == "checkpoint"]


def _run(data_dir, root, *, background: bool, steps: int = 6, **config):
    config = train_config(max_steps=steps, checkpoint_interval=2, eval_interval=100,
                          async_checkpoint=background, keep_last=10, **config)
    model, opt, tl, vl = build_parts(config, data_dir)
    events = Events()
    history = CheckpointHistory(root, keep_last=10)
    trainer = Trainer(model, opt, (tl, vl), config, checkpoint_path=history,
                      callbacks=[events])
    return trainer, history, events


def _payloads(history: CheckpointHistory) -> dict[int, dict]:
    return {e.step: read_payload(e.path / "k3.ckpt") for e in history.entries()}


def test_background_saves_write_the_synchronous_checkpoints_bitwise(data_dir, tmp_path):
    sync, sync_history, _ = _run(data_dir, tmp_path / "sync", background=False)
    sync.fit()
    asynchronous, history, events = _run(data_dir, tmp_path / "async", background=True)
    asynchronous.fit()
    a, b = _payloads(sync_history), _payloads(history)
    assert sorted(a) == sorted(b) == [2, 4, 6]
    for step in a:
        assert b[step]["train_config"]["async_checkpoint"] is True
        for key in a[step]:
            if key != "train_config":
                assert _same(a[step][key], b[step][key]), (step, key)
    # fit() returned with the last write durable and reported
    assert history.latest() == history.root / "step-00000006"
    reports = events.checkpoints()
    assert [r["step"] for r in reports] == [2, 4, 6] and all(r["background"] for r in reports)
    assert all(r["held_bytes"] > 0 and r["digest"] for r in reports)


def _same(x, y) -> bool:
    import torch
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape \
            and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    return x == y


def test_training_goes_on_while_a_write_runs_and_the_next_save_waits_for_it(
        data_dir, tmp_path, monkeypatch):
    """The first write is held until training has moved two steps past it: it ran on
    another thread, training did not wait, and the save at step 4 waited for it (one
    write in flight)."""
    trainer, history, events = _run(data_dir, tmp_path / "run", background=True)
    release, writers = threading.Event(), []
    real_write = CheckpointSnapshot.write

    def held_write(snapshot, path):  # type: ignore[no-untyped-def]
        writers.append(threading.current_thread())
        if len(writers) == 1:
            assert release.wait(60), "training never reached step 3"
        return real_write(snapshot, path)

    class Release(Callback):
        def on_step_end(self, trainer, stats) -> None:  # type: ignore[no-untyped-def]
            if trainer.state.step == 3:
                release.set()

    monkeypatch.setattr(CheckpointSnapshot, "write", held_write)
    trainer.callbacks.extend([Release()])
    trainer.fit()
    assert writers and all(w is not threading.main_thread() for w in writers)
    reports = events.checkpoints()
    first = next(i for i, (name, r) in enumerate(events.seen)
                 if name == "checkpoint" and r["step"] == 2)
    assert events.trainer_steps[first] >= 3  # reported once written, training went on
    assert [r["step"] for r in reports] == [2, 4, 6]
    assert history.latest() == history.root / "step-00000006"


def test_a_failed_background_write_stops_the_run_at_the_next_boundary(
        data_dir, tmp_path, monkeypatch):
    """The write of step 4 fails: the run stops at step 5 (where it sees the failure) or
    at the latest at step 6 (the next save waits for it), far from its end."""
    trainer, history, events = _run(data_dir, tmp_path / "run", background=True, steps=12)
    real_write = CheckpointSnapshot.write
    calls = []

    def failing_write(snapshot, path):  # type: ignore[no-untyped-def]
        calls.append(path)
        if len(calls) == 2:  # the checkpoint of step 4
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(snapshot, path)

    monkeypatch.setattr(CheckpointSnapshot, "write", failing_write)
    with pytest.raises(CheckpointWriteError, match="No space left on device"):
        trainer.fit()
    assert trainer.state.step in (5, 6)
    assert history.latest() == history.root / "step-00000002"  # the previous one, intact
    assert read_payload(history.latest() / "k3.ckpt")["counters"]["step"] == 2
    end = [r for name, r in events.seen if name == "session_end"]
    assert end and "No space left" in end[-1]["checkpoint_failed"]
    assert [r["step"] for r in events.checkpoints()] == [2]


def test_an_interrupt_waits_for_the_write_in_flight_and_saves_its_own_step(
        data_dir, tmp_path, monkeypatch):
    trainer, history, events = _run(data_dir, tmp_path / "run", background=True, steps=20)

    class StopAt(Callback):
        def on_step_end(self, trainer, stats) -> None:  # type: ignore[no-untyped-def]
            if trainer.state.step == 3:
                trainer.request_stop()

    trainer.callbacks.extend([StopAt()])
    with pytest.raises(TrainingInterrupted):
        trainer.fit()
    assert [r["step"] for r in events.checkpoints()] == [2, 3]
    assert history.latest() == history.root / "step-00000003"
    assert [e.step for e in history.entries()] == [2, 3]


@pytest.mark.parametrize("background", [False, True])
def test_a_failed_first_save_says_none_was_written_and_leaves_nothing(
        data_dir, tmp_path, monkeypatch, background):
    trainer, history, events = _run(data_dir, tmp_path / "run", background=background)

    def full(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device")

    if background:
        monkeypatch.setattr(CheckpointSnapshot, "write", full)
    else:
        import k3_checkpoint
        monkeypatch.setattr(k3_checkpoint, "save_checkpoint", full)
    with pytest.raises(CheckpointWriteError) as caught:
        trainer.fit()
    assert str(caught.value).endswith("No space left on device; no checkpoint was written")
    assert "step-00000002" in str(caught.value)
    assert list(history.root.iterdir()) == []  # the staging folder is gone too
    end = [r for name, r in events.seen if name == "session_end"]  # the session is closed
    assert len(end) == 1 and "no checkpoint was written" in end[0]["checkpoint_failed"]
