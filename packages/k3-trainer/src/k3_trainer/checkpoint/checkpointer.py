"""``Checkpointer``: the one place that knows which components a run's checkpoint holds.

Built once from ``states`` (``{name: Stateful or a group of them}``: model, optimizer,
counters, loaders, a stateful callback...), the ``metadata`` a resume compares, the
compatibility ``policy`` and the data-parallel setup. k3-checkpoint does the work
(format 7, validate-before-mutate, RNG last); this class picks the backend — one file,
written by rank 0 under DDP, or a sharded DCP folder under FSDP2 — and makes every rank
agree: a write that fails on one rank fails on all, and a load refused on one rank is
refused on all, a rank that had accepted rolling back by the same :class:`Snapshot` of
``states`` in every mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import k3_checkpoint

from ..distributed import Parallel
from .agreement import Snapshot, load_on_every_rank, raise_on_every_rank
from .files import CheckpointWriteError, drop_other_form
from .policy import TRAINER_POLICY, phase_policy, relaxed, runtime_changes
from .sharded import is_sharded, read_sharded, reshard, write_sharded

_TENSORS = ("model", "optimizer")  # what a sharded checkpoint keeps in DCP shards


@dataclass(frozen=True)
class Resumed:
    """What :meth:`Checkpointer.load` restored from, and what it accepted as different."""

    digest: str
    runtime_changes: dict[str, tuple[Any, Any]]
    """``{"runtime.num_threads": (saved, current), ...}``: empty unless
    ``allow_runtime_change`` accepted a change (``rng.torch_cuda`` when CUDA generator
    states were skipped for another device count)."""


class Checkpointer:
    """Save and load one run's ``states`` (must include ``"model"``; ``"optimizer"`` unless
    the checkpointer only reads weights, as ``eval`` does)."""

    def __init__(self, states: Mapping[str, Any], metadata: Mapping[str, Any],
                 policy: k3_checkpoint.CompatibilityPolicy = TRAINER_POLICY,
                 parallel: Parallel | None = None) -> None:
        if not isinstance(states.get("model"), nn.Module):
            raise TypeError("Checkpointer states need the model under 'model'")
        self.states = dict(states)
        self.metadata = dict(metadata)
        self.policy = policy
        self.parallel = parallel
        self.model: nn.Module = states["model"]
        self.optimizer: torch.optim.Optimizer | None = states.get("optimizer")

    @property
    def sharded(self) -> bool:
        """Whether this run writes the sharded form (FSDP2: no rank holds everything)."""
        return self.parallel is not None and self.parallel.mode == "fsdp"

    def save(self, path: str | Path, *, step: int) -> str:
        """Write the complete update boundary atomically; returns the checkpoint's digest.

        Call on every rank. A failed write raises :class:`CheckpointWriteError` (an
        ``OSError``) on every rank and leaves the previous checkpoint at ``path`` as it was.
        Under DDP rank 0 alone writes the file (other ranks return ``""``); under FSDP2
        every rank writes its shards into the folder ``path``, named by ``step``.
        """
        path = Path(path)
        try:
            if self.sharded:
                assert self.optimizer is not None
                reshard(self.model)
                digest = write_sharded(path, self.model, self.optimizer, self._small(),
                                       self._sharded_metadata(), step, self.parallel)
            else:
                digest = self._write_file(path)
        except OSError as error:
            raise CheckpointWriteError(path, error) from error
        if self.parallel is None or self.parallel.is_main:
            drop_other_form(path)
        return digest

    def load(self, path: str | Path, *, allow_runtime_change: bool = False,
             new_phase: bool = False) -> Resumed:
        """Validate everything against the live run, then restore every state and the RNG.

        Raises ``k3_checkpoint.CheckpointError`` (a ``ValueError``) naming the first problem
        and leaves every state and the RNG untouched when anything is incompatible.
        ``allow_runtime_change`` accepts another torch version, CUDA version, device or
        thread count and another data-parallel layout, and reports what changed. A sharded
        checkpoint loads into any layout, one process included; a single file loads under
        one process and DDP. ``new_phase`` accepts a changed decay
        (:data:`~k3_trainer.checkpoint.policy.PHASE_MAY_CHANGE`).
        """
        path = Path(path)
        policy = relaxed(self.policy) if allow_runtime_change else self.policy
        policy = phase_policy(policy) if new_phase else policy
        if is_sharded(path):
            loaded = read_sharded(path, self.model, self.optimizer, self._small(),
                                  self._sharded_metadata(), policy, self.parallel)
        elif self.sharded:
            raise k3_checkpoint.CheckpointError(
                "is a single-file checkpoint (written by one process or DDP); --parallel fsdp "
                "resumes sharded checkpoints only: resume this run with --parallel ddp or "
                "none", path=path)
        else:
            snapshot = Snapshot(self.states) if self.parallel is not None else None
            loaded = load_on_every_rank(
                path, self.parallel,
                lambda: k3_checkpoint.load_checkpoint(path, self.states, self.metadata,
                                                      policy),
                snapshot.restore if snapshot is not None else _nothing)
        return Resumed(digest=loaded.digest, runtime_changes=runtime_changes(loaded))

    # --- the two backends ------------------------------------------------------------------

    def _write_file(self, path: Path) -> str:
        digest, failure = "", None
        if self.parallel is None or self.parallel.is_main:
            try:
                digest = k3_checkpoint.save_checkpoint(path, self.states, self.metadata)
            except OSError as error:
                failure = error
        raise_on_every_rank(self.parallel, failure,
                            "rank 0 failed to write the checkpoint (see its error line)")
        return digest

    def _small(self) -> dict[str, Any]:
        """The states a sharded checkpoint keeps in its ``k3.ckpt``: all but the tensors."""
        return {name: s for name, s in self.states.items() if name not in _TENSORS}

    def _sharded_metadata(self) -> dict[str, Any]:
        """The metadata plus the optimizer's class and layout, which a single file records
        beside its state; a sharded checkpoint keeps them as metadata (global shapes, so
        any world size compares equal)."""
        if self.optimizer is None:
            return dict(self.metadata)
        return {**self.metadata,
                "optimizer_type": k3_checkpoint.optimizer_identity(self.optimizer),
                "optimizer_layout": k3_checkpoint.optimizer_layout(self.optimizer, self.model)}


def _nothing() -> None:
    """One process: nothing to roll back (a refusal changed nothing)."""
