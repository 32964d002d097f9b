"""``MoEDiagnostics``: routing statistics collected only while the context is active.

A model takes part through the contract's ``set_moe_stats(enabled)`` and ``pop_moe_stats()
-> {layer: stats}`` where each ``stats.to_metrics()`` gives ``load_cv``, ``dead_experts``,
``bias_min`` and ``bias_max`` (k3-model's ``K3Model`` does). Other models summarize to
nothing and pay nothing. Under expert parallelism the trainer adds ``moved_bytes``, the
bytes this rank's token all-to-alls sent to other ranks (a host counter: no sync).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..contract import ModelContract


class MoEDiagnostics:
    def __init__(self, contract: ModelContract, *, enabled: bool = True,
                 moved_bytes: Callable[[], int] | None = None) -> None:
        self.contract = contract
        self._moved_bytes = moved_bytes
        self.enabled = enabled

    @property
    def enabled(self) -> bool:
        """Whether windows carry the routing statistics (never for a model without them)."""
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self._enabled = bool(on) and self.contract.has_moe_stats

    @property
    def moved_bytes(self) -> Callable[[], int] | None:
        return self._moved_bytes if self._enabled else None

    def __enter__(self) -> MoEDiagnostics:
        if self.enabled:
            self.contract.set_moe_stats(True)
            self.contract.pop_moe_stats()  # start a clean window
            if self.moved_bytes is not None:
                self.moved_bytes()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.contract.set_moe_stats(False)
            self.contract.pop_moe_stats()

    def summary(self, attempts: int = 1) -> dict[str, Any]:
        """Flat per-window metrics: worst layer's load CV, busiest expert over the mean and
        bias range, dead experts in all layers, plus per layer ``moe_load_cv/<layer>`` and
        ``moe_expert_load/<layer>`` (mean tokens per expert per forward, a list); with
        expert parallelism ``moe_all_to_all_bytes_per_step`` over the window's
        ``attempts`` and ``moe_dropped_tokens`` (0: no capacity limit drops any); empty
        without MoE layers."""
        if not self.enabled:
            return {}
        per_layer = {name: stats.to_metrics()
                     for name, stats in self.contract.pop_moe_stats().items()}
        if not per_layer:
            return {}
        fields: dict[str, Any] = {
            "moe_load_cv": max(m["load_cv"] for m in per_layer.values()),
            "moe_dead_experts": sum(m["dead_experts"] for m in per_layer.values()),
            "moe_max_load_ratio": max(m["max_load_ratio"] for m in per_layer.values()),
            "moe_bias_min": min(m["bias_min"] for m in per_layer.values()),
            "moe_bias_max": max(m["bias_max"] for m in per_layer.values()),
        }
        for name, m in per_layer.items():
            fields[f"moe_load_cv/{name}"] = m["load_cv"]
            fields[f"moe_dead_experts/{name}"] = m["dead_experts"]
            fields[f"moe_bias_range/{name}"] = m["bias_max"] - m["bias_min"]
            fields[f"moe_expert_load/{name}"] = [round(t, 3) for t in m["load_per_step"]]
        if self.moved_bytes is not None:
            fields["moe_all_to_all_bytes_per_step"] = self.moved_bytes() / max(attempts, 1)
            fields["moe_dropped_tokens"] = 0  # every assignment is computed: no capacity
        return fields
