"""Trainer-level checkpoints: which components and metadata a run saves, and its policy.

k3-checkpoint does the work (format 7, validate-before-mutate, RNG last); this module only
names the trainer's parts. To checkpoint one more stateful object, add it to ``_components``.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import k3_checkpoint
from k3_qkclip import QKClip, QKClipPolicy

from .agreement import load_on_every_rank, raise_on_every_rank
from .config import TrainConfig, TrainState
from .data import TokenDataLoader
from .distributed import Parallel
from .sharded import is_sharded, owned_target, read_sharded, reshard, write_sharded

CHECKPOINT = "checkpoint.pt"
"""A run's checkpoint, one format-7 file: one process, or DDP (written by rank 0)."""
SHARDED_CHECKPOINT = "checkpoint.dcp"
"""A run's checkpoint under FSDP2: a sharded folder (:mod:`k3_trainer.sharded`)."""

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

RUNTIME_METADATA = ("runtime", "rng", "data_parallel")
"""What ``allow_runtime_change`` may accept as changed, and what a ``runtime_changed`` event
reports: the runtime signature, CUDA generator states, and the data-parallel layout
(another world size or mode; sharded checkpoints are resharded on load)."""


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
    previous checkpoint at ``path`` as it was. Data parallel: call it on every rank, and
    every rank raises when one failed. Under DDP rank 0 alone writes the ordinary file
    (other ranks return ``""``); under FSDP2 every rank writes its shards into the sharded
    folder ``path`` (:mod:`k3_trainer.sharded`). The metadata records the parallel mode
    and world size.
    """
    path = Path(path)
    if parallel is not None and parallel.mode == "fsdp":
        reshard(model)
    components = _components(model, optimizer, state, config, train_loader, val_loader)
    metadata = _metadata(model, config, parallel)
    try:
        if parallel is not None and parallel.mode == "fsdp":
            digest = write_sharded(path, model, optimizer, _small(components),
                                   {**metadata, **_optimizer_record(model, optimizer)},
                                   state.step, parallel)
        else:
            digest, failure = "", None
            if parallel is None or parallel.is_main:
                try:
                    digest = k3_checkpoint.save_checkpoint(path, components, metadata)
                except OSError as error:
                    failure = error
            raise_on_every_rank(parallel, failure,
                                "rank 0 failed to write the checkpoint (see its error line)")
    except OSError as error:
        raise CheckpointWriteError(path, error) from error
    if parallel is None or parallel.is_main:
        _drop_other_form(path)
    return digest


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
    count (:data:`PORTABLE_RUNTIME`) and another data-parallel layout, and reports what
    changed in ``runtime_changes``.

    Data parallel: every rank validates and restores the same checkpoint; a rejection on
    any rank is a rejection on every rank, and a rank that had already restored rolls
    back. A sharded checkpoint (FSDP2) loads into any layout, one process included, each
    rank reading its own part; a single file loads under ``none`` and ``ddp``.
    """
    path = Path(path)
    policy = TRAINER_POLICY
    if allow_runtime_change:
        policy = k3_checkpoint.CompatibilityPolicy(
            may_grow=policy.may_grow, may_differ=policy.may_differ | {"data_parallel"},
            step_limit=policy.step_limit, runtime_may_differ=PORTABLE_RUNTIME)
    state = TrainState()
    components = _components(model, optimizer, state, config, train_loader, val_loader)
    metadata = _metadata(model, config, parallel)
    if is_sharded(path):
        loaded = read_sharded(path, model, optimizer, _small(components),
                              {**metadata, **_optimizer_record(model, optimizer)}, policy,
                              parallel)
    elif parallel is not None and parallel.mode == "fsdp":
        raise k3_checkpoint.CheckpointError(
            "is a single-file checkpoint (written by one process or DDP); --parallel fsdp "
            "resumes sharded checkpoints only: resume this run with --parallel ddp or none",
            path=path)
    elif parallel is not None:
        loaded = _load_everywhere(path, model, optimizer, components, metadata, policy,
                                  parallel)
    else:
        loaded = k3_checkpoint.load_checkpoint(path, components, metadata, policy)
    return Resumed(state=state, digest=loaded.digest, runtime_changes=_runtime_changes(loaded))


ONE_PROCESS = {"mode": "none", "world_size": 1}
"""The data-parallel layout of a checkpoint that records none (a one-process run)."""


def _runtime_changes(loaded: k3_checkpoint.LoadedCheckpoint) -> dict[str, tuple[Any, Any]]:
    """The accepted runtime differences, one per leaf: a one-process side of a layout
    change (which records no layout) reads as :data:`ONE_PROCESS`."""
    changes: dict[str, tuple[Any, Any]] = {}
    for key in RUNTIME_METADATA:
        for path, (saved, current) in loaded.changes_under(key).items():
            if path != "data_parallel":
                changes[path] = (saved, current)
                continue
            saved = ONE_PROCESS if saved is k3_checkpoint.MISSING else saved
            current = ONE_PROCESS if current is k3_checkpoint.MISSING else current
            changes.update({f"{path}.{field}": (saved.get(field), current.get(field))
                            for field in ONE_PROCESS if saved.get(field) != current.get(field)})
    return changes


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


def _small(components: dict[str, Any]) -> dict[str, Any]:
    """The components a sharded checkpoint keeps in its ``k3.ckpt``: all but the tensors."""
    return {name: c for name, c in components.items() if name not in ("model", "optimizer")}


def _optimizer_record(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's class and layout, which a single file records beside its state; a
    sharded checkpoint keeps them as metadata (global shapes, so any world size compares
    equal)."""
    return {"optimizer_type": k3_checkpoint.optimizer_identity(optimizer),
            "optimizer_layout": k3_checkpoint.optimizer_layout(optimizer, model)}


def _drop_other_form(path: Path) -> None:
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


def _load_everywhere(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                     components: dict[str, Any], metadata: dict[str, Any],
                     policy: k3_checkpoint.CompatibilityPolicy,
                     parallel: Parallel) -> k3_checkpoint.LoadedCheckpoint:
    """Every rank loads the same file; if any rank refuses it, all refuse, and a rank that
    had passed every check puts back what it restored (weights, optimizer, cursors, RNG)."""
    train_loader, val_loader = components["loaders"]["train"], components["loaders"]["val"]
    snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()),
                train_loader.state_dict(), val_loader.state_dict(), k3_checkpoint.capture_rng())

    def undo() -> None:
        model.load_state_dict(snapshot[0])
        optimizer.load_state_dict(snapshot[1])
        train_loader.load_state_dict(snapshot[2])
        val_loader.load_state_dict(snapshot[3])
        k3_checkpoint.restore_rng(snapshot[4])
        optimizer.zero_grad(set_to_none=True)

    return load_on_every_rank(
        path, parallel,
        lambda: k3_checkpoint.load_checkpoint(path, components, metadata, policy), undo)
