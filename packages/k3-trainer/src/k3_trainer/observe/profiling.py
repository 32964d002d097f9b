"""``TrainingProfiler``: cheap always-on phase timers and the attempt clock (the bounded
``torch.profiler`` trace is the ``ProfilerWindow`` callback, which drives ``recording``).

Phases: ``train/data``, ``train/forward``, ``train/backward``, ``train/optimizer`` (which
contains ``train/qk_clip``) and the auxiliary ``eval``, ``checkpoint`` and ``log``. Timers
read ``perf_counter`` and never synchronize a device per region; on CUDA the loop calls
:meth:`synchronize` only at window boundaries, so window totals are exact while single
regions show host-side time. Auxiliary phases pause the active-training clock, so
tokens/s reflects training alone.

While a ``ProfilerWindow`` records, every phase is a named ``torch.profiler`` span.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

AUXILIARY = ("eval", "downstream", "checkpoint", "log", "profile")
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
