"""What the data-parallel ranks agree on about a checkpoint: a write that failed on one rank
fails on all, and a load refused on one rank is refused on all, with no rank changed."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

import k3_checkpoint

from ..distributed import Parallel

__all__ = ["Snapshot", "any_rank", "leaves", "load_on_every_rank", "raise_on_every_rank"]


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


def leaves(components: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(dotted name, component)`` of every stateful leaf of a components mapping."""
    out: list[tuple[str, Any]] = []
    for name, component in components.items():
        if isinstance(component, Mapping):
            out += [(f"{name}.{n}", c) for n, c in leaves(component)]
        else:
            out.append((name, component))
    return out


class Snapshot:
    """Every component's ``state_dict()`` (deep-copied) and the global RNG, taken before a
    load, so that a rank which accepted a checkpoint that another rank refused can put
    everything back: the one rollback, whatever the components are."""

    def __init__(self, components: Mapping[str, Any]) -> None:
        self.components = leaves(components)
        self.saved = {name: copy.deepcopy(c.state_dict()) for name, c in self.components}
        self.rng = k3_checkpoint.capture_rng()

    def restore(self) -> None:
        for name, component in self.components:
            component.load_state_dict(self.saved[name])
            if isinstance(component, torch.optim.Optimizer):
                component.zero_grad(set_to_none=True)
        k3_checkpoint.restore_rng(self.rng)
