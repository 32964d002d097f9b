"""The run's events: one JSON object per line in ``metrics.jsonl``, the source of truth
(written by the ``MetricsLog`` callback, :mod:`k3_trainer.callbacks.metrics_log`)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from ..config import ConfigError

Record = dict[str, Any]


def event_record(event: str, **fields: Any) -> Record:
    """``{"event", "time", **fields}``, non-finite floats as None (strict JSON)."""
    return {"event": event, "time": round(time.time(), 3), **_finite(fields)}


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Every event of a ``metrics.jsonl``, in order. A torn last line (a killed session's
    write, cut before its newline) is ignored; any other line that is not a JSON object is
    a ``ConfigError`` naming the file and the line."""
    return [record for _, record in _lines(Path(path))]


def _lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(line, event)`` for every complete line of the event log ``path`` (see
    :func:`read_events`)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    torn = bool(text) and not text.endswith("\n")
    found = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if torn and number == len(lines):
                break  # cut short by a crash: never a complete event
            raise ConfigError(f"{path}:{number} is not a JSON event ({exc.msg}): the event "
                              "log is damaged there; repair or remove that line") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:{number} is not a JSON object: the event log is "
                              "damaged there; repair or remove that line")
        found.append((line, record))
    return found


def _finite(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in fields.items()}


def mark_superseded(path: str | Path, after_step: int) -> int:
    """Mark every record of a step past ``after_step`` ``"superseded": true`` (a resume
    from ``after_step`` trains those steps again, a branch trains others): they stay in
    the file, and readers skip them. Rewritten atomically; returns how many were marked."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines, marked = [], 0
    for line, record in _lines(path):  # a torn last line is left out: never complete
        step = record.get("step")
        if isinstance(step, int) and step > after_step and not record.get("superseded"):
            record["superseded"] = True
            line, marked = json.dumps(record), marked + 1
        lines.append(line)
    if marked:
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
        temporary.replace(path)
    return marked


def current(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of the run as it stands: those no later resume superseded."""
    return [event for event in events if not event.get("superseded")]
