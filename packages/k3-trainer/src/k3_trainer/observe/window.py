"""``TrainingWindow``: what one log interval summarizes, as flat, self-describing fields.

Loss is token-weighted; gradient norms are the pre-clip norms of each successful update;
tokens/s counts active training time only (evaluation and checkpoints excluded); QK-Clip
statistics are folded on the device per update and read once per window; MFU uses the
model's FLOPs per token and a peak-FLOPS table, and is ``None`` on a device the table
does not know (never guessed).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from k3_qkclip import QKClipReport

from .profiling import TrainingProfiler

# Dense (non-sparse) peak tensor throughput in TFLOP/s by device-name fragment and
# autocast precision, from the vendors' data sheets. fp32 uses TF32 where torch allows it.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 183.0},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 60.0},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 35.0},
    "RTX 4090": {"bf16": 165.0, "fp16": 165.0, "fp32": 83.0},
}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s for ``device`` at ``precision``; None when the device is not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, table in PEAK_TFLOPS.items():
        if fragment in name:
            return table[precision] * 1e12
    return None


class TrainingWindow:
    """Accumulates successful updates between two ``train`` events."""

    def __init__(self, device: torch.device | str = "cpu", *, precision: str = "fp32",
                 flops_per_token: float | None = None) -> None:
        self.device = torch.device(device)
        self.flops_per_token = flops_per_token
        self.peak = peak_flops(self.device, precision)
        self.reset(None)

    def reset(self, profiler: TrainingProfiler | None) -> None:
        self.loss_sum = 0.0
        self.tokens = 0
        self.updates = 0
        self.skipped = 0
        self.grad_norms: list[float] = []
        self.lr = math.nan
        self._qk_max: dict[str, torch.Tensor] = {}
        self._qk_clipped: torch.Tensor | None = None
        self._qk_min_gamma: torch.Tensor | None = None
        self._start_active = profiler.active_training_seconds() if profiler else 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def add(self, loss: float, tokens: int, grad_norm: float, lr: float) -> None:
        self.loss_sum += loss * tokens
        self.tokens += tokens
        self.updates += 1
        self.grad_norms.append(grad_norm)
        self.lr = lr

    def add_qk(self, report: QKClipReport) -> None:
        """Fold one update's QK-Clip report in on the device (no host sync)."""
        for name, module in report.modules.items():
            seen = self._qk_max.get(name)
            self._qk_max[name] = module.max_logits.max() if seen is None else torch.maximum(
                seen, module.max_logits.max())
            clipped = (module.gammas < 1).sum()
            self._qk_clipped = clipped if self._qk_clipped is None else self._qk_clipped + clipped
            low = module.gammas.min()
            self._qk_min_gamma = low if self._qk_min_gamma is None else torch.minimum(
                self._qk_min_gamma, low)

    def tokens_per_s(self, profiler: TrainingProfiler) -> float:
        seconds = profiler.active_training_seconds() - self._start_active
        return self.tokens / seconds if seconds > 0 else math.nan

    def summary(self, profiler: TrainingProfiler) -> dict[str, Any]:
        profiler.synchronize()  # the one device sync of the window
        tokens_per_s = self.tokens_per_s(profiler)
        fields: dict[str, Any] = {
            "loss": self.loss_sum / self.tokens if self.tokens else math.nan,
            "lr": self.lr,
            "grad_norm": (sum(self.grad_norms) / len(self.grad_norms)
                          if self.grad_norms else math.nan),
            "grad_norm_max": max(self.grad_norms, default=math.nan),
            "updates_in_window": self.updates,
            "skipped_in_window": self.skipped,
            "tokens_per_s": tokens_per_s,
            "model_flops_per_token": self.flops_per_token,
            "mfu": (tokens_per_s * self.flops_per_token / self.peak
                    if self.peak and self.flops_per_token and math.isfinite(tokens_per_s)
                    else None),
        }
        fields.update(self._memory())
        fields.update(self._qk_fields())
        return fields

    def _memory(self) -> dict[str, Any]:
        if self.device.type == "cuda":
            return {"peak_memory_bytes": torch.cuda.max_memory_allocated(self.device)}
        # CPU: the process's peak resident set (the OS keeps no per-window peak).
        try:
            import resource
        except ImportError:  # Windows
            return {}
        scale = 1 if sys.platform == "darwin" else 1024
        return {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale}

    def _qk_fields(self) -> dict[str, Any]:
        if not self._qk_max:
            return {}
        names = list(self._qk_max)
        assert self._qk_clipped is not None and self._qk_min_gamma is not None
        values = torch.stack([self._qk_max[n].float().to(self._qk_clipped.device)
                              for n in names]
                             + [self._qk_clipped.float(), self._qk_min_gamma.float()]).tolist()
        per_layer = dict(zip(names, values[:-2]))
        fields: dict[str, Any] = {
            "qk_max_logit": max(per_layer.values()),
            "qk_heads_clipped": int(values[-2]),
            "qk_min_gamma": values[-1],
        }
        fields.update({f"qk_max_logit/{n}": v for n, v in per_layer.items()})
        return fields
