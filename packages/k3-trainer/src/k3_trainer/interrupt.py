"""Stopping on a signal at an update boundary: Ctrl-C and a scheduler's preemption save.

While :class:`StopOnSignal` is active, the first SIGINT or SIGTERM asks the trainer to stop
(:meth:`~k3_trainer.Trainer.request_stop`): the attempt under way finishes, every rank
agrees on the step, the checkpoint is written there, and ``fit()`` raises
:class:`TrainingInterrupted`. A second signal ends the process at once with the signal's
default action; the checkpoint being written is then never published, so the previous one
stays intact (writes are atomic).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(Exception):
    """``fit()`` stopped at step ``step`` on signal ``signum``; ``checkpoint`` is where the
    run was saved there (None: the trainer has no checkpoint path)."""

    def __init__(self, step: int, signum: int, checkpoint: Path | None) -> None:
        self.step, self.signum, self.checkpoint = step, signum, checkpoint
        saved = "checkpoint saved" if checkpoint is not None else "nothing saved (no path)"
        super().__init__(f"interrupted at step {step}; {saved}")

    @property
    def exit_status(self) -> int:
        """The shell's convention for a process ended by the signal: 128 + its number."""
        return 128 + self.signum


class _Stoppable(Protocol):
    def request_stop(self, signum: int) -> None: ...


class StopOnSignal:
    """A context in which SIGINT/SIGTERM ask ``trainer`` to stop at the next update boundary
    instead of killing it; the previous handlers come back on exit. Only the main thread
    can install handlers: elsewhere this context does nothing."""

    def __init__(self, trainer: _Stoppable, *, last_words: str | None = None) -> None:
        """``last_words``: one line written to stderr when a second signal ends the
        process (what it abandons, what stays)."""
        self.trainer = trainer
        self.last_words = last_words
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            self.trainer.request_stop(signum)
            return
        # A second signal: stop now, as if no handler had been installed.
        if self.last_words:
            os.write(2, (self.last_words + "\n").encode())  # unbuffered, in a handler
        for number in SIGNALS:
            signal.signal(number, signal.SIG_DFL)
        signal.raise_signal(signum)
