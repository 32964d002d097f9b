"""What the trainer itself measures and records: phase timers and the attempt clock, the
per-window summary (under pipeline stages, every stage's per-layer figures combined:
:mod:`.stages`), MoE diagnostics, event records and the report's plots (the run's
provenance record is :mod:`k3_trainer.record`). The observers that write them out are
callbacks (:mod:`k3_trainer.callbacks`), which sit above the trainer; nothing here imports
them."""

from .diagnostics import MoEDiagnostics
from .metrics import Record, event_record, read_events
from .profiling import TrainingProfiler
from .report import require_matplotlib, write_report
from .window import TrainingWindow

__all__ = [
    "MoEDiagnostics",
    "Record",
    "TrainingProfiler",
    "TrainingWindow",
    "event_record",
    "read_events",
    "require_matplotlib",
    "write_report",
]
