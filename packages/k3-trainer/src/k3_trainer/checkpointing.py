"""Trainer-level checkpoints: k3-checkpoint's format 7 with the trainer's compatibility policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import k3_checkpoint
from k3_qkclip import QKClip, QKClipPolicy

from .config import TrainConfig, TrainState
from .data import TokenDataLoader

# Fields that may change on resume without touching the training trajectory: intervals
# only decide when to log/evaluate/save, and evaluation restores every RNG it touches.
# max_steps may grow (a run can be extended) but never drop below the saved step; the
# schedule, including the cosine horizon, must be identical.
TRAINER_POLICY = k3_checkpoint.CompatibilityPolicy(
    may_grow=frozenset({"max_steps"}),
    may_differ=frozenset({"log_interval", "eval_interval", "checkpoint_interval",
                          "eval_batches"}),
    step_limit="max_steps",
)


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


def model_vocab_size(model: nn.Module) -> int:
    return int(model_config(model)["vocab_size"])


def _qk_clip_record(model: nn.Module, config: TrainConfig
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    policy = qk_clip_policy(config)
    return policy.to_dict(), QKClip(model, policy).geometry()


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainState, config: TrainConfig, train_loader: TokenDataLoader,
                    val_loader: TokenDataLoader) -> str:
    """Write the complete update boundary atomically; returns the payload digest.

    A failed write raises :class:`CheckpointWriteError` (an ``OSError``) and leaves the
    previous checkpoint at ``path`` as it was.
    """
    policy, geometry = _qk_clip_record(model, config)
    counters = state.counters()
    scaler = counters.pop("grad_scaler_state")
    try:
        return k3_checkpoint.save_checkpoint(
            path,
            model=model,
            optimizer=optimizer,
            loaders={"train": train_loader, "val": val_loader},
            counters=counters,
            train_config=config.to_dict(),
            model_config=model_config(model),
            vocab_size=model_vocab_size(model),
            qk_clip_policy=policy,
            qk_clip_geometry=geometry,
            grad_scaler=scaler,
        )
    except OSError as error:
        raise CheckpointWriteError(path, error) from error


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    config: TrainConfig, train_loader: TokenDataLoader,
                    val_loader: TokenDataLoader) -> TrainState:
    """Validate everything against the live run, then restore; returns the counters.

    Raises ``k3_checkpoint.CheckpointError`` (a ``ValueError``) naming the first problem
    and leaves model, optimizer, loaders and RNG untouched when anything is incompatible.
    """
    policy, geometry = _qk_clip_record(model, config)
    if config.overfit_batch:
        _check_fixed_batch_offset(path, train_loader)
    loaded = k3_checkpoint.load_checkpoint(
        path,
        model=model,
        optimizer=optimizer,
        loaders={"train": train_loader, "val": val_loader},
        train_config=config.to_dict(),
        model_config=model_config(model),
        vocab_size=model_vocab_size(model),
        qk_clip_policy=policy,
        qk_clip_geometry=geometry,
        policy=TRAINER_POLICY,
    )
    counters = loaded.counters
    return TrainState(
        step=int(counters["step"] or 0),
        tokens_seen=int(counters["tokens_seen"] or 0),
        skipped_updates=int(counters["skipped_updates"] or 0),
        fixed_batch_offset=counters.get("fixed_batch_offset"),
        grad_scaler_state=loaded.grad_scaler,
    )


def _check_fixed_batch_offset(path: str | Path, train_loader: TokenDataLoader) -> None:
    """The saved overfit-batch offset must name a complete batch of this data (checked
    before anything is restored, so a bad one mutates nothing)."""
    offset = k3_checkpoint.read_payload(path)["counters"].get("fixed_batch_offset")
    if offset is None:
        return
    limit = train_loader.num_tokens - train_loader.tokens_per_batch - 1
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= limit:
        raise k3_checkpoint.CheckpointError(
            f"fixed_batch_offset {offset!r} does not name a complete batch of the training "
            f"data (0..{limit})", path=path)
