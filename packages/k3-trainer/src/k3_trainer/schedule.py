"""The learning rate as a function of the absolute successful-update number, and the
arithmetic a new phase needs: whether it jumps the LR at its starting step, and which
``decay_fraction``/``decay_steps`` would continue at the run's LR instead."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .config import ConfigError, TrainConfig


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


LR_TOLERANCE = 1e-6
"""The relative difference below which two learning rates are the same (a phase that keeps
its run's LR within it continues smoothly and is not warned about)."""

SCHEDULE_FIELDS = (
    "lr_schedule",
    "decay_steps",
    "decay_fraction",
    "decay_shape",
    "min_lr_ratio",
    "peak_lr",
    "warmup_steps",
)
"""The train config's fields that :func:`learning_rate_at_step` reads."""


def phase_lr_warning(phase: str, before: TrainConfig, after: TrainConfig, step: int) -> str | None:
    """One line when phase ``phase``, starting from the checkpoint at ``step``, jumps the
    learning rate: the run's schedule (``before``) and the phase's (``after``) give
    different LRs at ``step``. It says by how much and names a ``decay_fraction`` or
    ``decay_steps`` (the user's other values kept) that would continue at the run's LR,
    each checked with the schedule itself; None when the LR is continuous."""
    if step < 1:
        return None
    old, new = learning_rate_at_step(before, step), learning_rate_at_step(after, step)
    if _same_lr(old, new):
        return None
    if old:
        percent = (new - old) / old * 100
        jump = f"{percent:+.1f}%" if abs(percent) >= 0.1 else f"{percent:+.2g}%"
    else:
        jump = "from zero"
    return (
        f"phase {phase} jumps the learning rate at the checkpoint's step {step}: "
        f"{old:.4g} (the run's schedule) → {new:.4g} (the phase's), {jump}; "
        f"{_lr_advice(before, after, step, old)}"
    )


def _same_lr(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=LR_TOLERANCE)


def _lr_advice(before: TrainConfig, after: TrainConfig, step: int, lr: float) -> str:
    """How to continue at ``lr``, the run's LR at ``step``: the flags that would (verified
    with :func:`learning_rate_at_step`), the phase's other values kept."""

    def keeps(changes: dict[str, Any]) -> bool:
        try:
            config = after.replace(**changes)
        except ConfigError:
            return False
        return _same_lr(learning_rate_at_step(config, step), lr)

    horizon, fraction = int(after.decay_steps or 0), after.decay_fraction
    if after.lr_schedule in ("wsd", "cosine"):
        # A WSD decay that starts at or after the step continues a run at its peak there;
        # a cosine has left the peak since warmup, so only WSD can.
        wsd: dict[str, Any] = {} if after.lr_schedule == "wsd" else {"lr_schedule": "wsd"}
        switch = "" if not wsd else "--lr-schedule wsd "
        options = []
        share = _fraction_starting_at(after.replace(**wsd), step)
        if share is not None and keeps({**wsd, "decay_fraction": float(share)}):
            options.append(
                f"{switch}--decay-fraction {share} (with decay_steps {horizon}: "
                f"the decay then starts at step {step})"
            )
        steps = _horizon_starting_at(after.replace(**wsd), step)
        if steps is not None and keeps({**wsd, "decay_steps": steps}):
            options.append(f"{switch}--decay-steps {steps} (with decay_fraction {fraction})")
        if options:
            why = "a cosine decay leaves the peak when warmup ends, so use wsd: " if wsd else ""
            return (
                f"to continue at {lr:.4g}, {why}the wsd decay must start at or after "
                f"step {step} (decay_steps − round(decay_fraction·decay_steps) ≥ "
                f"{step}): pass {' or '.join(options)}"
            )
    if keeps({"decay_steps": step}):
        return (
            f"to stay at the floor {lr:.4g}, the decay must have ended by step {step}: "
            f"pass --decay-steps {step}"
        )
    # Mid-decay (or another floor): only the run's own decay gives its LR there.
    kept = {
        name: getattr(before, name)
        for name in SCHEDULE_FIELDS
        if getattr(before, name) != getattr(after, name)
    }
    flags = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in kept.items())
    where = (
        f"the run was in its decay at step {step}: "
        if before.lr_schedule != "constant"
        and step < int(before.decay_steps or 0)
        and lr < before.peak_lr
        else ""
    )
    return f"{where}to continue at {lr:.4g}, keep the run's decay" + (
        f" ({flags})" if kept and keeps(kept) else ""
    )


def _fraction_starting_at(config: TrainConfig, step: int) -> str | None:
    """The ``decay_fraction`` (as written on a command line: the shortest decimal of at
    least 6 digits that works) whose WSD decay starts at ``step``, ``decay_steps`` kept;
    None when ``decay_steps`` is not past ``step``."""
    horizon = int(config.decay_steps or 0)
    if horizon <= step:
        return None
    exact = (horizon - step) / horizon
    for digits in range(6, 18):
        text = f"{exact:.{digits}g}"
        if _decay_start(config, decay_fraction=float(text)) == step:
            return text
    return None


def _horizon_starting_at(config: TrainConfig, step: int) -> int | None:
    """The smallest ``decay_steps`` whose WSD decay starts at or after ``step``,
    ``decay_fraction`` kept; None when there is none (a fraction of 1 starts at step 0)."""
    if config.decay_fraction >= 1.0:
        return None
    # decay_start = decay_steps − round(decay_fraction·decay_steps) never decreases as
    # decay_steps grows: start just below the estimate and walk up.
    estimate = math.floor(step / (1.0 - config.decay_fraction))
    for steps in range(max(step + 1, estimate - 2), estimate + 1000):
        start = _decay_start(config, decay_steps=steps)
        if start is not None and start >= step:
            return steps
    return None


def _decay_start(config: TrainConfig, **changes: Any) -> int | None:
    """``config``'s WSD ``decay_start`` with ``changes``, or None when they are invalid."""
    try:
        return config.replace(**changes).decay_start
    except ConfigError:
        return None
