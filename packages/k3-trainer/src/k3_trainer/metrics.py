"""The run's event log: one JSON object per line in ``metrics.jsonl``, the source of truth."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsLog:
    """Append-only JSONL events, each with an ``event`` name and a wall-clock ``time``;
    optional ``sinks`` (e.g. :class:`~k3_trainer.sinks.TensorBoardSink`) get each record too.

    Lines are flushed as they are written, so a killed run keeps every event it logged.
    Non-finite floats are written as ``null`` to keep the file strict JSON.
    """

    def __init__(self, path: str | Path | None, sinks: list[Any] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.sinks = list(sinks or [])
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torn = self.path.exists() and self.path.stat().st_size > 0 and \
                self.path.read_bytes()[-1:] != b"\n"
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            if torn:  # a crash cut the last line short: keep the next event on its own line
                self._file.write("\n")
        self.events: list[dict[str, Any]] = []

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": round(time.time(), 3), **_finite(fields)}
        self.events.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=False) + "\n")
            self._file.flush()
        for sink in self.sinks:
            sink.write(record)
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
