"""Where a run's checkpoint lives, in which form, and what a failed write says.

One process and DDP write one format-7 file (``checkpoint.pt``); FSDP2 writes a sharded
folder (``checkpoint.dcp``, see :mod:`k3_trainer.checkpoint.sharded`). A run directory
holds one of the two; after a session with another layout published its form, the other
is removed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..distributed import Parallel
from .sharded import owned_target

CHECKPOINT = "checkpoint.pt"
"""A run's checkpoint, one format-7 file: one process, or DDP (written by rank 0)."""
SHARDED_CHECKPOINT = "checkpoint.dcp"
"""A run's checkpoint under FSDP2: a sharded folder (:mod:`k3_trainer.checkpoint.sharded`)."""


def checkpoint_path(run_dir: Path, parallel: Parallel | None) -> Path:
    """Where this run writes its checkpoint: a sharded folder under FSDP2, else a file."""
    sharded = parallel is not None and parallel.mode == "fsdp"
    return run_dir / (SHARDED_CHECKPOINT if sharded else CHECKPOINT)


def find_checkpoint(run_dir: Path) -> Path | None:
    """The run's latest checkpoint, in either form, or None. Both exist only when a crash
    came between publishing one form and deleting the other: the newer one wins."""
    found = [path for path in (run_dir / CHECKPOINT, run_dir / SHARDED_CHECKPOINT)
             if path.is_file() or (path / "k3.ckpt").is_file()]
    return max(found, key=_written_at, default=None)


def _written_at(path: Path) -> float:
    return (path / "k3.ckpt" if path.is_dir() else path).stat().st_mtime


def drop_other_form(path: Path) -> None:
    """After a checkpoint was published in one form, the run's checkpoint in the other form
    (from a session with another parallel layout) is older: remove it."""
    if path.name == CHECKPOINT:
        other = path.with_name(SHARDED_CHECKPOINT)
        if other.is_symlink():
            target = owned_target(other)
            other.unlink()
            if target is not None:
                shutil.rmtree(target, ignore_errors=True)
    elif path.name == SHARDED_CHECKPOINT:
        path.with_name(CHECKPOINT).unlink(missing_ok=True)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, read-only or vanished run directory).

    The write is atomic, so the file at the path is still the previous checkpoint, if there
    was one. An ``OSError`` with the original ``errno``; ``str()`` is one line.
    """

    def __init__(self, path: str | Path, error: OSError) -> None:
        previous = ("the previous checkpoint there is unchanged" if Path(path).exists()
                    else "no checkpoint was written")
        reason = error.strerror or str(error)
        super().__init__(error.errno, f"cannot write checkpoint {path}: {reason}; {previous}")

    def __str__(self) -> str:
        return str(self.strerror)
