"""``TrainingProfiler``: cheap always-on phase timers, the attempt clock, a bounded trace.

Phases: ``train/data``, ``train/forward``, ``train/backward``, ``train/optimizer`` (which
contains ``train/qk_clip``) and the auxiliary ``eval``, ``checkpoint`` and ``log``. Timers
read ``perf_counter`` and never synchronize a device per region; on CUDA the loop calls
:meth:`synchronize` only at window boundaries, so window totals are exact while single
regions show host-side time. Auxiliary phases pause the active-training clock, so
tokens/s reflects training alone.

An optional ``torch.profiler`` window covers a fixed number of attempts starting at a
given candidate step — never unbounded — and writes a Chrome/Perfetto trace and a
top-ops table into ``<trace_dir>``.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

AUXILIARY = ("eval", "checkpoint", "log", "profile")
MAX_TRACE_STEPS = 20  # a trace of more attempts is too large to open; refuse it


class TrainingProfiler:
    def __init__(self, device: torch.device | str = "cpu", *, trace_dir: str | Path | None = None,
                 trace_start: int | None = None, trace_steps: int = 3) -> None:
        self.device = torch.device(device)
        if trace_start is not None:
            if trace_start < 1 or not 1 <= trace_steps <= MAX_TRACE_STEPS:
                raise ValueError(f"profiler window: start step must be >= 1 and steps in "
                                 f"1..{MAX_TRACE_STEPS}, got start {trace_start}, "
                                 f"steps {trace_steps}")
            if trace_dir is None:
                raise ValueError("profiler window: a trace directory is required")
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self.trace_start, self.trace_steps = trace_start, trace_steps
        self.phase_seconds: dict[str, float] = defaultdict(float)
        self.attempts = 0
        self.traced_attempts = 0
        self.active_seconds = 0.0
        self._active_since: float | None = None
        self._depth = 0
        self._torch_profiler: Any = None
        self._attempt_mark: Any = None
        self._trace_done = False
        self.session_start = time.perf_counter()

    # --- context ------------------------------------------------------------------------

    def __enter__(self) -> TrainingProfiler:
        self.session_start = time.perf_counter()
        self.resume()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_trace()
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
            with torch.profiler.record_function(name) if self._torch_profiler else \
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

    # --- attempts and the bounded trace -------------------------------------------------

    def begin_attempt(self, candidate_step: int) -> None:
        """Called at the top of each attempted update; may open the trace window."""
        if (self.trace_start is not None and not self._trace_done
                and self._torch_profiler is None and candidate_step >= self.trace_start):
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with self.region("profile"):
                prof: Any = torch.profiler.profile(activities=activities, record_shapes=True)
                prof.__enter__()
            self._torch_profiler = prof
        if self._torch_profiler is not None:  # one "train/attempt#<step>" span per attempt
            mark: Any = torch.profiler.record_function(f"train/attempt#{candidate_step}")
            mark.__enter__()
            self._attempt_mark = mark

    def attempt_done(self) -> None:
        """Advance the attempt clock (skipped FP16 attempts count too)."""
        self.attempts += 1
        if self._attempt_mark is not None:
            self._attempt_mark.__exit__(None, None, None)
            self._attempt_mark = None
        if self._torch_profiler is not None:
            self.traced_attempts += 1
            if self.traced_attempts >= self.trace_steps:
                self._stop_trace()

    def _stop_trace(self) -> None:
        if self._torch_profiler is None:
            return
        if self._attempt_mark is not None:  # the session ended inside an attempt
            self._attempt_mark.__exit__(None, None, None)
            self._attempt_mark = None
        prof, self._torch_profiler = self._torch_profiler, None
        self._trace_done = True
        with self.region("profile"):  # an auxiliary phase: not active training time
            prof.__exit__(None, None, None)
            assert self.trace_dir is not None
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(self.trace_dir / "trace.json"))
            sort = ("self_cuda_time_total" if self.device.type == "cuda"
                    else "self_cpu_time_total")
            table = prof.key_averages().table(sort_by=sort, row_limit=30)
            (self.trace_dir / "top_ops.txt").write_text(
                f"torch.profiler window: {self.traced_attempts} attempt(s) from candidate "
                f"step {self.trace_start}\n\n{table}\n")
