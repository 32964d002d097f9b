"""What the data-parallel ranks agree on about a checkpoint: a write that failed on one rank
fails on all, and a load refused on one rank is refused on all, with no rank changed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import k3_checkpoint

from .distributed import Parallel

__all__ = ["any_rank", "load_on_every_rank", "raise_on_every_rank"]


def any_rank(parallel: Parallel | None, flag: bool) -> bool:
    """``flag`` in one process (``parallel=None``); under data parallelism, true on every
    rank when true on at least one."""
    return parallel.any(flag) if parallel is not None else flag


def raise_on_every_rank(parallel: Parallel | None, failure: OSError | None,
                        elsewhere: str) -> None:
    """Raise on every rank when any rank failed: a failing rank its own ``failure``, the
    others ``OSError(0, elsewhere)``. Call it on every rank."""
    if any_rank(parallel, failure is not None):
        raise failure if failure is not None else OSError(0, elsewhere)


def load_on_every_rank(
    path: Path,
    parallel: Parallel | None,
    load: Callable[[], k3_checkpoint.LoadedCheckpoint],
    undo: Callable[[], None],
) -> k3_checkpoint.LoadedCheckpoint:
    """Run ``load`` on this rank (it raises ``CheckpointError`` and changes nothing when it
    refuses). If any rank refused, every rank raises: a refusing rank its own error, and a
    rank that had accepted calls ``undo`` first, then says another rank refused. Call it on
    every rank (or with ``parallel=None`` in one process, where it only runs ``load``)."""
    error: k3_checkpoint.CheckpointError | None = None
    loaded: k3_checkpoint.LoadedCheckpoint | None = None
    try:
        loaded = load()
    except k3_checkpoint.CheckpointError as exc:
        error = exc
    if not any_rank(parallel, error is not None):
        assert loaded is not None
        return loaded
    if error is None:  # this rank accepted, another refused: undo, then refuse alike
        undo()
        raise k3_checkpoint.CheckpointError(
            "another rank refused this checkpoint (see its error line); nothing was changed",
            path=path,
        )
    raise error
