"""``Saves``: a training run's checkpoint saves at its update boundaries.

A save is written now or, for a run with background checkpoints, captured now (tensors
copied off the live state) and written on a worker thread while training goes on, one in
flight: the next save, the end of a session and an interrupt wait for it. Each checkpoint
is announced once it is durable and published (the ``checkpoint`` event). A background
write that failed is kept, never dropped: collected at a boundary without a save it asks
every rank to stop at the next boundary (as a signal would); at a step every rank agrees
on (the next save, the session's end) every rank raises it, a rank without a failure of
its own saying another rank's write failed.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ..distributed import Parallel
from .checkpointer import Checkpointer
from .files import CheckpointStore, CheckpointWriteError
from .writer_thread import BackgroundWriter, Written

WRITE_FAILED = signal.NSIG
"""The stop code every rank agrees on, as on a signal, when a background checkpoint write
failed on one (beyond any signal number, so it wins the ranks' max)."""

logger = logging.getLogger(__name__)


class Saves:
    """The saves of one run into ``store`` (None: it never saves) through ``checkpointer``.

    ``background``: captured now, written on a worker thread. ``event(name, **fields)``
    publishes the ``checkpoint`` event; ``region(name)`` times the save (the run's
    profiler); ``stop(code)`` asks the run to stop at its next boundary with
    :data:`WRITE_FAILED`."""

    def __init__(self, checkpointer: Checkpointer, store: CheckpointStore | None,
                 parallel: Parallel | None, *, background: bool,
                 event: Callable[..., None],
                 region: Callable[[str], AbstractContextManager[Any]],
                 stop: Callable[[int], None]) -> None:
        self.checkpointer, self.store, self.parallel = checkpointer, store, parallel
        self.background = background
        self._event, self._region, self._stop = event, region, stop
        self.path: Path | None = (
            None if store is None else getattr(store, "path", None)
            or getattr(store, "root", None))
        """Where the last checkpoint went (before any: the path or the history's folder)."""
        self.saved_step: int | None = None
        """The step of the last save started (None before any)."""
        self.writer = BackgroundWriter()
        self._failure: BaseException | None = None
        self._held_bytes = 0

    @property
    def in_flight(self) -> bool:
        """Whether a background write is under way (or finished and not collected)."""
        return self.writer.in_flight

    def save(self, step: int) -> str:
        """Write the checkpoint of ``step``, the update boundary now; returns its digest
        (``""`` when it is written in the background: its ``checkpoint`` event carries the
        digest once it is durable). A write still in flight is waited for first (its
        failure raised on every rank)."""
        assert self.store is not None, "this trainer has no checkpoint_path"
        self._collect(wait=True, agree=True)
        with self._region("checkpoint"):
            start = time.perf_counter()
            if self.background:
                started = self.checkpointer.start(self.store, step)
                self.writer.submit(step, started.work, time.perf_counter() - start)
                self._held_bytes = started.nbytes
                digest = ""
            else:
                digest, path = self.checkpointer.write(self.store, step)
                self._written(Written(step, path, digest, time.perf_counter() - start, 0.0))
        self.saved_step = step
        return digest

    def poll(self) -> None:
        """A boundary without a save: collect the background write if it has finished; a
        failure asks every rank to stop at the next boundary."""
        if self.writer.in_flight:
            self._collect(wait=False, agree=False)

    def finish(self) -> BaseException | None:
        """The session's end (every rank): wait for the write in flight; its failure, or
        another rank's, is returned on every rank."""
        return self._collect(wait=True, agree=True, raise_=False)

    def drain(self) -> None:
        """Training failed: let the write in flight finish (its own failure only logged,
        the training error is the one to report)."""
        self._collect(wait=True, agree=False)
        if self._failure is not None:
            logger.error("the background checkpoint write failed too: %s", self._failure)
            self._failure = None

    def _written(self, written: Written) -> None:
        """A checkpoint is durable and published: the ``checkpoint`` event."""
        if written.path is not None:
            self.path = written.path
        background = {"background": True, "write_s": round(written.write_s, 4),
                      "held_bytes": self._held_bytes} if self.background else {}
        self._event("checkpoint", step=written.step, path=str(self.path),
                    digest=written.digest, blocked_s=round(written.blocked_s, 4),
                    **background)

    def _collect(self, *, wait: bool, agree: bool,
                 raise_: bool = True) -> BaseException | None:
        """Collect the background write if it finished (``wait``: once it has).

        A failure is kept: without ``agree`` it asks every rank to stop at the next
        boundary (as a signal would); with ``agree`` (called on every rank at the same
        step) every rank raises it, a rank without one saying another rank's write
        failed (``raise_=False`` returns it instead)."""
        failure, self._failure = self._failure, None
        if failure is None:
            try:
                written = self.writer.wait() if wait else self.writer.poll()
            except Exception as error:  # kept, and raised at a step every rank agrees on
                failure = error
            else:
                if written is not None:
                    self._written(written)
        if not agree:
            if failure is not None:
                self._failure = failure
                self._stop(WRITE_FAILED)
            return None
        if self.parallel is not None and self.parallel.any(failure is not None) \
                and failure is None:
            failure = CheckpointWriteError(self.path or ".", OSError(
                0, "another rank's checkpoint write failed (see its error line)"))
        if failure is not None and raise_:
            raise failure
        return failure
