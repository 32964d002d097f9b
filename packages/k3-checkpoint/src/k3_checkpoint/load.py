"""``load_checkpoint``: read, validate everything, and only then restore, RNG last."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .payload import read_verified
from .policy import CompatibilityPolicy
from .rng import restore_rng
from .validate import StatefulLoader, check_payload, qk_clip_record

__all__ = ["LoadedCheckpoint", "load_checkpoint"]


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What the caller rebuilds its own state from after a successful ``load_checkpoint``.

    Model, optimizer, loader cursors and RNG are already restored; these are the rest.
    """

    path: Path
    digest: str
    """sha256 of the payload: the checkpoint's identity, for run provenance."""
    counters: dict[str, int | None]
    grad_scaler: dict[str, Any] | None
    train_config: dict[str, Any]
    """The saved train config (the current one may differ where the policy allows)."""
    model_config: dict[str, Any]
    runtime: dict[str, Any]


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loaders: Mapping[str, StatefulLoader],
    train_config: Mapping[str, Any],
    model_config: Mapping[str, Any],
    vocab_size: int,
    qk_clip_policy: Mapping[str, Any] | None = None,
    qk_clip_geometry: Mapping[str, Any] | None = None,
    policy: CompatibilityPolicy | None = None,
) -> LoadedCheckpoint:
    """Resume ``model``, ``optimizer``, ``loaders`` and the global RNG from ``path``.

    First every check (see ``check_payload``: counters, train config under ``policy``, vocab
    size, model config, runtime signature, QK-Clip policy and geometry, optimizer class,
    layout and state structure, model state, loader identities, RNG state). Any failure raises
    ``CheckpointError`` and changes nothing. Then the restore: loader cursors (rolled back if
    one refuses its state), model weights, optimizer state with the checkpoint's own
    hyperparameters, gradients cleared, and the RNG last: draws made while building the
    model and optimizer, or while restoring, cannot shift the resumed streams. ``policy``
    defaults to exact equality of the train config.
    """
    payload, digest = read_verified(path)
    try:
        checked = check_payload(
            payload,
            model=model,
            optimizer=optimizer,
            loaders=loaders,
            train_config=train_config,
            model_config=model_config,
            vocab_size=vocab_size,
            qk_clip=qk_clip_record(qk_clip_policy, qk_clip_geometry),
            policy=CompatibilityPolicy() if policy is None else policy,
        )
        _restore_loaders(loaders, payload["loaders"], checked.live_loader_states)
    except CheckpointError as error:
        raise error.with_path(path) from error
    try:
        model.load_state_dict(payload["model"], strict=True)
        optimizer.load_state_dict(payload["optimizer"])
        optimizer.zero_grad(set_to_none=True)
        for parameter in model.parameters():
            parameter.grad = None
        restore_rng(payload["rng"])
    except Exception as error:  # validation should make this unreachable
        raise CheckpointError(
            "restore failed after every check passed, so the model, optimizer and loaders may "
            f"be partly restored; rebuild them before trying again ({type(error).__name__}: "
            f"{error})",
            path=path,
        ) from error
    return LoadedCheckpoint(
        path=Path(path),
        digest=digest,
        counters=checked.counters,
        grad_scaler=payload["grad_scaler"],
        train_config=payload["train_config"],
        model_config=payload["model_config"],
        runtime=payload["runtime"],
    )


def _restore_loaders(
    loaders: Mapping[str, StatefulLoader],
    saved: Mapping[str, Mapping[str, Any]],
    previous: Mapping[str, Mapping[str, Any]],
) -> None:
    """Restore every cursor, or none: a loader may still refuse (say, an offset past its data).

    Loaders go first because theirs is the only restore step the checks cannot fully predict;
    if one refuses, those already restored are put back and nothing else has been touched.
    """
    done: list[str] = []
    for name, loader in loaders.items():
        try:
            loader.load_state_dict(dict(saved[name]))
        except Exception as error:
            for restored in reversed(done):
                loaders[restored].load_state_dict(dict(previous[restored]))
            raise CheckpointError(
                f"loader '{name}' refused its saved state ({type(error).__name__}: {error}); "
                "nothing was restored"
            ) from error
        done.append(name)
