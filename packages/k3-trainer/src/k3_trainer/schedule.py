"""The learning rate as a function of the absolute successful-update number."""

from __future__ import annotations

import math
from collections.abc import Callable

from .config import TrainConfig


def learning_rate_at_step(config: TrainConfig, step: int) -> float:
    """LR for successful update ``step`` (1-based), from the absolute step alone.

    Linear warmup to ``peak_lr`` over ``warmup_steps``; then ``constant`` stays at the peak,
    ``cosine`` follows a half cosine from the peak at the warmup boundary down to
    ``min_lr_ratio·peak_lr`` at ``decay_steps``, and ``wsd`` (warmup-stable-decay) stays at
    the peak until ``decay_start`` and then decays to the floor over the last
    ``decay_fraction`` of ``decay_steps`` in ``decay_shape`` (``linear``; ``cosine``;
    ``1-sqrt``, which keeps the LR high longest). Past ``decay_steps`` the LR stays at the
    floor. Because only the absolute step matters, splitting a run into sessions (or
    raising ``max_steps`` on resume) neither restarts warmup nor moves the decay.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"learning_rate_at_step takes a 1-based successful step, got {step!r}")
    peak = config.peak_lr
    warmup, horizon = int(config.warmup_steps or 0), int(config.decay_steps or 0)
    if step <= warmup:
        return peak * step / warmup
    if config.lr_schedule == "constant":
        return peak
    floor = config.min_lr_ratio * peak
    if config.lr_schedule == "wsd":
        start = config.decay_start
        if step <= start:
            return peak
        return floor + (peak - floor) * _DECAY[config.decay_shape](
            min(1.0, (step - start) / config.decay_length))
    progress = min(1.0, (step - warmup) / (horizon - warmup))
    return floor + (peak - floor) * _DECAY["cosine"](progress)


_DECAY: dict[str, Callable[[float], float]] = {
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "1-sqrt": lambda progress: 1.0 - math.sqrt(progress),
}
"""The fraction of (peak − floor) left at ``progress`` ∈ [0, 1] of a decay."""


def horizon_notes(config: TrainConfig, *, horizon_unset: bool) -> list[str]:
    """One-line notes that make the decay horizon a visible decision (empty for
    ``constant``).

    ``horizon_unset``: this is a run's first session and ``decay_steps`` was not given, so
    it was just fixed at ``max_steps`` for every later session too. A ``wsd`` run's first
    session always says where its decay starts. Independently, a ``max_steps`` past
    ``decay_steps`` (a resume that extends the run) holds the LR at its floor for the extra
    steps, which is worth saying rather than leaving to a plot.
    """
    if config.lr_schedule == "constant":
        return []
    horizon = int(config.decay_steps or 0)
    floor = config.min_lr_ratio * config.peak_lr
    notes = []
    if horizon_unset:
        notes.append(
            f"{config.lr_schedule} LR horizon fixed at decay_steps={horizon} (this session's "
            "max_steps); later sessions keep it, so to plan a longer run split into sessions "
            "pass --decay-steps N (the planned total) now")
    if config.lr_schedule == "wsd" and (horizon_unset or config.max_steps > config.decay_start):
        notes.append(
            f"wsd: the LR stays at the peak {config.peak_lr:.4g} through step "
            f"{config.decay_start}, then decays ({config.decay_shape}) over "
            f"{config.decay_length} steps to {floor:.4g} at step {horizon}")
    if config.max_steps > horizon:
        notes.append(
            f"max_steps {config.max_steps} is past the {config.lr_schedule} horizon "
            f"decay_steps={horizon}: the LR stays at min_lr_ratio·peak_lr = {floor:.4g} from "
            f"step {horizon} on")
    return notes
