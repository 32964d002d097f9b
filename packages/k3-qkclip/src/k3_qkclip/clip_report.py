"""What QKClip.apply() returns: per-module max logits and the γ it applied.

Reports keep device tensors so that apply() needs no host sync; reading a number
(``heads_clipped``, ``to_metrics()``...) is what syncs, and ``to_metrics()`` does it once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class QKClipModuleReport:
    """One module's update: ``max_logits`` (observed ``S_h``; ``-inf`` = not observed)
    and ``gammas`` (the factor head h's logits were scaled by; all 1 when disabled)."""

    max_logits: Tensor
    gammas: Tensor

    @property
    def max_logit(self) -> float:
        return float(self.max_logits.max())

    @property
    def heads_clipped(self) -> int:
        return int((self.gammas < 1).sum())

    @property
    def min_gamma(self) -> float:
        return float(self.gammas.min())


@dataclass(frozen=True)
class QKClipReport:
    """All declaring modules' reports for one update, keyed by module path."""

    modules: Mapping[str, QKClipModuleReport]
    tau: float
    enabled: bool

    def to_metrics(self, per_module: bool = False) -> dict[str, float]:
        """Flat metrics with one host sync: ``qk_max_logit`` (``-inf`` if nothing was
        observed), ``qk_heads_clipped``, ``qk_min_gamma``; with ``per_module`` also
        ``qk_max_logit/<module>`` and ``qk_heads_clipped/<module>``."""
        if not self.modules:
            return {"qk_max_logit": -math.inf, "qk_heads_clipped": 0.0, "qk_min_gamma": 1.0}
        rows = [
            torch.stack([r.max_logits.max(), (r.gammas < 1).sum().float(), r.gammas.min()])
            for r in self.modules.values()
        ]
        stats = torch.stack([row.to(rows[0].device) for row in rows]).cpu().tolist()
        metrics = {
            "qk_max_logit": max(s[0] for s in stats),
            "qk_heads_clipped": float(sum(s[1] for s in stats)),
            "qk_min_gamma": min(s[2] for s in stats),
        }
        if per_module:
            for name, s in zip(self.modules, stats):
                metrics[f"qk_max_logit/{name}"] = s[0]
                metrics[f"qk_heads_clipped/{name}"] = s[1]
        return metrics
