"""A checkpoint load the data-parallel ranks agree on: refused on one rank, refused on all,
and no rank changed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import k3_checkpoint

from .distributed import Parallel

__all__ = ["load_on_every_rank"]


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
    refused = error is not None
    if parallel is not None:
        refused = parallel.any(refused)
    if not refused:
        assert loaded is not None
        return loaded
    if error is None:  # this rank accepted, another refused: undo, then refuse alike
        undo()
        raise k3_checkpoint.CheckpointError(
            "another rank refused this checkpoint (see its error line); nothing was changed",
            path=path,
        )
    raise error
