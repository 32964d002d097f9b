"""Clauses of the training contract (docs/training-contract.md) that each break a test here
when the code stops keeping them: every one was a mutation of trainer.py, precision.py,
profiling.py or optim.py that no other test noticed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from trainer_helpers import MLA_MOE_MODEL, InjectAt, build_parts, fit, train_config

from k3_trainer import (
    ConfigError,
    FP16SkipHarness,
    MetricsLog,
    Trainer,
    build_optimizer,
    learning_rate_at_step,
    validate_precision,
)
from k3_trainer.interrupt import TrainingInterrupted

# No MoE: the balancer updates on every forward, which would make two forwards of one
# batch differ; these clauses are about the loop, not the router.
DENSE = MLA_MOE_MODEL.replace(mlp="dense")


class Spy(nn.Module):
    """Wraps a model and records, per training forward, the mode and autocast it saw."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config
        self.seen: list[tuple[bool, bool, torch.dtype]] = []
        self.on_forward = None

    def forward(self, x, targets=None):
        self.seen.append((self.training, torch.is_autocast_enabled("cpu"),
                          torch.get_autocast_dtype("cpu")))
        if self.on_forward is not None:
            self.on_forward(len(self.seen))
        return self.inner(x, targets=targets)


def _first_grad_norm(log: MetricsLog) -> float:
    return next(e["grad_norm"] for e in log.events if e["event"] == "train")


def test_the_learning_rate_is_set_on_every_parameter_group(data_dir):
    config = train_config(max_steps=3, warmup_steps=2, decay_steps=3)
    model, opt, tl, vl = build_parts(config, data_dir)
    assert len(opt.param_groups) > 2
    fit(model, opt, (tl, vl), config)
    expected = learning_rate_at_step(config, 3)
    assert [g["lr"] for g in opt.param_groups] == [expected] * len(opt.param_groups)


def test_the_loss_is_divided_by_the_accumulation_steps(data_dir):
    """One batch accumulated twice (overfit mode) gives the gradient of the batch once."""
    norms = []
    for accumulation in (1, 2):
        config = train_config(max_steps=1, log_interval=1, overfit_batch=True,
                              gradient_accumulation_steps=accumulation)
        model, opt, tl, vl = build_parts(config, data_dir, model_config=DENSE)
        log = MetricsLog(None)
        fit(model, opt, (tl, vl), config, callbacks=[log])
        norms.append(_first_grad_norm(log))
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)


def test_the_logged_gradient_norm_is_the_norm_before_clipping(data_dir):
    config = train_config(max_steps=1, log_interval=1, max_grad_norm=1e-6)
    model, opt, tl, vl = build_parts(config, data_dir)
    log = MetricsLog(None)
    fit(model, opt, (tl, vl), config, callbacks=[log])
    assert _first_grad_norm(log) > 1e-3


def test_bf16_runs_the_forward_under_bf16_autocast_and_fp32_under_none(data_dir):
    for precision, enabled in (("bf16", True), ("fp32", False)):
        config = train_config(max_steps=1, precision=precision)
        model, opt, tl, vl = build_parts(config, data_dir)
        spy = Spy(model)
        fit(spy, opt, (tl, vl), config)
        training, autocast_on, dtype = spy.seen[0]
        assert autocast_on is enabled, precision
        if enabled:
            assert dtype == torch.bfloat16


def test_fit_puts_the_model_in_training_mode_and_clears_stale_gradients(data_dir):
    config = train_config(max_steps=1, log_interval=1)
    norms = []
    for stale in (False, True):
        model, opt, tl, vl = build_parts(config, data_dir)
        spy = Spy(model).eval()
        if stale:
            for p in model.parameters():
                p.grad = torch.full_like(p, 1e3)
        log = MetricsLog(None)
        fit(spy, opt, (tl, vl), config, callbacks=[log])
        assert spy.seen[0][0] is True  # trained in training mode, though handed in eval
        norms.append(_first_grad_norm(log))
    assert norms[1] == norms[0]


def test_the_attempt_clock_counts_skipped_attempts_too(data_dir):
    config = train_config(max_steps=3)
    model, opt, tl, vl = build_parts(config, data_dir)
    log = MetricsLog(None)
    trainer = fit(InjectAt(model, calls={2}), opt, (tl, vl), config, callbacks=[log],
                  grad_scaler=FP16SkipHarness(init_scale=2.0**10, growth_interval=1000))
    assert trainer.state.skipped_updates == 1
    assert trainer.profiler.attempts == 4
    assert next(e for e in log.events if e["event"] == "session_end")["attempts"] == 4


@pytest.mark.parametrize("dtype", ["fp64", "bf16"])
def test_the_configured_newton_schulz_dtype_reaches_the_optimizer(data_dir, dtype):
    config = train_config(muon_ns_dtype=dtype)
    model, _, _, _ = build_parts(config, data_dir)
    optimizer = build_optimizer(model, config)
    muon = [g for g in optimizer.param_groups if g.get("use_muon")]
    assert muon and {g["ns_dtype"] for g in muon} == {dtype}


@pytest.mark.parametrize("precision", ["fp8", "FP32", "", "int8"])
def test_an_unknown_precision_is_refused(precision):
    with pytest.raises(ConfigError, match="precision"):
        validate_precision(precision, torch.device("cpu"))


def test_a_stop_requested_inside_an_attempt_finishes_its_accumulation(data_dir, tmp_path):
    """The stop is honoured at the update boundary: all three microbatches of the attempt
    under way are read, backpropagated and counted, and the update happens."""
    config = train_config(max_steps=4, gradient_accumulation_steps=3)
    model, opt, tl, vl = build_parts(config, data_dir)
    spy = Spy(model)
    trainer = Trainer(spy, opt, (tl, vl), config, checkpoint_path=tmp_path / "ck.pt")
    spy.on_forward = lambda calls: trainer.request_stop() if calls == 2 else None
    with pytest.raises(TrainingInterrupted):
        trainer.fit()
    training_forwards = sum(1 for training, _, _ in spy.seen if training)
    assert training_forwards == 3 and trainer.state.step == 1
    assert trainer.state.tokens_seen == config.tokens_per_update


