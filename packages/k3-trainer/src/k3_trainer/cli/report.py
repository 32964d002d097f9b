"""``k3-train report``: plot a run's metrics into RUN_DIR/report/."""

from __future__ import annotations

from ..observe.report import write_report
from .options import ReportCommand


def run(command: ReportCommand, notes: tuple[str, ...] = ()) -> int:
    print(f"k3-train: report in {write_report(command.run_dir)}")
    return 0
