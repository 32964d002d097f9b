"""``Checkpointer``: save and load the components one run declares, in one place.

Built once from ``states`` (``{name: Stateful or a group of them}``: model, optimizer,
counters, loaders, a stateful callback... — ``Trainer.states()`` is the one list), the
``metadata`` a resume compares, the compatibility ``policy`` and the data-parallel setup.
k3-checkpoint does the work (format 7, validate-before-mutate, RNG last); this class picks
the backend — one file, written by rank 0 under DDP, or a sharded DCP folder every rank
writes under FSDP2, every component in it — and makes every rank agree: a write that fails
on one rank fails on all, and a load refused on one rank is refused on all, a rank that
had accepted rolling back by the same :class:`Snapshot` of ``states`` in every mode.

A checkpointer built with ``subset=True`` loads the components it was given and leaves
the checkpoint's others unread (``eval``, ``sample`` and ``export`` read the model and
the counters, :data:`~k3_trainer.checkpoint.components.READ_ONLY_COMPONENTS`, never the
optimizer or the loaders' cursors): what it reads follows from what it is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from torch import nn

import k3_checkpoint

from ..distributed import Parallel
from . import sharded as shards
from .agreement import Snapshot, load_on_every_rank, raise_on_every_rank
from .compatibility import TRAINER_POLICY, phase_policy, relaxed, runtime_changes
from .components import MODEL
from .files import CheckpointStore, CheckpointWriteError, FixedPath, checkpoint_file
from .history import META, CheckpointHistory
from .writer_thread import Work

_T = TypeVar("_T")


@dataclass(frozen=True)
class Resumed:
    """What :meth:`Checkpointer.load` restored from, and what it accepted as different."""

    digest: str
    runtime_changes: dict[str, tuple[Any, Any]]
    """``{"runtime.num_threads": (saved, current), ...}``: empty unless
    ``allow_runtime_change`` accepted a change (``rng.torch_cuda`` when CUDA generator
    states were skipped for another device count)."""
    path: Path | None = None
    """The checkpoint it read (a history's ``latest`` resolved)."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """The checkpoint's saved metadata (its own train config, model config, ...)."""


@dataclass(frozen=True)
class Started:
    """A save whose snapshot is taken: ``work`` writes and publishes it (on any thread)."""

    work: Work
    nbytes: int
    """Host memory the snapshot holds until written (this rank's)."""


class Checkpointer:
    """Save and load one run's ``states`` (must include ``"model"``; a full load needs a
    live component for every saved one, a ``subset`` one reads only those given)."""

    def __init__(self, states: Mapping[str, Any], metadata: Mapping[str, Any],
                 policy: k3_checkpoint.CompatibilityPolicy = TRAINER_POLICY,
                 parallel: Parallel | None = None, *, subset: bool = False) -> None:
        if not isinstance(states.get(MODEL), nn.Module):
            raise TypeError("Checkpointer states need the model under 'model'")
        self.states = dict(states)
        self.metadata = dict(metadata)
        self.policy = policy
        self.parallel = parallel
        self.subset = subset
        self.model: nn.Module = states[MODEL]

    @property
    def sharded(self) -> bool:
        """Whether this run writes the sharded form (FSDP2: no rank holds everything)."""
        return self.parallel is not None and self.parallel.mode == "fsdp"

    @property
    def main(self) -> bool:
        return self.parallel is None or self.parallel.is_main

    # --- save --------------------------------------------------------------------------------

    def save(self, path: str | Path, *, step: int) -> str:
        """Write the complete update boundary to ``path``, replacing what is there
        atomically; returns the checkpoint's digest (rank 0's; ``""`` elsewhere under DDP).

        Call on every rank. A failed write raises :class:`CheckpointWriteError` (an
        ``OSError``) on every rank and leaves the previous checkpoint at ``path`` as it was.
        Under FSDP2 ``path`` is a symlink to the sharded folder of ``step``.
        """
        return self.write(FixedPath(path, self.sharded), step)[0]

    def write(self, store: CheckpointStore, step: int) -> tuple[str, Path | None]:
        """Write the checkpoint of ``step`` into ``store`` and publish it there, now; returns
        its digest and published path (rank 0's; ``""`` and None elsewhere under DDP)."""
        staged = self._stage(store, step)
        try:
            if self.sharded:
                shards.reshard(self.model)
                digest = shards.write_sharded(staged, self.states, self.metadata, self.parallel)
            else:
                digest = self._write_file(checkpoint_file(staged))
            published = self._on_main(
                lambda: store.publish(staged, step),
                "rank 0 failed to publish the checkpoint (see its error line)")
        except OSError as error:
            if self.main:
                store.discard(staged)
            raise _failure(store, step, error) from error
        return digest, published

    def start(self, store: CheckpointStore, step: int) -> Started:
        """Capture the checkpoint of ``step`` now (tensors copied off the live state) and
        return its write, to run on a worker thread; the write raises
        :class:`CheckpointWriteError` when it fails. Call on every rank."""
        staged = self._stage(store, step)
        main = self.main

        def published(digest: str) -> tuple[str, Path | None]:
            return digest, store.publish(staged, step) if main else None

        if self.sharded:
            shards.reshard(self.model)
            pending = shards.start_sharded_write(staged, self.states, self.metadata, self.parallel)
            return Started(_guarded(store, step, staged, main,
                                    lambda: published(pending.result())),
                           getattr(pending, "nbytes", 0))
        if not main:  # DDP: rank 0 writes
            return Started(lambda: ("", None), 0)
        snapshot = k3_checkpoint.snapshot_checkpoint(self.states, self.metadata)
        target = checkpoint_file(staged)
        return Started(_guarded(store, step, staged, main,
                                lambda: published(snapshot.write(target))),
                       snapshot.nbytes)

    def _stage(self, store: CheckpointStore, step: int) -> Path:
        """Rank 0 prepares where ``step`` is written; every rank learns the path."""
        try:
            self._on_main(lambda: store.stage(step),
                          "rank 0 could not prepare the checkpoint folder")
        except OSError as error:
            raise _failure(store, step, error) from error
        return store.staging(step)

    def _on_main(self, work: Callable[[], _T], elsewhere: str) -> _T | None:
        """``work`` on rank 0 (its result there, None elsewhere); an ``OSError`` there is
        raised on every rank, the others saying ``elsewhere``."""
        result, failure = None, None
        if self.main:
            try:
                result = work()
            except OSError as error:
                failure = error
        raise_on_every_rank(self.parallel, failure, elsewhere)
        return result

    def _write_file(self, path: Path) -> str:
        digest = self._on_main(
            lambda: k3_checkpoint.save_checkpoint(path, self.states, self.metadata),
            "rank 0 failed to write the checkpoint (see its error line)")
        return digest or ""

    # --- load --------------------------------------------------------------------------------

    def load(self, path: str | Path, *, allow_runtime_change: bool = False,
             new_phase: bool = False) -> Resumed:
        """Validate everything against the live run, then restore every state and the RNG.

        ``path``: a checkpoint file, a checkpoint folder (``k3.ckpt``, with shards under
        FSDP2), or a history (its ``latest``). Raises ``k3_checkpoint.CheckpointError`` (a
        ``ValueError``) naming the first problem and leaves every state and the RNG
        untouched when anything is incompatible. ``allow_runtime_change`` accepts another
        torch version, CUDA version, device or thread count and another data-parallel
        layout, and reports what changed. A sharded checkpoint loads into any layout, one
        process included (its optimizer state only under the pipeline degree it was saved
        at: each stage numbers its own groups); a single file loads under one process and
        DDP. ``new_phase``
        accepts a changed decay (:data:`~k3_trainer.checkpoint.compatibility.PHASE_MAY_CHANGE`).
        """
        path = resolve_checkpoint(Path(path))
        policy = relaxed(self.policy) if allow_runtime_change else self.policy
        policy = phase_policy(policy) if new_phase else policy
        if shards.is_sharded(path):
            loaded = shards.read_sharded(path, self.states, self.metadata, policy, self.parallel,
                                  subset=self.subset)
        elif self.sharded:
            raise k3_checkpoint.CheckpointError(
                "is a single-file checkpoint (written by one process or DDP); --parallel fsdp "
                "resumes sharded checkpoints only: resume this run with --parallel ddp or "
                "none", path=path)
        else:
            file = checkpoint_file(path)
            snapshot = Snapshot(self.states) if self.parallel is not None else None
            loaded = load_on_every_rank(
                file, self.parallel,
                lambda: k3_checkpoint.load_checkpoint(file, self.states, self.metadata,
                                                      policy, subset=self.subset),
                snapshot.restore if snapshot is not None else _nothing)
        return Resumed(digest=loaded.digest, runtime_changes=runtime_changes(loaded),
                       path=path, metadata=loaded.metadata)


def resolve_checkpoint(path: Path) -> Path:
    """A history given for a checkpoint stands for its latest one."""
    if path.is_dir() and not (path / META).exists():
        latest = CheckpointHistory(path).latest()
        if latest is not None:
            return latest
    return path


def _failure(store: CheckpointStore, step: int, error: OSError) -> CheckpointWriteError:
    """The one-line error of a failed write: what it was writing, and what is left."""
    target, previous = store.describe(step)
    return CheckpointWriteError(target, error, previous)


def _guarded(store: CheckpointStore, step: int, staged: Path, main: bool,
             work: Work) -> Work:
    """``work`` raising :class:`CheckpointWriteError` for the ``OSError`` it meets, its
    staging removed."""
    def run() -> tuple[str, Path | None]:
        try:
            return work()
        except OSError as error:
            if main:
                store.discard(staged)
            raise _failure(store, step, error) from error
    return run


def _nothing() -> None:
    """One process: nothing to roll back (a refusal changed nothing)."""
