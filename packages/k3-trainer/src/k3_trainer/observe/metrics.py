"""The run's events: one JSON object per line in ``metrics.jsonl``, the source of truth
(written by the ``MetricsLog`` callback, :mod:`k3_trainer.callbacks.metrics_log`)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

Record = dict[str, Any]


def event_record(event: str, **fields: Any) -> Record:
    """``{"event", "time", **fields}``, non-finite floats as None (strict JSON)."""
    return {"event": event, "time": round(time.time(), 3), **_finite(fields)}


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Every event of a ``metrics.jsonl``, in order (a torn last line is ignored)."""
    events = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def _finite(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in fields.items()}
