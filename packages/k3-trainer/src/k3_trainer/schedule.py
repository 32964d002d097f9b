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


def horizon_notes(config: TrainConfig, *, horizon_unset: bool) -> list[str]:
    """One-line notes that make the cosine horizon a visible decision (empty otherwise).

    ``horizon_unset``: this is a run's first session and ``decay_steps`` was not given, so
    it was just fixed at ``max_steps`` for every later session too. Independently, a
    ``max_steps`` past ``decay_steps`` (a resume that extends the run) holds the LR at its
    floor for the extra steps, which is worth saying rather than leaving to a plot.
    """
    if config.lr_schedule != "cosine":
        return []
    horizon = int(config.decay_steps or 0)
    floor = config.min_lr_ratio * config.peak_lr
    notes = []
    if horizon_unset:
        notes.append(
            f"cosine LR horizon fixed at decay_steps={horizon} (this session's max_steps); "
            "later sessions keep it, so to plan a longer run split into sessions pass "
            "--decay-steps N (the planned total) now")
    if config.max_steps > horizon:
        notes.append(
            f"max_steps {config.max_steps} is past the cosine horizon decay_steps={horizon}: "
            f"the LR stays at min_lr_ratio·peak_lr = {floor:.4g} from step {horizon} on")
    return notes
