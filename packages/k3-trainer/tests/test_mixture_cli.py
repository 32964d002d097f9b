"""Mixtures, WSD and phases through ``k3-train``: sources recorded and resumed bitwise,
another mixture refused without a new phase, and a phase that changes the data and the
decay recorded where a user looks."""

from __future__ import annotations

import json

import pytest
import torch
from test_mixture import small_dir  # noqa: F401  (the module-scoped fixture)
from trainer_helpers import latest_checkpoint

from k3_checkpoint import read_payload
from k3_trainer import read_events
from k3_trainer.cli import main

RECIPE = ["--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--eval-interval",
          "2", "--checkpoint-interval", "2", "--log-interval", "1", "--lr-schedule", "wsd",
          "--decay-steps", "6", "--decay-fraction", "0.5", "--warmup-steps", "1",
          "--d-model", "32", "--n-layers", "2"]


def _run(capsys, argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _mix(data_dir, small):
    return ["--data", f"web={data_dir}:0.7", "--data", f"code={small}:0.3"]


def test_a_mixture_run_records_its_sources_and_resumes_bitwise(
        data_dir, small_dir, tmp_path, capsys):  # noqa: F811
    whole, split = tmp_path / "whole", tmp_path / "split"
    mix = _mix(data_dir, small_dir)
    code, _, err = _run(capsys, ["train", "--run-dir", whole, *mix, *RECIPE,
                                 "--max-steps", "6"])
    assert code == 0, err
    assert "wsd: the LR stays at the peak" in err
    assert _run(capsys, ["train", "--run-dir", split, *mix, *RECIPE, "--max-steps", "3"])[0] == 0
    code, _, err = _run(capsys, ["train", "--run-dir", split, "--resume", "--max-steps", "6"])
    assert code == 0, err
    ours, theirs = read_payload(latest_checkpoint(whole)), read_payload(latest_checkpoint(split))
    for name, value in ours["model"].items():
        assert torch.equal(value, theirs["model"][name]), name
    assert ours["loaders"] == theirs["loaders"]
    cursors = ours["loaders"]["train"]["sources"]
    assert set(cursors) == {"web", "code"} and ours["loaders"]["train"]["batches"] == 6

    record = json.loads((whole / "run.json").read_text())
    assert [s["name"] for s in record["data"]["sources"]] == ["web", "code"]
    events = read_events(whole / "metrics.jsonl")
    train = [e for e in events if e["event"] == "train"]
    assert sum(train[-1]["tokens_by_source"].values()) == train[-1]["tokens_seen"]
    # each window's training loss, source by source: together, weighted by the tokens each
    # source gave the window, they are the window's loss
    before = {"web": 0, "code": 0}
    for event in train:
        drawn = {name: event["tokens_by_source"][name] - before[name] for name in before}
        before = dict(event["tokens_by_source"])
        by_source = event["loss_by_source"]
        assert set(by_source) == {name for name, tokens in drawn.items() if tokens}
        assert sum(by_source[n] * drawn[n] for n in by_source) / sum(drawn.values()) == \
            pytest.approx(event["loss"], rel=1e-5)
    assert train[-1]["loss_by_source"]["web"] != train[-1]["loss_by_source"]["code"]
    evals = [e for e in events if e["event"] == "eval"]
    assert set(evals[-1]["val_by_source"]) == {"web", "code"}

    code, out, err = _run(capsys, ["eval", "--run-dir", whole, "--batches", "1"])
    assert code == 0, err
    lines = out.splitlines()
    assert "mixture by weight" in lines[0]
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["web", "code"]


def test_another_mixture_needs_a_new_phase_which_is_recorded(
        data_dir, small_dir, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    assert _run(capsys, ["train", "--run-dir", run, *_mix(data_dir, small_dir), *RECIPE,
                         "--max-steps", "2"])[0] == 0
    anneal = ["--data", f"code={small_dir}:1"]
    code, _, err = _run(capsys, ["train", "--run-dir", run, "--resume", *anneal,
                                 "--max-steps", "4"])
    assert code == 2 and "belongs to different data" in err and "--phase NAME" in err
    code, _, err = _run(capsys, ["train", "--run-dir", run, "--resume", "--decay-steps", "4",
                                 "--max-steps", "4"])
    assert code == 2 and "decay_steps" in err and "--phase NAME" in err

    code, _, err = _run(capsys, ["train", "--run-dir", run, "--resume", "--phase", "anneal",
                                 *anneal, "--decay-steps", "4", "--decay-fraction", "0.5",
                                 "--max-steps", "4"])
    assert code == 0, err
    assert "phase anneal starts at the checkpoint's step: it changes decay_steps, data" in err
    record = json.loads((run / "run.json").read_text())
    (phase,) = record["phases"]
    assert phase["name"] == "anneal" and phase["step"] == 2
    assert phase["changes"]["train_config.decay_steps"] == [6, 4]
    assert [s["name"] for s in phase["changes"]["data"][1]] == ["code"]
    starts = [e for e in read_events(run / "metrics.jsonl") if e["event"] == "phase_start"]
    assert [(e["name"], e["step"]) for e in starts] == [("anneal", 2)]
    train = [e for e in read_events(run / "metrics.jsonl") if e["event"] == "train"]
    assert train[-1]["lr"] == pytest.approx(3e-3 * 0.1)  # the decay's floor at step 4

    # The phase's own checkpoint resumes plainly; repeating --phase continues it.
    code, _, err = _run(capsys, ["train", "--run-dir", run, "--resume", "--max-steps", "5"])
    assert code == 0, err
    code, _, err = _run(capsys, ["train", "--run-dir", run, "--resume", "--phase", "anneal",
                                 "--max-steps", "6"])
    assert code == 0 and "phase anneal already started at step 2; it continues" in err
    assert len(json.loads((run / "run.json").read_text())["phases"]) == 1


def test_a_phase_needs_a_run_and_a_mixture_may_come_from_the_config_file(
        data_dir, small_dir, tmp_path, capsys):  # noqa: F811
    code, _, err = _run(capsys, ["train", "--run-dir", tmp_path / "new", "--phase", "anneal"])
    assert code == 2 and "--phase anneal needs --resume" in err
    (tmp_path / "mix.toml").write_text(
        f'[data.sources]\nweb = {{ path = "{data_dir}", weight = 3 }}\n'
        f'code = {{ path = "{small_dir}", weight = 1 }}\n')
    run = tmp_path / "toml"
    code, _, err = _run(capsys, ["train", "--run-dir", run, "--config", tmp_path / "mix.toml",
                                 *RECIPE, "--max-steps", "2"])
    assert code == 0, err
    sources = json.loads((run / "run.json").read_text())["data"]["sources"]
    assert [(s["name"], s["weight"]) for s in sources] == [("web", 3.0), ("code", 1.0)]
    code, _, err = _run(capsys, ["train", "--run-dir", tmp_path / "bad", "--data",
                                 f"web={data_dir}:1", "--data", str(small_dir)])
    assert code == 2 and "every source of a mixture as NAME=DIR:WEIGHT" in err


def test_a_phase_of_a_run_on_one_dataset_continues_its_cursor_or_changes_its_data(
        data_dir, small_dir, tmp_path, capsys):  # noqa: F811
    """One dataset becomes a mixture of one: the same data keeps its cursor (no data change
    recorded), other data starts a phase on it."""
    run = tmp_path / "run"
    assert _run(capsys, ["train", "--run-dir", run, "--data", data_dir, *RECIPE,
                         "--max-steps", "2"])[0] == 0
    before = read_payload(latest_checkpoint(run))["loaders"]["train"]["offset"]
    code, _, err = _run(capsys, ["train", "--run-dir", run, "--resume", "--phase", "decay",
                                 "--decay-steps", "4", "--decay-fraction", "0.5",
                                 "--max-steps", "3"])
    assert code == 0 and "it changes decay_steps" in err and "data" not in err.split(
        "it changes")[1].splitlines()[0], err
    state = read_payload(latest_checkpoint(run))["loaders"]["train"]
    assert state["sources"]["data"]["offset"] == before + 2 * 16  # one more batch
    code, _, err = _run(capsys, ["train", "--run-dir", run, "--resume", "--phase", "code",
                                 "--data", small_dir, "--max-steps", "4"])
    assert code == 0 and "it changes data" in err, err
    phases = json.loads((run / "run.json").read_text())["phases"]
    assert [p["name"] for p in phases] == ["decay", "code"]


def test_steps_kept_from_before_a_phase_stay_readable(
        data_dir, small_dir, tmp_path, capsys):  # noqa: F811
    """eval, sample, export and inspect of a step kept before a phase that changed the decay
    and the data read it with its own recipe; only a resume checks the data and recipe."""
    run = tmp_path / "run"
    assert _run(capsys, ["train", "--run-dir", run, *_mix(data_dir, small_dir), *RECIPE,
                         "--keep-every", "2", "--max-steps", "2"])[0] == 0
    code, _, err = _run(capsys, ["train", "--run-dir", run, "--resume", "--phase", "anneal",
                                 "--data", f"code={small_dir}:1", "--decay-steps", "4",
                                 "--decay-fraction", "0.5", "--max-steps", "4"])
    assert code == 0, err
    weights = read_payload(run / "checkpoints" / "step-00000002" / "k3.ckpt")["model"]
    code, out, err = _run(capsys, ["eval", "--run-dir", run, "--step", "2", "--batches", "1"])
    assert code == 0 and out.startswith("step 2: val_loss"), err
    code, out, err = _run(capsys, ["sample", "--run-dir", run, "--step", "2",
                                   "--max-new-tokens", "4", "--prompt", "def"])
    assert code == 0, err
    code, _, err = _run(capsys, ["export", "--run-dir", run, "--step", "2", "--out",
                                 tmp_path / "hub"])
    assert code == 0, err
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "hub" / "model.safetensors")
    assert any(torch.equal(v, weights["embed.weight"]) for v in exported.values())
    code, _, err = _run(capsys, ["inspect", run / "checkpoints" / "step-00000002"])
    assert code == 0, err
    # A resume from that step still checks what continuing needs: the data changed since.
    code, _, err = _run(capsys, ["train", "--run-dir", run, "--resume-from",
                                 run / "checkpoints" / "step-00000002",
                                 "--max-steps", "5"])
    assert code == 2 and "start a new phase" in err, err


def test_hints_follow_the_kind_of_refusal_not_its_wording(
        data_dir, small_dir, tmp_path, capsys, monkeypatch):  # noqa: F811
    """The train command picks its hints by the exception's type and fields: reworded
    refusals keep them."""
    import k3_checkpoint.compatibility as policy_module
    from k3_trainer.data.loader import DataMismatch
    from k3_trainer.data.mixture import MixtureLoader

    run = tmp_path / "run"
    assert _run(capsys, ["train", "--run-dir", run, *_mix(data_dir, small_dir), *RECIPE,
                         "--max-steps", "2"])[0] == 0

    calls = []
    restore = MixtureLoader.load_state_dict

    def reworded_data(self, state):
        calls.append(state)
        if len(calls) == 1:  # the saved state; the rollback's own state is taken
            raise DataMismatch("these cursors are for some other corpus")
        restore(self, state)

    monkeypatch.setattr(MixtureLoader, "load_state_dict", reworded_data)
    code, _, err = _run(capsys, ["train", "--run-dir", run, "--resume", "--max-steps", "4"])
    assert code == 2 and "some other corpus" in err
    assert "the run was trained on" in err and "--phase NAME" in err
    monkeypatch.undo()

    monkeypatch.setattr(policy_module, "_message", lambda refused, order: "the recipe moved")
    code, _, err = _run(capsys, ["train", "--run-dir", run, "--resume", "--decay-steps", "4",
                                 "--max-steps", "4"])
    assert code == 2 and "the recipe moved" in err and "--phase NAME" in err


def test_the_runtime_hint_follows_the_refused_section_not_the_wording(tmp_path):
    import k3_checkpoint
    from k3_trainer.cli.train import _with_runtime_hint
    from k3_trainer.session import TrainRequest

    command = TrainRequest(run_dir=tmp_path)
    runtime = k3_checkpoint.IncompatibleCheckpoint(
        "the machine is not the one it was", sections=("runtime",),
        paths=("runtime.num_threads",), path=tmp_path / "k3.ckpt")
    hinted = _with_runtime_hint(runtime, command)
    assert isinstance(hinted, k3_checkpoint.IncompatibleCheckpoint)
    assert str(hinted).endswith("pass --allow-runtime-change to continue anyway "
                                "(no bitwise promise)")
    assert hinted.path == runtime.path and hinted.sections == ("runtime",)
    other = k3_checkpoint.IncompatibleCheckpoint(
        "incompatible runtime — but in train_config", sections=("train_config",),
        paths=("train_config.peak_lr",))
    assert _with_runtime_hint(other, command) is other
