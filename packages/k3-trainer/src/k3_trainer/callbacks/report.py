"""``Report``: the run's plots and index page, written when a session ends."""

from __future__ import annotations

from pathlib import Path

from ..observe.metrics import Record
from ..observe.report import require_matplotlib, write_report
from .base import Callback, Run


class Report(Callback):
    """Write the run's report when a session ends (``--report``); the path is kept in
    :attr:`written`. Put it after the ``MetricsLog`` it reads."""

    def __init__(self, run_dir: str | Path) -> None:
        require_matplotlib()
        self.run_dir = Path(run_dir)
        self.written: Path | None = None

    def on_session_end(self, trainer: Run, record: Record) -> None:
        self.written = write_report(self.run_dir)
