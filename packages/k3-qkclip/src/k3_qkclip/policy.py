"""QKClipPolicy: the user's QK-Clip settings, validated and serializable as plain data.

The policy is part of a run's recipe: a checkpoint stores ``policy.to_dict()`` and a
resumed run compares it, so the dict holds only plain Python values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

GQAMode = Literal["query_only", "group_min"]
GQA_MODES: tuple[str, ...] = ("query_only", "group_min")


@dataclass(frozen=True)
class QKClipPolicy:
    """What QK-Clip does after a successful optimizer step.

    ``enabled``: rescale query/key weights (False still observes, for metrics).
    ``tau``: the max-logit threshold τ (K2 uses 100); a head whose observed maximum
    pre-softmax logit ``S_h`` exceeds τ has its logits scaled by ``γ_h = τ / S_h``.
    ``gqa``: for grouped-query attention, ``"query_only"`` scales only head h's query
    rows by γ_h (exact per head, the shared key untouched); ``"group_min"`` scales the
    group's key rows and all its query rows by √γ_min, γ_min the smallest γ in the group.
    """

    enabled: bool = True
    tau: float = 100.0
    gqa: GQAMode = "query_only"

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"QKClipPolicy.enabled must be a bool, got {self.enabled!r}")
        tau = self.tau
        if isinstance(tau, bool) or not isinstance(tau, (int, float)):
            raise ValueError(f"QKClipPolicy.tau must be a number, got {tau!r}")
        if not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"QKClipPolicy.tau must be finite and > 0, got {tau!r}")
        object.__setattr__(self, "tau", float(tau))
        if self.gqa not in GQA_MODES:
            raise ValueError(
                f"QKClipPolicy.gqa must be one of {', '.join(GQA_MODES)}, got {self.gqa!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form for checkpoints and run records."""
        return {"enabled": self.enabled, "tau": self.tau, "gqa": self.gqa}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QKClipPolicy:
        """Inverse of :meth:`to_dict`; unknown keys are an error, missing ones default."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"QKClipPolicy: unknown field(s) {', '.join(unknown)}; "
                f"expected a subset of {', '.join(sorted(known))}"
            )
        return cls(**dict(data))
