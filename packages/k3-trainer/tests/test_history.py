"""A run's checkpoint history: step folders, the ``latest`` pointer, retention, branches."""

from __future__ import annotations

import os

import pytest

from k3_trainer.checkpoint import LATEST, CheckpointHistory


def _save(history: CheckpointHistory, step: int, text: str = "") -> os.PathLike:
    staged = history.stage(step)
    (staged / "k3.ckpt").write_text(text or f"step {step}")
    return history.publish(staged, step)


def _names(history: CheckpointHistory) -> list[str]:
    return [entry.name for entry in history.entries()]


def test_each_save_is_a_step_folder_and_latest_follows_it(tmp_path):
    history = CheckpointHistory(tmp_path / "checkpoints", keep_last=3)
    for step in (100, 200):
        published = _save(history, step)
        assert published == history.root / f"step-{step:08d}"
        assert os.readlink(history.root / LATEST) == published.name
        assert history.latest() == published
    assert sorted(p.name for p in history.root.iterdir()) == [
        "latest", "step-00000100", "step-00000200"]  # no staging folder, no stray link


def test_keep_last_prunes_the_oldest_and_keep_every_keeps_milestones(tmp_path):
    history = CheckpointHistory(tmp_path / "checkpoints", keep_last=2, keep_every=300)
    for step in range(100, 1100, 100):
        _save(history, step)
    assert [e.step for e in history.entries()] == [300, 600, 900, 1000]
    assert history.at_step(600) == history.root / "step-00000600"
    assert history.at_step(700) is None

    one = CheckpointHistory(tmp_path / "one")  # the default: the latest only
    for step in (1, 2, 3):
        _save(one, step)
    assert _names(one) == ["step-00000003"]


def test_a_kill_before_the_pointer_moves_leaves_latest_on_the_previous_checkpoint(
        tmp_path, monkeypatch):
    history = CheckpointHistory(tmp_path / "checkpoints", keep_last=1)
    _save(history, 1)
    staged = history.stage(2)
    (staged / "k3.ckpt").write_text("step 2")

    def killed(*args: object) -> None:
        raise KeyboardInterrupt("killed here")

    monkeypatch.setattr(history, "_point_at", killed)
    with pytest.raises(KeyboardInterrupt):
        history.publish(staged, 2)
    monkeypatch.undo()
    assert history.latest() == history.root / "step-00000001"  # the pointer decides
    assert (history.root / "step-00000001" / "k3.ckpt").read_text() == "step 1"


def test_a_killed_save_leaves_only_a_staging_folder_the_next_save_removes(tmp_path):
    history = CheckpointHistory(tmp_path / "checkpoints")
    _save(history, 1)
    (history.stage(2) / "k3.ckpt.tmp").write_text("half")
    assert history.latest() == history.root / "step-00000001"
    assert _names(history) == ["step-00000001"]  # the staged folder is no checkpoint
    _save(history, 3)
    assert sorted(p.name for p in history.root.iterdir()) == ["latest", "step-00000003"]


def test_the_same_step_saved_again_is_a_new_folder_never_the_live_one(tmp_path):
    history = CheckpointHistory(tmp_path / "checkpoints", keep_last=2)
    first = _save(history, 5, "first")
    again = _save(history, 5, "again")
    assert again.name == "step-00000005.1" and history.latest() == again
    assert (first / "k3.ckpt").read_text() == "first"
    assert history.at_step(5) == again


def test_continuing_from_an_older_checkpoint_moves_the_later_ones_aside(tmp_path):
    history = CheckpointHistory(tmp_path / "checkpoints", keep_last=5)
    for step in (1, 2, 3, 4):
        _save(history, step)
    moved = history.continue_from(history.root / "step-00000002")
    assert [p.name for p in moved] == ["step-00000003", "step-00000004"]
    assert all(p.parent.name == "superseded-1" and (p / "k3.ckpt").is_file() for p in moved)
    assert history.latest() == history.root / "step-00000002"
    # The link itself names the branch point at once, not the moved step 4 until a save.
    assert os.readlink(history.root / "latest") == "step-00000002"
    assert _names(history) == ["step-00000001", "step-00000002"]

    _save(history, 3, "branch")  # the branch's own step 3: no clash with the moved one
    assert history.latest() == history.root / "step-00000003"
    history.continue_from(history.root / "step-00000001")
    assert (history.root / "superseded-2" / "step-00000003" / "k3.ckpt").read_text() == "branch"
    assert history.continue_from(history.root / "step-00000001") == []  # already latest
    with pytest.raises(ValueError, match="is not a checkpoint of"):
        history.continue_from(tmp_path / "elsewhere")


def test_a_pointer_left_dangling_reads_as_the_newest_checkpoint(tmp_path):
    """A kill between moving a branch's later checkpoints aside and pointing latest at the
    branch point: latest names nothing, and the newest checkpoint left is the branch point."""
    history = CheckpointHistory(tmp_path / "checkpoints", keep_last=5)
    for step in (1, 2):
        _save(history, step)
    (history.root / "step-00000002").rename(tmp_path / "away")
    assert history.latest() == history.root / "step-00000001"


@pytest.mark.parametrize(("keep_last", "keep_every"), [(0, None), (1, 0), (True, None)])
def test_retention_is_checked(tmp_path, keep_last, keep_every):
    with pytest.raises(ValueError, match="keep_"):
        CheckpointHistory(tmp_path, keep_last, keep_every)


def test_a_history_copied_without_its_symlink_still_works(tmp_path):
    """``cp -rL`` or ``shutil.copytree`` turns ``latest`` into a copy of a step folder: it
    is never taken for the pointer, and the next move of the pointer replaces it."""
    import shutil

    history = CheckpointHistory(tmp_path / "run" / "checkpoints", keep_last=2)
    for step in (1, 2):
        _save(history, step)
    shutil.copytree(tmp_path / "run", tmp_path / "copy")  # follows symlinks
    copied = CheckpointHistory(tmp_path / "copy" / "checkpoints", keep_last=2)
    assert not (copied.root / LATEST).is_symlink()
    assert copied.latest() == copied.root / "step-00000002"
    assert copied.continue_from(copied.root / "step-00000001")
    assert os.readlink(copied.root / LATEST) == "step-00000001"
