"""``MoEDiagnostics``: routing statistics collected only while the context is active.

A model takes part through the contract's ``set_moe_stats(enabled)`` and ``pop_moe_stats()
-> {layer: stats}`` where each ``stats.to_metrics()`` gives ``load_cv``, ``dead_experts``,
``bias_min`` and ``bias_max`` (k3-model's ``K3Model`` does). Other models summarize to
nothing and pay nothing.
"""

from __future__ import annotations

from typing import Any

from ..contract import ModelContract


class MoEDiagnostics:
    def __init__(self, contract: ModelContract, *, enabled: bool = True) -> None:
        self.contract = contract
        self.enabled = enabled and contract.has_moe_stats

    def __enter__(self) -> MoEDiagnostics:
        if self.enabled:
            self.contract.set_moe_stats(True)
            self.contract.pop_moe_stats()  # start a clean window
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.contract.set_moe_stats(False)
            self.contract.pop_moe_stats()

    def summary(self) -> dict[str, Any]:
        """Flat per-window metrics: worst layer's load CV and bias range, dead experts in all
        layers, plus ``moe_load_cv/<layer>``; empty without MoE layers."""
        if not self.enabled:
            return {}
        per_layer = {name: stats.to_metrics()
                     for name, stats in self.contract.pop_moe_stats().items()}
        if not per_layer:
            return {}
        fields: dict[str, Any] = {
            "moe_load_cv": max(m["load_cv"] for m in per_layer.values()),
            "moe_dead_experts": sum(m["dead_experts"] for m in per_layer.values()),
            "moe_bias_min": min(m["bias_min"] for m in per_layer.values()),
            "moe_bias_max": max(m["bias_max"] for m in per_layer.values()),
        }
        for name, m in per_layer.items():
            fields[f"moe_load_cv/{name}"] = m["load_cv"]
            fields[f"moe_dead_experts/{name}"] = m["dead_experts"]
            fields[f"moe_bias_range/{name}"] = m["bias_max"] - m["bias_min"]
        return fields
