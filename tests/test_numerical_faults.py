"""Guarantee 5: numerical faults stop the run loudly and lose nothing that was saved.

- a NaN loss at step k raises ``FloatingPointError`` naming step k (the CLI: one line,
  exit status 1); the last checkpoint is intact, loadable, and resuming from it ends
  bitwise equal to a run that never failed;
- a non-finite QK-Clip observation is refused before any weight or optimizer state
  changes;
- 32 consecutive skipped (overflowed) updates raise, 31 do not.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from harness import (
    Inject,
    assert_bitwise_equal,
    build_run,
    latest_checkpoint,
    refusal_lines,
    train_config,
)

from k3_checkpoint import read_payload
from k3_model import K3Model
from k3_trainer import FP16SkipHarness, Trainer, read_events
from k3_trainer.cli import main
from k3_trainer.models import get_model_spec, registry


def _params(model) -> dict[str, torch.Tensor]:
    inner = getattr(model, "inner", model)
    return {name: p.detach().clone() for name, p in inner.named_parameters()}


def _clean_run(config, data_dir, steps):
    """The same run without the fault, stopped after ``steps`` updates."""
    model, opt, tl, vl = build_run(config, data_dir)
    Trainer(model, opt, (tl, vl), config.replace(max_steps=steps)).fit()
    return model, opt


def _assert_same_update_state(model_a, opt_a, model_b, opt_b) -> None:
    a, b = _params(model_a), _params(model_b)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert_bitwise_equal(opt_a.state_dict()["state"], opt_b.state_dict()["state"], "opt")


@pytest.fixture
def nan_at_step_4(monkeypatch):
    """The CLI's model, poisoned: the 4th training forward returns a NaN loss."""

    class PoisonedK3Model(K3Model):
        def forward(self, x, targets=None):
            logits, loss = super().forward(x, targets)
            if self.training:
                self.calls = getattr(self, "calls", 0) + 1
                if self.calls == 4:
                    loss = loss * math.nan
            return logits, loss

    # Through monkeypatch, so the test's monkeypatch.undo() takes the fault away.
    poisoned = dataclasses.replace(get_model_spec("k3"), build=PoisonedK3Model)
    monkeypatch.setitem(registry._registered, "k3", poisoned)


def test_nan_loss_stops_the_cli_in_one_line_and_the_last_checkpoint_resumes(
        tmp_path, data_dir, small_toml, capsys, monkeypatch, nan_at_step_4):
    run, clean = tmp_path / "run", tmp_path / "clean"
    flags = ["--data", str(data_dir), "--config", str(small_toml), "--checkpoint-interval",
             "1", "--warmup-steps", "1", "--decay-steps", "6"]
    capsys.readouterr()
    code = main(["train", "--run-dir", str(run), *flags, "--max-steps", "6"])
    err = refusal_lines(capsys.readouterr().err)
    assert code == 1
    assert err == ["k3-train: training diverged: Non-finite training loss at step 4"]
    # no .tmp left behind, and only the latest checkpoint kept (keep_last 1)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest",
                                                                      "step-00000003"]
    assert [e["step"] for e in read_events(run / "metrics.jsonl")
            if e["event"] == "checkpoint"] == [1, 2, 3]
    saved = read_payload(latest_checkpoint(run))
    assert saved["counters"]["step"] == 3

    monkeypatch.undo()  # the fault is gone: resume the failed run, and run a clean one
    assert main(["train", "--run-dir", str(run), "--resume"]) == 0
    assert main(["train", "--run-dir", str(clean), *flags, "--max-steps", "6"]) == 0
    assert_bitwise_equal(read_payload(latest_checkpoint(clean)),
                         read_payload(latest_checkpoint(run)))


