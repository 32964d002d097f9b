"""Observing a run: the metrics log, TensorBoard, progress, profiling, per-window
summaries, MoE diagnostics, the report and the run's provenance record."""

from .diagnostics import MoEDiagnostics
from .metrics import MetricsLog, event_record, read_events
from .profiling import ProfilerWindow, TrainingProfiler
from .progress import LogLines, ProgressBar
from .report import Report, require_matplotlib, write_report
from .tensorboard import TensorBoard
from .window import TrainingWindow

__all__ = [
    "LogLines",
    "MetricsLog",
    "MoEDiagnostics",
    "ProfilerWindow",
    "ProgressBar",
    "Report",
    "TensorBoard",
    "TrainingProfiler",
    "TrainingWindow",
    "event_record",
    "read_events",
    "require_matplotlib",
    "write_report",
]
