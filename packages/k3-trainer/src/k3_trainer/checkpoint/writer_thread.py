"""Checkpoint writes off the training path: one at a time, on one worker thread.

The update boundary is captured on the training thread (a snapshot: tensors copied off the
live state); serializing, checksumming, fsyncing and publishing it run here while training
goes on. At most one write is in flight: the next save, the end of a session and an
interrupt wait for it. A failed write is kept and raised by :meth:`BackgroundWriter.poll`
or :meth:`~BackgroundWriter.wait`, never dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Written:
    """A checkpoint that is durable and published."""

    step: int
    path: Path | None
    """Where it was published (None on a rank that publishes nothing)."""
    digest: str
    blocked_s: float
    """How long training stopped for it: the snapshot (everything, for a synchronous save)."""
    write_s: float
    """How long writing it took after the snapshot (0 for a synchronous save)."""


Work = Callable[[], tuple[str, Path | None]]
"""A captured checkpoint's write: returns its digest and where it was published."""


class BackgroundWriter:
    """Runs one checkpoint write at a time on a worker thread."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[Written] | None = None

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def submit(self, step: int, work: Work, blocked_s: float) -> None:
        """Start writing the checkpoint of ``step`` (the previous write must be collected
        first: :meth:`wait`)."""
        if self._future is not None:
            raise RuntimeError("a checkpoint write is still in flight: wait() for it first")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3-checkpoint")

        def run() -> Written:
            start = time.perf_counter()
            digest, path = work()
            return Written(step, path, digest, blocked_s, time.perf_counter() - start)

        self._future = self._pool.submit(run)

    def poll(self) -> Written | None:
        """The write in flight if it has finished (raising what it raised), else None."""
        if self._future is None or not self._future.done():
            return None
        return self.wait()

    def wait(self) -> Written | None:
        """Block until the write in flight (if any) finishes; return it or raise its error."""
        future, self._future = self._future, None
        return None if future is None else future.result()

    def close(self) -> None:
        """Wait for the write in flight (its result dropped: call :meth:`wait` first to see
        it) and stop the worker thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
