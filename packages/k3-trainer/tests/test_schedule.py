from __future__ import annotations

import itertools
import math

import pytest

from k3_trainer import ConfigError, TrainConfig, learning_rate_at_step
from k3_trainer.schedule import horizon_notes


def _cfg(**kw):
    base = dict(peak_lr=1e-2, warmup_steps=10, max_steps=100, decay_steps=100,
                min_lr_ratio=0.1, lr_schedule="cosine")
    return TrainConfig(**{**base, **kw})


def test_warmup_is_linear_to_the_peak_and_step_zero_is_rejected():
    cfg = _cfg()
    assert learning_rate_at_step(cfg, 1) == pytest.approx(1e-3)
    assert learning_rate_at_step(cfg, 5) == pytest.approx(5e-3)
    assert learning_rate_at_step(cfg, 10) == pytest.approx(1e-2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="1-based"):
            learning_rate_at_step(cfg, bad)


def test_cosine_boundaries_and_floor():
    cfg = _cfg()
    assert learning_rate_at_step(cfg, 55) == pytest.approx(1e-3 + 9e-3 * 0.5)  # halfway
    assert learning_rate_at_step(cfg, 100) == pytest.approx(1e-3)
    assert learning_rate_at_step(cfg, 500) == pytest.approx(1e-3)  # stays at the floor
    lrs = [learning_rate_at_step(cfg, s) for s in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_constant_holds_the_peak_after_warmup():
    cfg = _cfg(lr_schedule="constant")
    assert [learning_rate_at_step(cfg, s) for s in (10, 11, 1000)] == [1e-2] * 3


def test_sessions_and_a_raised_max_steps_do_not_move_the_schedule():
    """The LR depends on the absolute step only: an interrupted run (max_steps 40, then
    resumed to 100, then extended to 150) sees exactly the uninterrupted run's LRs."""
    whole = _cfg(max_steps=100)
    first, second = whole.replace(max_steps=40), whole.replace(max_steps=100)
    extended = whole.replace(max_steps=150)
    expected = [learning_rate_at_step(whole, s) for s in range(1, 101)]
    got = [learning_rate_at_step(first, s) for s in range(1, 41)]
    got += [learning_rate_at_step(second, s) for s in range(41, 101)]
    assert got == expected
    assert learning_rate_at_step(extended, 120) == learning_rate_at_step(whole, 120)


def test_decay_horizon_defaults_to_max_steps_once():
    cfg = TrainConfig(max_steps=70, warmup_steps=5)
    assert cfg.decay_steps == 70
    resumed = TrainConfig.from_dict({**cfg.to_dict(), "max_steps": 200})
    assert resumed.decay_steps == 70
    assert math.isclose(learning_rate_at_step(resumed, 70), cfg.min_lr_ratio * cfg.peak_lr)


def test_warmup_defaults_from_the_planned_horizon_not_the_session_length():
    """A first session of 3 steps with the planned --decay-steps 100 warms up like the
    uninterrupted 100-step run, so the two follow one LR schedule step for step."""
    session = TrainConfig(max_steps=3, decay_steps=100)
    whole = TrainConfig(max_steps=100)
    assert session.warmup_steps == whole.warmup_steps == 10
    assert TrainConfig(max_steps=1000).warmup_steps == 20  # capped
    resumed = TrainConfig.from_dict({**session.to_dict(), "max_steps": 100})
    assert [learning_rate_at_step(resumed, s) for s in range(1, 101)] == [
        learning_rate_at_step(whole, s) for s in range(1, 101)]


@pytest.mark.parametrize("shape, quarter", [("linear", 0.75), ("cosine", 0.5 * (1 + math.cos(
    math.pi / 4))), ("1-sqrt", 0.5)])
def test_wsd_is_warmup_then_the_peak_then_a_decay_over_the_last_fraction(shape, quarter):
    """decay_fraction 0.2 of 100 steps: the peak through step 80, the floor at 100."""
    cfg = _cfg(lr_schedule="wsd", decay_fraction=0.2, decay_shape=shape)
    assert (cfg.decay_start, cfg.decay_length) == (80, 20)
    assert learning_rate_at_step(cfg, 5) == pytest.approx(5e-3)  # warmup as for cosine
    assert [learning_rate_at_step(cfg, s) for s in (10, 11, 50, 80)] == [1e-2] * 4
    assert learning_rate_at_step(cfg, 81) < 1e-2
    assert learning_rate_at_step(cfg, 85) == pytest.approx(1e-3 + 9e-3 * quarter)
    assert learning_rate_at_step(cfg, 100) == pytest.approx(1e-3)
    assert learning_rate_at_step(cfg, 400) == pytest.approx(1e-3)
    lrs = [learning_rate_at_step(cfg, s) for s in range(80, 101)]
    assert all(a > b for a, b in itertools.pairwise(lrs))


def test_wsd_refuses_a_decay_of_no_step_or_one_that_starts_in_warmup():
    with pytest.raises(ConfigError, match="less than one step"):
        _cfg(lr_schedule="wsd", decay_fraction=0.001)
    with pytest.raises(ConfigError, match=r"must end by the wsd decay's start \(step 90"):
        _cfg(lr_schedule="wsd", decay_fraction=0.1, warmup_steps=91)
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ConfigError, match="decay_fraction"):
            _cfg(lr_schedule="wsd", decay_fraction=bad)
    with pytest.raises(ConfigError, match="decay_shape must be one of linear, cosine, 1-sqrt"):
        _cfg(lr_schedule="wsd", decay_shape="exp")
    assert _cfg(lr_schedule="wsd", decay_fraction=1.0, warmup_steps=0).decay_start == 0


def test_the_wsd_fields_are_recorded_only_when_they_differ_from_their_defaults():
    """An earlier run's recorded config (without them) still compares equal on resume."""
    plain = _cfg()
    assert "decay_fraction" not in plain.to_dict() and "decay_shape" not in plain.to_dict()
    assert TrainConfig.from_dict(plain.to_dict()) == plain
    wsd = _cfg(lr_schedule="wsd", decay_fraction=0.1, decay_shape="linear")
    assert wsd.to_dict()["decay_fraction"] == 0.1 and wsd.to_dict()["decay_shape"] == "linear"
    assert TrainConfig.from_dict(wsd.to_dict()) == wsd


def test_wsd_announces_where_its_decay_starts():
    notes = horizon_notes(_cfg(lr_schedule="wsd"), horizon_unset=True)
    assert any("stays at the peak 0.01 through step 80, then decays (1-sqrt) over 20 steps "
               "to 0.001 at step 100" in note for note in notes)
