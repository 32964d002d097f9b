"""Callbacks: how observers (metrics files, TensorBoard, progress, the profiler window, the
report, a user's tracker) see a run without the loop knowing them. They sit above the
trainer: each receives it as a :class:`Run` and none imports it.

:mod:`.base` holds the hooks (:class:`Callback`) and their dispatch; the other modules one
observer each.
"""

from ..observe.metrics import Record
from .base import Callback, Callbacks, Run, callback_name, is_stateful
from .downstream import DownstreamEvaluator
from .metrics_log import MetricsLog
from .profiler_window import ProfilerWindow
from .progress import LogLines, ProgressBar
from .report import Report
from .tensorboard import TensorBoard

__all__ = ["Callback", "Callbacks", "DownstreamEvaluator", "LogLines", "MetricsLog",
           "ProfilerWindow", "ProgressBar", "Record", "Report", "Run", "TensorBoard",
           "callback_name", "is_stateful"]
