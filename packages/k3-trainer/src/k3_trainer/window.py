"""``TrainingWindow``: what one log interval summarizes, token-weighted."""

from __future__ import annotations

import math
from typing import Any

from k3_qkclip import QKClipReport

from .profiling import TrainingProfiler


class TrainingWindow:
    """Accumulates successful updates between two ``train`` events.

    Loss is weighted by tokens; gradient norms are the pre-clip norms of each update;
    tokens/s uses active training time only (evaluation and checkpoints excluded).
    """

    def __init__(self) -> None:
        self.qk_report: QKClipReport | None = None
        self._start_active = 0.0
        self.reset(None)

    def reset(self, profiler: TrainingProfiler | None) -> None:
        self.loss_sum = 0.0
        self.tokens = 0
        self.updates = 0
        self.skipped = 0
        self.grad_norms: list[float] = []
        self.lr = math.nan
        self.qk_report = None
        self._start_active = profiler.active_training_seconds() if profiler else 0.0

    def add(self, loss: float, tokens: int, grad_norm: float, lr: float) -> None:
        self.loss_sum += loss * tokens
        self.tokens += tokens
        self.updates += 1
        self.grad_norms.append(grad_norm)
        self.lr = lr

    def tokens_per_s(self, profiler: TrainingProfiler) -> float:
        seconds = profiler.active_training_seconds() - self._start_active
        return self.tokens / seconds if seconds > 0 else math.nan

    def summary(self, profiler: TrainingProfiler) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "loss": self.loss_sum / self.tokens if self.tokens else math.nan,
            "lr": self.lr,
            "grad_norm": sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms
            else math.nan,
            "grad_norm_max": max(self.grad_norms, default=math.nan),
            "updates_in_window": self.updates,
            "skipped_in_window": self.skipped,
            "tokens_per_s": self.tokens_per_s(profiler),
        }
        if self.qk_report is not None:
            fields.update(self.qk_report.to_metrics())
        return fields
