"""Trainer-level checkpoints: which components and metadata a run saves, and its policy.

k3-checkpoint does the work (format 7, validate-before-mutate, RNG last); this module only
names the trainer's parts. To checkpoint one more stateful object, add it to ``_components``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import k3_checkpoint
from k3_qkclip import QKClip, QKClipPolicy

from .config import ConfigError, TrainConfig, TrainState
from .data import TokenDataLoader
from .distributed import Parallel
from .unsharded import gather_into, scatter_from

# Fields that may change on resume without touching the training trajectory: intervals
# only decide when to log/evaluate/save, evaluation restores every RNG it touches, and
# activation checkpointing recomputes bitwise what it drops (tested). max_steps may grow
# (a run can be extended) but never drop below the saved step; the schedule, including
# the cosine horizon, must be identical, and so must `compile` (its kernels round
# differently from eager ones).
TRAINER_POLICY = k3_checkpoint.CompatibilityPolicy(
    may_grow=frozenset({"train_config.max_steps"}),
    may_differ=frozenset(f"train_config.{name}" for name in (
        "log_interval", "eval_interval", "checkpoint_interval", "eval_batches",
        "activation_checkpointing")),
    step_limit=("train_config.max_steps", "counters.step"),
)

PORTABLE_RUNTIME = frozenset({"torch_version", "cuda_version", "device_type", "num_threads"})
"""Runtime-signature keys that legitimately differ between machines; ``allow_runtime_change``
accepts a change in these (and gives up bitwise continuation). Dtypes and determinism
settings are the run's own choices and stay strict."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, read-only or vanished run directory).

    The write is atomic, so the file at the path is still the previous checkpoint, if there
    was one. An ``OSError`` with the original ``errno``; ``str()`` is one line.
    """

    def __init__(self, path: str | Path, error: OSError) -> None:
        previous = ("the previous checkpoint there is unchanged" if Path(path).is_file()
                    else "no checkpoint was written")
        reason = error.strerror or str(error)
        super().__init__(error.errno, f"cannot write checkpoint {path}: {reason}; {previous}")

    def __str__(self) -> str:
        return str(self.strerror)


@dataclass(frozen=True)
class Resumed:
    """What :func:`resume_checkpoint` restored, and what it accepted as different."""

    state: TrainState
    digest: str
    runtime_changes: dict[str, tuple[Any, Any]]
    """``{"runtime.num_threads": (saved, current), ...}``: empty unless
    ``allow_runtime_change`` accepted a change (``rng.torch_cuda`` when CUDA generator
    states were skipped for another device count)."""


def qk_clip_policy(config: TrainConfig) -> QKClipPolicy:
    return QKClipPolicy(enabled=config.qk_clip_enabled, tau=config.qk_clip_tau,
                        gqa=config.qk_clip_gqa)  # type: ignore[arg-type]


def model_config(model: nn.Module) -> dict[str, Any]:
    """The model's configuration as plain data (``model.config.to_dict()``)."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        raise TypeError(f"{type(model).__name__} needs a `config` with to_dict() to be "
                        "checkpointed: a resume must be able to compare it")
    return dict(config.to_dict())


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainState, config: TrainConfig, train_loader: TokenDataLoader,
                    val_loader: TokenDataLoader, *, parallel: Parallel | None = None) -> str:
    """Write the complete update boundary atomically; returns the payload digest.

    A failed write raises :class:`CheckpointWriteError` (an ``OSError``) and leaves the
    previous checkpoint at ``path`` as it was. Data parallel: rank 0 alone writes the
    ordinary file (other ranks return ``""``), whose metadata records the parallel mode
    and world size; under FSDP2 every rank first gathers the sharded state into its
    replica (:mod:`k3_trainer.unsharded`), so call it on every rank.
    """
    if parallel is not None:
        if parallel.mode == "fsdp":
            replica, replica_optimizer = _replica(parallel)
            gather_into(model, optimizer, replica, replica_optimizer)
            model, optimizer = replica, replica_optimizer
        if not parallel.is_main:
            return ""
    components = _components(model, optimizer, state, config, train_loader, val_loader)
    try:
        return k3_checkpoint.save_checkpoint(path, components,
                                             _metadata(model, config, parallel))
    except OSError as error:
        raise CheckpointWriteError(path, error) from error


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    config: TrainConfig, train_loader: TokenDataLoader,
                    val_loader: TokenDataLoader, *, allow_runtime_change: bool = False
                    ) -> TrainState:
    """:func:`resume_checkpoint`, returning only the counters."""
    return resume_checkpoint(path, model, optimizer, config, train_loader, val_loader,
                             allow_runtime_change=allow_runtime_change).state


