"""Where a run's checkpoints live, in which form, and what a failed write says.

A run directory keeps its checkpoints in ``checkpoints/`` (:mod:`.history`): one folder
per saved step holding ``k3.ckpt`` (one process or DDP: the whole format-7 checkpoint;
FSDP2: beside DCP's shards, see :mod:`.sharded`) and a ``latest`` pointer. Runs written
before the history kept one checkpoint, ``checkpoint.pt`` or the sharded
``checkpoint.dcp``; they still resume, and their first save into the history removes it.

A library run may instead name one path (``Trainer(checkpoint_path="ckpt.pt")``):
:class:`FixedPath` rewrites it atomically, a file, or under FSDP2 a symlink to a sharded
folder swapped by one rename.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Protocol

import k3_checkpoint

from .history import HISTORY, META, CheckpointHistory

CHECKPOINT = "checkpoint.pt"
"""A run's one checkpoint before the history (one process or DDP)."""
SHARDED_CHECKPOINT = "checkpoint.dcp"
"""A run's one checkpoint before the history under FSDP2: a symlink to a sharded folder."""


class CheckpointStore(Protocol):
    """Where a trainer's checkpoints go: ``staging`` is the path a step's checkpoint is
    written to (a file, or a folder that gets ``k3.ckpt`` and any shards), which ``stage``
    prepares (on the main rank); ``publish``, once it is written and durable, makes it the
    one a resume finds, and returns it; ``discard`` removes a failed write's leftovers;
    ``describe`` gives what a failure names: the checkpoint's path and the previous one
    (None: there is none)."""

    def staging(self, step: int) -> Path: ...

    def stage(self, step: int) -> Path: ...

    def publish(self, staged: Path, step: int) -> Path: ...

    def discard(self, staged: Path) -> None: ...

    def describe(self, step: int) -> tuple[Path, Path | None]: ...


class FixedPath:
    """One checkpoint at ``path``, replaced atomically by every save."""

    def __init__(self, path: str | os.PathLike[str], sharded: bool) -> None:
        self.path, self.sharded = Path(path), sharded

    def staging(self, step: int) -> Path:
        if not self.sharded:
            return self.path  # k3_checkpoint writes beside it and renames over it
        return self.path.with_name(f".{self.path.name}.tmp")

    def stage(self, step: int) -> Path:
        staging = self.staging(step)
        if not self.sharded:
            return staging
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        return staging

    def publish(self, staged: Path, step: int) -> Path:
        if staged != self.path:
            _swap_symlink(staged, self.path, step)
        return self.path

    def discard(self, staged: Path) -> None:
        if staged != self.path:  # a single file's .tmp is k3_checkpoint's to remove
            shutil.rmtree(staged, ignore_errors=True)

    def describe(self, step: int) -> tuple[Path, Path | None]:
        return self.path, self.path if self.path.exists() else None


class RunHistory(CheckpointHistory):
    """A run directory's history; its first save also removes the run's checkpoint from
    before the history (``checkpoint.pt`` or ``checkpoint.dcp``), now older than it."""

    def publish(self, staged: Path, step: int) -> Path:
        final = super().publish(staged, step)
        drop_single_checkpoint(self.root.parent)
        return final


def run_history(run_dir: Path, keep_last: int = 1, keep_every: int | None = None
                ) -> RunHistory:
    return RunHistory(run_dir / HISTORY, keep_last, keep_every)


def find_checkpoint(run_dir: Path) -> Path | None:
    """The run's latest checkpoint: the history's, else the one a run from before the
    history kept (either form; if a crash left both, the newer), else None."""
    latest = CheckpointHistory(run_dir / HISTORY).latest()
    if latest is not None:
        return latest
    found = [path for path in (run_dir / CHECKPOINT, run_dir / SHARDED_CHECKPOINT)
             if path.is_file() or (path / META).is_file()]
    return max(found, key=_written_at, default=None)


def checkpoint_file(path: Path) -> Path:
    """The format-7 file of a checkpoint: the path itself, or a folder's ``k3.ckpt``."""
    return path / META if path.is_dir() else path


def _written_at(path: Path) -> float:
    return checkpoint_file(path).stat().st_mtime


def drop_single_checkpoint(run_dir: Path) -> None:
    """Remove a run's checkpoint from before the history, in either form (the history now
    holds a newer one)."""
    (run_dir / CHECKPOINT).unlink(missing_ok=True)
    link = run_dir / SHARDED_CHECKPOINT
    if link.is_symlink():
        target = owned_target(link)
        link.unlink()
        if target is not None:
            shutil.rmtree(target, ignore_errors=True)


def _swap_symlink(staging: Path, path: Path, step: int) -> None:
    """Rename the written ``staging`` folder to its step name and point the symlink
    ``path`` at it in one rename, then drop the folder it named before."""
    if path.exists() and not path.is_symlink():
        raise OSError(0, f"{path} exists and is not the symlink a sharded checkpoint keeps; "
                         "move it away")
    k3_checkpoint.fsync_directory(staging)
    previous = owned_target(path)
    final = path.with_name(f"{path.name}.step-{step:08d}")
    if final == previous:  # the same step saved again: never touch the live checkpoint
        final = final.with_name(f"{final.name}.again")
    if final.exists():  # a killed session got this far before, never published
        shutil.rmtree(final)
    os.rename(staging, final)
    link = path.with_name(f".{path.name}.link")
    link.unlink(missing_ok=True)
    os.symlink(final.name, link)
    k3_checkpoint.fsync_directory(path.parent)
    os.replace(link, path)
    k3_checkpoint.fsync_directory(path.parent)
    if previous is not None and previous.exists():
        shutil.rmtree(previous)


def owned_target(path: Path) -> Path | None:
    """The step folder the symlink ``path`` names, if it is one :class:`FixedPath` wrote (a
    sibling called ``<name>.step-…``); None for anything else, which is never deleted."""
    if not path.is_symlink():
        return None
    target = Path(os.readlink(path))
    if target.parent != Path(".") or not target.name.startswith(f"{path.name}.step-"):
        return None
    return path.parent / target


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, read-only or vanished run directory).

    The write is atomic, so the file at the path is still the previous checkpoint, if there
    was one. An ``OSError`` with the original ``errno``; ``str()`` is one line.
    """

    def __init__(self, path: str | Path, error: OSError,
                 previous: str | Path | bool | None = True) -> None:
        """``previous``: the checkpoint the failure left as it was (True: the one at
        ``path``, if there is one; None: there is none)."""
        if previous is True:
            previous = path if Path(path).exists() else None
        if previous is None or previous is False:
            previous = "no checkpoint was written"
        elif Path(previous) == Path(path):
            previous = "the previous checkpoint there is unchanged"
        else:
            previous = f"the latest checkpoint, {previous}, is unchanged"
        reason = error.strerror or str(error)
        super().__init__(error.errno, f"cannot write checkpoint {path}: {reason}; {previous}")

    def __str__(self) -> str:
        return str(self.strerror)
