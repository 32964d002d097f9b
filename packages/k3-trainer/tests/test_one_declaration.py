"""``Trainer.states()`` is the one list of what a checkpoint holds: a component added there
alone is saved and resumed, and the commands that only read a run (eval, sample, export,
inspect) go on working, since they read what they ask for and leave the rest."""

from __future__ import annotations

import pytest
from trainer_helpers import small_toml

from k3_checkpoint import read_payload
from k3_trainer import Trainer
from k3_trainer.checkpoint import find_checkpoint
from k3_trainer.cli import main

CONFIG = small_toml(model={"max_seq_len": 32}, train=dict(
    batch_size=8, seq_len=32, eval_batches=2, warmup_steps=1, decay_steps=4,
    checkpoint_interval=2))


class Tally:
    """A stateful part of the run that only the training side knows of."""

    def __init__(self) -> None:
        self.updates = 0

    def state_dict(self) -> dict[str, int]:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.updates = state["updates"]


@pytest.fixture
def with_tally(monkeypatch):
    """``Trainer.states()`` with one more component, and nothing else changed."""
    tallies: list[Tally] = []
    declared = Trainer.states

    def states(trainer: Trainer) -> dict:
        if not hasattr(trainer, "_tally"):
            trainer._tally = Tally()
            trainer._tally.updates = 41
            tallies.append(trainer._tally)
        return {**declared(trainer), "tally": trainer._tally}

    monkeypatch.setattr(Trainer, "states", states)
    return tallies


def test_a_component_declared_in_states_alone(tmp_path, data_dir, with_tally, capsys,
                                              monkeypatch):
    (tmp_path / "c.toml").write_text(CONFIG)
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), "--data", str(data_dir), "--config",
                 str(tmp_path / "c.toml"), "--max-steps", "2"]) == 0
    saved = read_payload(find_checkpoint(run) / "k3.ckpt")
    assert saved["tally"] == {"updates": 41} and "tally" in saved["components"]

    with_tally.clear()
    assert main(["train", "--run-dir", str(run), "--resume", "--max-steps", "4"]) == 0
    assert with_tally[0].updates == 41  # restored by the resume

    monkeypatch.undo()  # the read-only commands know nothing of it
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(run)]) == 0
    assert main(["sample", "--run-dir", str(run), "--max-new-tokens", "4"]) == 0
    assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "hub")]) == 0
    assert main(["inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert "step 4: val_loss" in out and "tally" in out
    assert (tmp_path / "hub" / "model.safetensors").is_file()

    # A resume, unlike them, restores everything: without the component it is refused.
    code = main(["train", "--run-dir", str(run), "--resume", "--max-steps", "6"])
    assert code != 0
    assert "holds components this load has none for: ['tally']" in capsys.readouterr().err