def resume_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                      config: TrainConfig, train_loader: TokenDataLoader,
                      val_loader: TokenDataLoader, *, allow_runtime_change: bool = False,
                      parallel: Parallel | None = None) -> Resumed:
    """Validate everything against the live run, then restore model, optimizer, cursors,
    counters and RNG.

    Raises ``k3_checkpoint.CheckpointError`` (a ``ValueError``) naming the first problem
    and leaves model, optimizer, loaders and RNG untouched when anything is incompatible.
    ``allow_runtime_change`` accepts another torch version, CUDA version, device or thread
    count (:data:`PORTABLE_RUNTIME`) and reports what changed in ``runtime_changes``.

    Data parallel: every rank validates and restores the same file; a rejection on any
    rank is a rejection on every rank, and a rank that had already restored rolls back.
    Under FSDP2 the file is loaded into the replica, then each rank takes its rows.
    """
    if parallel is not None and parallel.mode == "fsdp":
        replica, replica_optimizer = _replica(parallel)
        resumed = _resume_everywhere(path, replica, replica_optimizer, config, train_loader,
                                     val_loader, allow_runtime_change, parallel)
        scatter_from(replica, replica_optimizer, model, optimizer)
        return resumed
    if parallel is not None:
        return _resume_everywhere(path, model, optimizer, config, train_loader, val_loader,
                                  allow_runtime_change, parallel)
    return _resume_local(path, model, optimizer, config, train_loader, val_loader,
                         allow_runtime_change, None)


def _resume_local(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                  config: TrainConfig, train_loader: TokenDataLoader,
                  val_loader: TokenDataLoader, allow_runtime_change: bool,
                  parallel: Parallel | None) -> Resumed:
    state = TrainState()
    policy = TRAINER_POLICY
    if allow_runtime_change:
        policy = k3_checkpoint.CompatibilityPolicy(
            may_grow=policy.may_grow, may_differ=policy.may_differ,
            step_limit=policy.step_limit, runtime_may_differ=PORTABLE_RUNTIME)
    components = _components(model, optimizer, state, config, train_loader, val_loader)
    loaded = k3_checkpoint.load_checkpoint(path, components,
                                           _metadata(model, config, parallel), policy)
    changes = {**loaded.changes_under("runtime"), **loaded.changes_under("rng")}
    return Resumed(state=state, digest=loaded.digest, runtime_changes=changes)


def _components(model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainState,
                config: TrainConfig, train_loader: TokenDataLoader,
                val_loader: TokenDataLoader) -> dict[str, Any]:
    """Everything a checkpoint saves and restores by ``state_dict()``: the one place to add
    a stateful part of the run."""
    overfit_limit = (train_loader.num_tokens - train_loader.tokens_per_batch - 1
                     if config.overfit_batch else None)
    return {
        "model": model,
        "optimizer": optimizer,
        "counters": _Counters(state, overfit_limit),
        "grad_scaler": _ScalerState(state),
        "loaders": {"train": train_loader, "val": val_loader},
    }


