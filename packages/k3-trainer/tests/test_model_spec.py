"""Model specs: a model that is not K3 trains, checkpoints, resumes, evaluates and samples
through the ``k3-train`` command once it is registered (one place), and a user's callback
joins a command's run in one place too."""

from __future__ import annotations

import dataclasses
import json
from importlib.metadata import EntryPoint

import pytest
import torch
from toy_model import SPEC, ToyConfig
from trainer_helpers import latest_checkpoint

from k3_checkpoint import read_payload
from k3_trainer import Callback, ConfigError
from k3_trainer.cli import main
from k3_trainer.models import (
    ModelSpec,
    get_model_spec,
    model_names,
    register_model,
    registry,
    unregister_model,
)

TRAIN = ["--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--warmup-steps",
         "1", "--decay-steps", "4", "--checkpoint-interval", "2", "--eval-interval", "2",
         "--no-qk-clip-enabled"]  # the toy has no attention to clip


@pytest.fixture
def toy():
    register_model(SPEC, replace=True)
    yield SPEC
    unregister_model("toy")


def _run(capsys, argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _weights(run):
    return read_payload(latest_checkpoint(run))["model"]


def test_a_registered_model_trains_resumes_evaluates_and_samples_through_the_command(
        toy, data_dir, tmp_path, capsys):
    whole, split = tmp_path / "whole", tmp_path / "split"
    code, _, err = _run(capsys, ["train", "--model", "toy", "--preset", "wide", "--run-dir",
                                 whole, "--data", data_dir, *TRAIN, "--max-steps", "4"])
    assert code == 0, err
    record = json.loads((whole / "run.json").read_text())
    assert record["model"] == "toy"
    assert record["model_config"] == {"vocab_size": 256, "d_model": 32, "max_seq_len": 64}
    # Stopped at step 2, then resumed without --model: the run's record names it.
    assert _run(capsys, ["train", "--model", "toy", "--preset", "wide", "--run-dir", split,
                         "--data", data_dir, *TRAIN, "--max-steps", "2"])[0] == 0
    code, _, err = _run(capsys, ["train", "--run-dir", split, "--resume", "--max-steps", "4"])
    assert code == 0, err
    ours, theirs = _weights(whole), _weights(split)
    assert ours.keys() == theirs.keys() == {"embed.weight", "mix.weight", "head.weight"}
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name

    code, out, err = _run(capsys, ["eval", "--run-dir", split, "--batches", "1"])
    assert code == 0 and out.startswith("step 4: val_loss "), err
    code, out, err = _run(capsys, ["sample", "--run-dir", split, "--max-new-tokens", "4",
                                   "--prompt", "The"])
    assert code == 0 and out.startswith("The"), err


def test_a_models_flags_come_from_its_own_config(toy, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--model", "toy", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "model shape (ToyConfig, model toy)" in text
    assert "--d-model N width of the toy's hidden state (default: the preset's; narrow 8, " \
        "wide 32)" in text
    assert "--preset {narrow,wide}" in text
    assert "--n-layers" not in text  # K3's fields are K3's alone
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", "toy", "--run-dir", "r", "--kda-chunk-size", "16"])
    assert exit_.value.code == 2


def test_a_run_keeps_its_model_and_a_model_without_a_feature_says_so(
        toy, data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert _run(capsys, ["train", "--model", "toy", "--run-dir", run, "--data", data_dir,
                         *TRAIN, "--max-steps", "2"])[0] == 0
    code, _, err = _run(capsys, ["train", "--model", "k3", "--run-dir", run, "--resume",
                                 "--max-steps", "3"])
    assert code == 2 and "trains the model 'toy'" in err
    code, _, err = _run(capsys, ["export", "--run-dir", run, "--out", tmp_path / "hub"])
    assert code == 2 and "the model 'toy' has no hub format" in err
    assert not (tmp_path / "hub").exists()
    code, _, err = _run(capsys, ["train", "--model", "toy", "--run-dir", tmp_path / "ep",
                                 "--data", data_dir, "--d-model", "0"])
    assert code == 2 and "d_model must be >= 1" in err


def test_an_unknown_model_is_refused_by_name(capsys):
    code, _, err = _run(capsys, ["train", "--model", "nope", "--run-dir", "r"])
    assert code == 2
    assert err.strip() == "k3-train: error: --model: unknown model 'nope'; known models: k3"


def test_registering_checks_the_spec():
    with pytest.raises(ValueError, match="already registered"):
        register_model(get_model_spec("k3"))
    with pytest.raises(TypeError, match="must be a dataclass"):
        ModelSpec(name="x", config_class=dict, build=lambda config: config)
    with pytest.raises(ValueError, match="default_preset 'big' is not one of its presets"):
        dataclasses.replace(SPEC, default_preset="big")
    with pytest.raises(TypeError, match="preset 'odd' is not a ToyConfig"):
        dataclasses.replace(SPEC, presets={"odd": object()})
    with pytest.raises(ValueError, match="ToyConfig has no field"):
        SPEC.config(None, {"n_layers": 2})
    assert SPEC.config(None, {"d_model": 4}) == ToyConfig(d_model=4)
    assert SPEC.config(None, {}, recorded={"d_model": 5}) == ToyConfig(d_model=5)


def test_an_installed_package_declares_its_model_by_entry_point(monkeypatch):
    point = EntryPoint(name="toy", value="toy_model:SPEC", group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [point])
    try:
        assert "toy" in model_names()
        assert get_model_spec("toy") is SPEC
    finally:
        unregister_model("toy")
    broken = EntryPoint(name="gone", value="no_such_module:SPEC",
                        group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [broken])
    with pytest.raises(ConfigError, match="--model gone: no_such_module:SPEC cannot be loaded"):
        get_model_spec("gone")


class _Tracker(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_log(self, trainer, record):
        self.steps.append(record["step"])


def test_a_users_callback_joins_a_commands_run_in_one_place(data_dir, tmp_path):
    """The plan a request resolves holds its callbacks: a tracker is one more."""
    from k3_trainer.session import TrainRequest, execute, resolve

    tracker = _Tracker()
    plan = resolve(
        TrainRequest(
            tmp_path / "run",
            data=data_dir,
            train_fields={
                "batch_size": 2,
                "seq_len": 16,
                "eval_batches": 1,
                "max_steps": 3,
                "log_interval": 1,
            },
        )
    )
    plan = dataclasses.replace(plan, callbacks=(*plan.callbacks, tracker))
    assert execute(plan, torch.device("cpu"), None) == 0
    assert tracker.steps == [1, 2, 3]