def test_nan_loss_names_its_step_and_leaves_a_loadable_checkpoint(tmp_path, data_dir):
    config = train_config(max_steps=6, checkpoint_interval=1)
    model, opt, tl, vl = build_run(config, data_dir)
    trainer = Trainer(Inject(model, calls={5}, kind="nan_loss"), opt, (tl, vl), config,
                      checkpoint_path=tmp_path / "ck.pt")
    state = trainer.state
    with pytest.raises(FloatingPointError, match=r"Non-finite training loss at step 5$"):
        trainer.fit()
    assert state.step == 4
    clean_model, clean_opt = _clean_run(config, data_dir, 4)
    _assert_same_update_state(model, opt, clean_model, clean_opt)  # step 5 changed nothing

    fresh_model, fresh_opt, ftl, fvl = build_run(config, data_dir, seed=99)
    restoring = Trainer(Inject(fresh_model), fresh_opt, (ftl, fvl), config)
    restoring.resume(tmp_path / "ck.pt")
    restored = restoring.state
    assert restored.step == 4 and ftl.offset == 4 * config.tokens_per_update
    _assert_same_update_state(fresh_model, fresh_opt, clean_model, clean_opt)


@pytest.mark.parametrize("kind", ["qk_inf", "qk_nan"])
def test_non_finite_qk_observation_is_refused_before_any_weight_changes(kind, tmp_path,
                                                                         data_dir):
    config = train_config(max_steps=6, checkpoint_interval=1, qk_clip_tau=0.01)
    model, opt, tl, vl = build_run(config, data_dir)
    trainer = Trainer(Inject(model, calls={3}, kind=kind), opt, (tl, vl), config,
                      checkpoint_path=tmp_path / "ck.pt")
    state = trainer.state
    with pytest.raises(FloatingPointError, match="QK-Clip: non-finite max pre-softmax logit"):
        trainer.fit()
    assert state.step == 2
    clean_model, clean_opt = _clean_run(config, data_dir, 2)
    # Weights and optimizer state are exactly those after update 2: neither the optimizer
    # step nor the clip of attempt 3 ran. (The MoE balancer's buffers did move: they
    # update in every training forward, by the spec.)
    _assert_same_update_state(model, opt, clean_model, clean_opt)
    assert read_payload(tmp_path / "ck.pt")["counters"]["step"] == 2


def _scaler() -> torch.amp.GradScaler:
    return FP16SkipHarness(init_scale=2.0**10, growth_interval=1000)


def test_32_consecutive_skips_raise_and_keep_the_last_checkpoint(tmp_path, data_dir):
    config = train_config(max_steps=6, checkpoint_interval=1)
    model, opt, tl, vl = build_run(config, data_dir)
    trainer = Trainer(Inject(model, calls=set(range(3, 200))), opt, (tl, vl), config,
                      grad_scaler=_scaler(), checkpoint_path=tmp_path / "ck.pt")
    state = trainer.state
    with pytest.raises(FloatingPointError, match="32 consecutive FP16 overflows at step 3"):
        trainer.fit()
    assert (state.step, state.skipped_updates) == (2, 32)
    assert state.tokens_seen == (2 + 32) * config.tokens_per_update
    clean_model, clean_opt = _clean_run(config, data_dir, 2)
    _assert_same_update_state(model, opt, clean_model, clean_opt)
    assert read_payload(tmp_path / "ck.pt")["counters"] == {
        "step": 2, "tokens_seen": 2 * config.tokens_per_update, "skipped_updates": 0,
        "fixed_batch_offset": None}


def test_31_consecutive_skips_recover(data_dir):
    config = train_config(max_steps=4, checkpoint_interval=100)
    model, opt, tl, vl = build_run(config, data_dir)
    trainer = Trainer(Inject(model, calls=set(range(3, 34))), opt, (tl, vl), config,
                      grad_scaler=_scaler())
    state = trainer.fit()
    assert (state.step, state.skipped_updates) == (4, 31)
    assert trainer.scaler.state_dict()["scale"] == 2.0**10 / 2**31
