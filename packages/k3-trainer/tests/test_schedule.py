from __future__ import annotations

import itertools
import math

import pytest

from k3_trainer import TrainConfig, learning_rate_at_step


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
