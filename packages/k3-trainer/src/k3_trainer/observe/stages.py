"""The log window's per-layer figures of every pipeline stage, combined as one process's.

Under pipeline stages each rank observes only the layers it holds: the QK-Clip figures
of its MLA layers, the routing statistics of its MoE layers. Rank 0 writes the events, so
without this a run whose first stage holds no MLA layer would log no QK-Clip figure at
all. At each log boundary the stages exchange those fields (one small object gather over
the pipeline ranks) and every rank combines them: the per-layer fields (``name/layer``;
layer names are the whole model's, so they never collide) side by side,
and each whole-model figure by the rule that makes it one process's (the worst load CV
is the largest of the stages' worst, dead experts add up, and so on). A field not listed
(``moe_all_to_all_bytes_per_step``: what this rank's own all-to-alls sent) stays rank 0's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

COMBINED: dict[str, Callable[[Sequence[Any]], Any]] = {
    "qk_max_logit": max,
    "qk_heads_clipped": sum,
    "qk_min_gamma": min,
    "moe_load_cv": max,
    "moe_dead_experts": sum,
    "moe_max_load_ratio": max,
    "moe_bias_min": min,
    "moe_bias_max": max,
}
"""The whole-model figures and how the stages' values combine into one process's."""


def layer_figures(fields: dict[str, Any]) -> dict[str, Any]:
    """What a stage contributes of a window's ``fields``: its per-layer QK-Clip and MoE
    fields and its whole-model figures."""
    return {key: value for key, value in fields.items()
            if key in COMBINED or ("/" in key and key.startswith(("qk_", "moe_")))}


def combine_stages(stages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every stage's :func:`layer_figures` (one dict per pipeline rank) as one process's
    fields."""
    combined: dict[str, Any] = {}
    for figures in stages:
        combined.update({key: value for key, value in figures.items() if "/" in key})
    for key, rule in COMBINED.items():
        values = [figures[key] for figures in stages if key in figures]
        if values:
            combined[key] = rule(values)
    return combined
