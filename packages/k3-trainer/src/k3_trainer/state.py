"""``TrainState``: the counters that persist across sessions, a checkpoint component itself;
``ScalerState``: the loss scaler as one.

``step`` counts successful optimizer updates; ``tokens_seen`` counts every consumed
microbatch, including attempts whose update an FP16 overflow later skipped. Both restore
from a checkpoint through ``load_state_dict``, which judges the saved values before it
takes any: a checkpoint's components are all validated before any is restored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

_COUNTS = ("step", "tokens_seen", "skipped_updates")
_SCALER_FLOATS = ("scale", "growth_factor", "backoff_factor")
_SCALER_INTS = ("growth_interval", "_growth_tracker")


@dataclass
class TrainState:
    """The counters of a run (checkpointed as ``counters``)."""

    step: int = 0
    tokens_seen: int = 0
    fixed_batch_offset: int | None = None
    skipped_updates: int = 0
    fixed_batch_limit: int | None = field(default=None, repr=False, compare=False)
    """The last offset at which the training data holds a complete batch, set by the
    trainer in overfit mode; a restored ``fixed_batch_offset`` past it is refused."""

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen,
                "skipped_updates": self.skipped_updates,
                "fixed_batch_offset": self.fixed_batch_offset}

    def load_state_dict(self, saved: Any, /) -> None:
        """Take the saved counters, or raise ``ValueError`` naming what is malformed."""
        if not isinstance(saved, Mapping):
            raise ValueError(f"counters must be a mapping, got {type(saved).__name__}")
        missing = [name for name in _COUNTS if name not in saved]
        if missing:
            raise ValueError(f"counters lack {missing}")
        bad = [f"{name}={saved[name]!r}" for name in _COUNTS if not _is_count(saved[name])]
        offset = saved.get("fixed_batch_offset")
        if offset is not None and not _is_count(offset):
            bad.append(f"fixed_batch_offset={offset!r}")
        if bad:
            raise ValueError(f"counters must be non-negative integers: {', '.join(bad)}")
        limit = self.fixed_batch_limit
        if limit is not None and offset is not None and offset > limit:
            raise ValueError(f"fixed_batch_offset {offset} does not name a complete batch of "
                             f"the training data (0..{limit})")
        for name in _COUNTS:
            setattr(self, name, saved[name])
        self.fixed_batch_offset = offset



class ScalerState:
    """The run's loss scaler as its own checkpoint component, read from the live scaler
    whenever a checkpoint is written (so no copy of it can go stale): an enabled scaler's
    ``state_dict()``, or ``None`` for no loss scaling. A saved state is checked field by
    field before the scaler takes it, so a forged scale never reaches it; a checkpoint
    without one leaves the scaler as it is."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler.is_enabled() else None

    def load_state_dict(self, saved: Any, /) -> None:
        if saved is None:
            return
        check_grad_scaler_state(saved)
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(dict(saved))


def check_grad_scaler_state(saved: Any) -> None:
    """Raise ``ValueError`` unless ``saved`` is an enabled GradScaler's ``state_dict()``:
    exactly its five fields, a finite positive scale, growth > 1, 0 < backoff < 1 and
    non-negative integer counters."""
    if not isinstance(saved, Mapping):
        raise ValueError(f"grad_scaler must be a mapping or None, got {type(saved).__name__}")
    expected = {*_SCALER_FLOATS, *_SCALER_INTS}
    if set(saved) != expected:
        raise ValueError(f"grad_scaler must hold exactly {sorted(expected)}, got "
                         f"{sorted(map(str, saved))}")
    bad = [f"{name}={saved[name]!r}" for name in _SCALER_FLOATS
           if not (_is_number(saved[name]) and math.isfinite(saved[name]) and saved[name] > 0)]
    bad += [f"{name}={saved[name]!r}" for name in _SCALER_INTS if not _is_count(saved[name])]
    if not bad and not saved["growth_factor"] > 1.0:
        bad.append(f"growth_factor={saved['growth_factor']!r} (must be > 1)")
    if not bad and not saved["backoff_factor"] < 1.0:
        bad.append(f"backoff_factor={saved['backoff_factor']!r} (must be < 1)")
    if not bad and saved["growth_interval"] < 1:
        bad.append(f"growth_interval={saved['growth_interval']!r} (must be >= 1)")
    if bad:
        raise ValueError(f"grad_scaler state is malformed: {', '.join(bad)}")


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
