"""The learning rate as a function of the absolute successful-update number."""

from __future__ import annotations

import math

from .config import TrainConfig


def learning_rate_at_step(config: TrainConfig, step: int) -> float:
    """LR for successful update ``step`` (1-based), from the absolute step alone.

    Linear warmup to ``peak_lr`` over ``warmup_steps``; then ``constant`` stays at the peak
    and ``cosine`` follows a half cosine from the peak at the warmup boundary down to
    ``min_lr_ratio·peak_lr`` at ``decay_steps`` and stays there. Because only the absolute
    step matters, splitting a run into sessions (or raising ``max_steps`` on resume)
    neither restarts warmup nor moves the decay horizon.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"learning_rate_at_step takes a 1-based successful step, got {step!r}")
    peak = config.peak_lr
    warmup, horizon = int(config.warmup_steps or 0), int(config.decay_steps or 0)
    if step <= warmup:
        return peak * step / warmup
    if config.lr_schedule == "constant":
        return peak
    progress = min(1.0, (step - warmup) / (horizon - warmup))
    floor = config.min_lr_ratio * peak
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
