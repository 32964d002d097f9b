"""``TrainingProfiler``: cheap always-on phase timers and the attempt clock;
``ProfilerWindow``: a bounded ``torch.profiler`` trace, as a callback.

Phases: ``train/data``, ``train/forward``, ``train/backward``, ``train/optimizer`` (which
contains ``train/qk_clip``) and the auxiliary ``eval``, ``checkpoint`` and ``log``. Timers
read ``perf_counter`` and never synchronize a device per region; on CUDA the loop calls
:meth:`synchronize` only at window boundaries, so window totals are exact while single
regions show host-side time. Auxiliary phases pause the active-training clock, so
tokens/s reflects training alone.

An optional :class:`ProfilerWindow` covers a fixed number of attempts starting at a
given candidate step — never unbounded — and writes a Chrome/Perfetto trace and a
top-ops table into ``<trace_dir>``; while it records, every phase is a named span.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..callbacks import Callback, Record

if TYPE_CHECKING:
    from ..trainer import Trainer

AUXILIARY = ("eval", "checkpoint", "log", "profile")
MAX_TRACE_STEPS = 20  # a trace of more attempts is too large to open; refuse it


class TrainingProfiler:
    """Phase timers of one session (see the module docs); ``recording`` names each phase
    as a ``torch.profiler`` span while a :class:`ProfilerWindow` traces."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.phase_seconds: dict[str, float] = defaultdict(float)
        self.attempts = 0
        self.active_seconds = 0.0
        self.recording = False
        self._active_since: float | None = None
        self._depth = 0
        self.session_start = time.perf_counter()

    # --- context ------------------------------------------------------------------------

    def __enter__(self) -> TrainingProfiler:
        self.session_start = time.perf_counter()
        self.resume()
        return self

    def __exit__(self, *exc: object) -> None:
        self.synchronize()
        self.pause()

    # --- phases -------------------------------------------------------------------------

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Time a phase; auxiliary phases pause the active-training clock while they run."""
        auxiliary = name in AUXILIARY
        if auxiliary:
            self.synchronize()
            self.pause()
        self._depth += 1
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(name) if self.recording else \
                    contextlib.nullcontext():
                yield
        finally:
            elapsed = time.perf_counter() - start
            self._depth -= 1
            self.phase_seconds[name] += elapsed
            if self._depth == 0:
                self.phase_seconds["top_level"] += elapsed
            if auxiliary:
                self.resume()

    def pause(self) -> None:
        if self._active_since is not None:
            self.active_seconds += time.perf_counter() - self._active_since
            self._active_since = None

    def resume(self) -> None:
        if self._active_since is None:
            self._active_since = time.perf_counter()

    def synchronize(self) -> None:
        """Wait for queued device work (CUDA only): called at window boundaries."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def active_training_seconds(self) -> float:
        running = 0.0 if self._active_since is None else time.perf_counter() - self._active_since
        return self.active_seconds + running

    def wall_seconds(self) -> float:
        return time.perf_counter() - self.session_start

    def summary(self) -> dict[str, Any]:
        """Session totals: phase seconds, active vs wall, and the time outside any phase."""
        wall = self.wall_seconds()
        phases = {k: round(v, 4) for k, v in self.phase_seconds.items() if k != "top_level"}
        return {"active_training_s": round(self.active_training_seconds(), 4),
                "wall_s": round(wall, 4), "phase_s": phases,
                "untracked_s": round(wall - self.phase_seconds["top_level"], 4),
                "attempts": self.attempts}

    def attempt_done(self) -> None:
        """Advance the attempt clock (skipped FP16 attempts count too)."""
        self.attempts += 1


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

    def on_attempt_start(self, trainer: Trainer, step: int) -> None:
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

    def on_attempt_end(self, trainer: Trainer, step: int) -> None:
        if self._attempt_mark is not None:
            self._attempt_mark.__exit__(None, None, None)
            self._attempt_mark = None
        if self._torch_profiler is not None:
            self.traced_attempts += 1
            if self.traced_attempts >= self.steps:
                self._stop(trainer)

    def on_session_end(self, trainer: Trainer, record: Record) -> None:
        self._stop(trainer)

    def _stop(self, trainer: Trainer) -> None:
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
