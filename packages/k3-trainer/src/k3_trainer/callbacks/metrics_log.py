"""``MetricsLog``: every event the trainer reports, appended to ``metrics.jsonl`` as it
happens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

from ..observe.metrics import Record, event_record
from .base import Callback, Run


class MetricsLog(Callback):
    """Append-only JSONL events, each with an ``event`` name and a wall-clock ``time``
    (``path=None`` keeps them in :attr:`events` only).

    Lines are flushed as they are written, so a killed run keeps every event it logged.
    Non-finite floats are written as ``null`` to keep the file strict JSON.
    """

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self._file: TextIO | None = None
        if self.path is not None:
            self._open(self.path)
        self.events: list[dict[str, Any]] = []

    def _open(self, path: Path) -> TextIO:
        """The file, opened for appending (again after :meth:`close`: a later session of
        the same trainer writes on). A last line a crash cut short (no newline: never a
        complete event) is removed first, so the log stays one JSON event per line and
        only its end can be torn."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.stat().st_size > 0:
            data = path.read_bytes()
            if not data.endswith(b"\n"):
                with open(path, "r+b") as file:
                    file.truncate(data.rfind(b"\n") + 1)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115
        return self._file

    def write(self, event: str, **fields: Any) -> Record:
        """Record an event of the caller's own (e.g. ``runtime_changed``)."""
        return self.append(event_record(event, **fields))

    def append(self, record: Record) -> Record:
        self.events.append(record)
        if self.path is not None:
            file = self._file or self._open(self.path)
            file.write(json.dumps(record, sort_keys=False) + "\n")
            file.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # Every event the trainer reports goes to the file.
    def on_session_start(self, trainer: Run, record: Record) -> None:
        self.append(record)

    def on_overflow(self, trainer: Run, record: Record) -> None:
        self.append(record)

    def on_log(self, trainer: Run, record: Record) -> None:
        self.append(record)

    def on_eval_end(self, trainer: Run, record: Record) -> None:
        self.append(record)

    def on_checkpoint_saved(self, trainer: Run, record: Record) -> None:
        self.append(record)

    def on_data_epoch(self, trainer: Run, record: Record) -> None:
        self.append(record)

    def on_session_end(self, trainer: Run, record: Record) -> None:
        self.append(record)

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