def _metadata(model: nn.Module, config: TrainConfig,
              parallel: Parallel | None = None) -> dict[str, Any]:
    """What a resume compares (under :data:`TRAINER_POLICY`) but does not restore. A
    data-parallel run adds its layout (``data_parallel``: mode, world size), so a
    one-process checkpoint stays byte-for-byte what it was."""
    policy = qk_clip_policy(config)
    extra = {"data_parallel": parallel.describe()} if parallel is not None else {}
    return {
        **extra,
        "train_config": config.to_dict(),
        "vocab_size": int(model_config(model)["vocab_size"]),  # before model_config: the
        "model_config": model_config(model),                  # clearer of the two refusals
        "qk_clip": {"policy": policy.to_dict(), "geometry": QKClip(model, policy).geometry()},
    }


_COUNTS = ("step", "tokens_seen", "skipped_updates")


class _Counters:
    """``TrainState``'s counters as a checkpoint component; refuses malformed saved ones."""

    def __init__(self, state: TrainState, overfit_limit: int | None) -> None:
        self.state = state
        self.overfit_limit = overfit_limit  # last complete-batch offset in overfit mode

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self.state, name)
                for name in (*_COUNTS, "fixed_batch_offset")}

    def load_state_dict(self, saved: Any, /) -> None:
        if not isinstance(saved, Mapping):
            raise ValueError(f"counters must be a mapping, got {type(saved).__name__}")
        missing = [name for name in _COUNTS if name not in saved]
        if missing:
            raise ValueError(f"counters lack {missing}")
        bad = [f"{name}={saved[name]!r}" for name in _COUNTS if not _is_count(saved[name])]
        offset = saved.get("fixed_batch_offset")
        if offset is not None and not _is_count(offset):
            bad.append(f"fixed_batch_offset={offset!r}")
        if bad:
            raise ValueError(f"counters must be non-negative integers: {', '.join(bad)}")
        limit = self.overfit_limit
        if limit is not None and offset is not None and offset > limit:
            raise ValueError(f"fixed_batch_offset {offset} does not name a complete batch of "
                             f"the training data (0..{limit})")
        for name in _COUNTS:
            setattr(self.state, name, saved[name])
        self.state.fixed_batch_offset = offset


class _ScalerState:
    """The GradScaler's state (kept on ``TrainState`` between sessions) as a component."""

    def __init__(self, state: TrainState) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any] | None:
        return self.state.grad_scaler_state

    def load_state_dict(self, saved: Any, /) -> None:
        if saved is not None and not isinstance(saved, Mapping):
            raise ValueError(f"grad_scaler must be a mapping or None, got {type(saved).__name__}")
        self.state.grad_scaler_state = None if saved is None else dict(saved)


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _replica(parallel: Parallel) -> tuple[nn.Module, torch.optim.Optimizer]:
    if parallel.replica is None:
        raise ConfigError("FSDP2 checkpoints need Parallel.replica: a plain model and "
                          "optimizer of the same kind to gather the sharded state into")
    return parallel.replica


def _resume_everywhere(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                       config: TrainConfig, train_loader: TokenDataLoader,
                       val_loader: TokenDataLoader, allow_runtime_change: bool,
                       parallel: Parallel) -> Resumed:
    """Every rank loads the same file; if any rank refuses it, all refuse, and a rank that
    had passed every check puts back what it restored (weights, optimizer, cursors, RNG)."""
    snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()),
                train_loader.state_dict(), val_loader.state_dict(), k3_checkpoint.capture_rng())
    error: Exception | None = None
    resumed: Resumed | None = None
    try:
        resumed = _resume_local(path, model, optimizer, config, train_loader, val_loader,
                                allow_runtime_change, parallel)
    except k3_checkpoint.CheckpointError as exc:
        error = exc
    if not parallel.any(error is not None):
        assert resumed is not None
        return resumed
    if error is None:  # this rank accepted, another refused: undo, then refuse alike
        model.load_state_dict(snapshot[0])
        optimizer.load_state_dict(snapshot[1])
        train_loader.load_state_dict(snapshot[2])
        val_loader.load_state_dict(snapshot[3])
        k3_checkpoint.restore_rng(snapshot[4])
        optimizer.zero_grad(set_to_none=True)
        raise k3_checkpoint.CheckpointError(
            "another rank refused this checkpoint (see its error line); nothing was changed",
            path=path)
    raise error
