"""``TrainingProfiler``: cheap always-on phase timers and the active-training clock.

Regions (``train/data``, ``train/forward``, ``train/backward``, ``train/optimizer``,
``train/qk_clip`` and the auxiliary ``eval``, ``checkpoint``, ``log``) accumulate wall
time with ``perf_counter``; nothing synchronizes a device per region. Active training
time excludes the auxiliary phases, so tokens/s reflects training alone.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

AUXILIARY = ("eval", "checkpoint", "log")


class TrainingProfiler:
    def __init__(self) -> None:
        self.phase_seconds: dict[str, float] = defaultdict(float)
        self.attempts = 0
        self._active_since: float | None = None
        self.active_seconds = 0.0
        self.session_start = time.perf_counter()

    def __enter__(self) -> TrainingProfiler:
        self.session_start = time.perf_counter()
        self.resume()
        return self

    def __exit__(self, *exc: object) -> None:
        self.pause()

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Time a phase; auxiliary phases pause the active-training clock while they run."""
        auxiliary = name in AUXILIARY
        if auxiliary:
            self.pause()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[name] += time.perf_counter() - start
            if auxiliary:
                self.resume()

    def pause(self) -> None:
        if self._active_since is not None:
            self.active_seconds += time.perf_counter() - self._active_since
            self._active_since = None

    def resume(self) -> None:
        if self._active_since is None:
            self._active_since = time.perf_counter()

    def attempt_done(self) -> None:
        """Advance the attempt clock (skipped FP16 attempts count too)."""
        self.attempts += 1

    def active_training_seconds(self) -> float:
        running = 0.0 if self._active_since is None else time.perf_counter() - self._active_since
        return self.active_seconds + running

    def wall_seconds(self) -> float:
        return time.perf_counter() - self.session_start
