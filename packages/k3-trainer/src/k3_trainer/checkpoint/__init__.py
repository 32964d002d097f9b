"""Checkpoints of a run: the ``Checkpointer`` (one file or a sharded folder, the resume
gate, the rollback every rank agrees on), saves written in the background, a run's
history of checkpoints, and the policy a resume is judged by."""

from .checkpointer import Checkpointer, Resumed
from .compatibility import (
    PORTABLE_RUNTIME,
    READ_ONLY,
    TRAINER_POLICY,
    qk_clip_policy,
    relaxed,
    run_metadata,
)
from .files import (
    CHECKPOINT,
    SHARDED_CHECKPOINT,
    CheckpointStore,
    CheckpointWriteError,
    FixedPath,
    RunHistory,
    find_checkpoint,
    run_history,
)
from .history import HISTORY, LATEST, CheckpointHistory
from .writer_thread import BackgroundWriter, Written

__all__ = [
    "CHECKPOINT",
    "HISTORY",
    "LATEST",
    "PORTABLE_RUNTIME",
    "READ_ONLY",
    "SHARDED_CHECKPOINT",
    "TRAINER_POLICY",
    "BackgroundWriter",
    "CheckpointHistory",
    "CheckpointStore",
    "CheckpointWriteError",
    "Checkpointer",
    "FixedPath",
    "Resumed",
    "RunHistory",
    "Written",
    "find_checkpoint",
    "qk_clip_policy",
    "relaxed",
    "run_history",
    "run_metadata",
]
