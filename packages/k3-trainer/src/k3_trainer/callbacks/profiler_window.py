"""``ProfilerWindow``: a bounded ``torch.profiler`` trace of a few attempts, as a callback.

It covers a fixed number of attempts starting at a given candidate step — never
unbounded — and writes a Chrome/Perfetto trace and a top-ops table into ``<trace_dir>``;
while it records, every phase of the run's ``TrainingProfiler`` is a named span.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..observe.metrics import Record
from ..observe.profiling import MAX_TRACE_STEPS
from .base import Callback, Run


class ProfilerWindow(Callback):
    """Trace ``steps`` attempts from candidate step ``start`` with ``torch.profiler`` into
    ``trace_dir`` (``trace.json`` for Perfetto/Chrome, ``top_ops.txt``); its own cost is
    the auxiliary phase ``profile``, not training time."""

    def __init__(self, trace_dir: str | Path, start: int, steps: int = 3) -> None:
        if start < 1 or not 1 <= steps <= MAX_TRACE_STEPS:
            raise ValueError(f"profiler window: start step must be >= 1 and steps in "
                             f"1..{MAX_TRACE_STEPS}, got start {start}, steps {steps}")
        self.trace_dir, self.start, self.steps = Path(trace_dir), start, steps
        self.traced_attempts = 0
        self._torch_profiler: Any = None
        self._attempt_mark: Any = None
        self._done = False

    def on_attempt_start(self, trainer: Run, step: int) -> None:
        if not self._done and self._torch_profiler is None and step >= self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if trainer.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with trainer.profiler.region("profile"):
                prof: Any = torch.profiler.profile(activities=activities, record_shapes=True)
                prof.__enter__()
            self._torch_profiler = prof
            trainer.profiler.recording = True
        if self._torch_profiler is not None:  # one "train/attempt#<step>" span per attempt
            mark: Any = torch.profiler.record_function(f"train/attempt#{step}")
            mark.__enter__()
            self._attempt_mark = mark

    def on_attempt_end(self, trainer: Run, step: int) -> None:
        if self._attempt_mark is not None:
            self._attempt_mark.__exit__(None, None, None)
            self._attempt_mark = None
        if self._torch_profiler is not None:
            self.traced_attempts += 1
            if self.traced_attempts >= self.steps:
                self._stop(trainer)

    def on_session_end(self, trainer: Run, record: Record) -> None:
        self._stop(trainer)

    def _stop(self, trainer: Run) -> None:
        if self._torch_profiler is None:
            return
        if self._attempt_mark is not None:  # the session ended inside an attempt
            self._attempt_mark.__exit__(None, None, None)
            self._attempt_mark = None
        prof, self._torch_profiler = self._torch_profiler, None
        self._done = True
        trainer.profiler.recording = False
        with trainer.profiler.region("profile"):  # an auxiliary phase: not training time
            prof.__exit__(None, None, None)
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(self.trace_dir / "trace.json"))
            sort = ("self_cuda_time_total" if trainer.device.type == "cuda"
                    else "self_cpu_time_total")
            table = prof.key_averages().table(sort_by=sort, row_limit=30)
            (self.trace_dir / "top_ops.txt").write_text(
                f"torch.profiler window: {self.traced_attempts} attempt(s) from candidate "
                f"step {self.start}\n\n{table}\n")
