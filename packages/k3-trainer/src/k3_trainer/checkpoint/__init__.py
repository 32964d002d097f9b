"""Checkpoints of a run: the ``Checkpointer`` (one file or a sharded folder, the resume
gate, the rollback every rank agrees on), where a run's checkpoint lives, and the policy
a resume is judged by."""

from .checkpointer import Checkpointer, Resumed
from .files import (
    CHECKPOINT,
    SHARDED_CHECKPOINT,
    CheckpointWriteError,
    checkpoint_path,
    find_checkpoint,
)
from .policy import (
    PORTABLE_RUNTIME,
    READ_ONLY,
    TRAINER_POLICY,
    qk_clip_policy,
    relaxed,
    run_metadata,
)

__all__ = [
    "CHECKPOINT",
    "PORTABLE_RUNTIME",
    "READ_ONLY",
    "SHARDED_CHECKPOINT",
    "TRAINER_POLICY",
    "CheckpointWriteError",
    "Checkpointer",
    "Resumed",
    "checkpoint_path",
    "find_checkpoint",
    "qk_clip_policy",
    "relaxed",
    "run_metadata",
]
