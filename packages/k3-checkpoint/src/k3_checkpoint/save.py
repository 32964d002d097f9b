"""``save_checkpoint``: one complete update boundary, written atomically."""

from __future__ import annotations

import os
from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch

from .errors import CheckpointError
from .layout import optimizer_identity, optimizer_layout
from .payload import FORMAT_VERSION, write_payload
from .plain import to_plain
from .rng import capture_rng
from .runtime import runtime_signature
from .validate import (
    StatefulLoader,
    check_counters,
    check_vocab_size,
    loader_states,
    qk_clip_record,
)

__all__ = ["save_checkpoint"]


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loaders: Mapping[str, StatefulLoader],
    counters: Mapping[str, int | None],
    train_config: Mapping[str, Any],
    model_config: Mapping[str, Any],
    vocab_size: int,
    qk_clip_policy: Mapping[str, Any] | None = None,
    qk_clip_geometry: Mapping[str, Any] | None = None,
    grad_scaler: Mapping[str, Any] | None = None,
) -> str:
    """Write a format-7 checkpoint of the whole run to ``path``; return its sha256 hex digest.

    Call it at an update boundary, after ``optimizer.zero_grad(set_to_none=True)``: a live
    ``.grad`` means a half-accumulated attempt, which a checkpoint never holds. ``counters``
    needs ``step``, ``tokens_seen`` and ``skipped_updates`` (non-negative ints) and may add
    more (``fixed_batch_offset``, None when unset). Configs, QK-Clip policy/geometry and the
    GradScaler state (``scaler.state_dict()`` or None) must be plain data. Everything is
    checked before the file is opened, so a refused save writes nothing.
    """
    try:
        payload = _payload(
            model=model,
            optimizer=optimizer,
            loaders=loaders,
            counters=counters,
            train_config=train_config,
            model_config=model_config,
            vocab_size=vocab_size,
            qk_clip=qk_clip_record(qk_clip_policy, qk_clip_geometry),
            grad_scaler=grad_scaler,
        )
        return write_payload(path, payload)
    except CheckpointError as error:
        raise error.with_path(path) from error


def _payload(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loaders: Mapping[str, StatefulLoader],
    counters: Mapping[str, int | None],
    train_config: Mapping[str, Any],
    model_config: Mapping[str, Any],
    vocab_size: int,
    qk_clip: Any,
    grad_scaler: Mapping[str, Any] | None,
) -> dict[str, Any]:
    _require_no_gradients(model, optimizer)
    return {
        "format_version": FORMAT_VERSION,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "optimizer_type": optimizer_identity(optimizer),
        "optimizer_layout": optimizer_layout(optimizer, model),
        "counters": check_counters(counters),
        "grad_scaler": None if grad_scaler is None else to_plain(grad_scaler, "grad_scaler"),
        "train_config": to_plain(train_config, "train_config"),
        "model_config": to_plain(model_config, "model_config"),
        "vocab_size": check_vocab_size(vocab_size),
        "qk_clip": qk_clip,
        "loaders": loader_states(loaders),
        "runtime": runtime_signature(model),
        "rng": capture_rng(),
    }


def _require_no_gradients(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    optimized = chain.from_iterable(group["params"] for group in optimizer.param_groups)
    holding = {
        names.get(id(parameter), "<optimizer-only parameter>")
        for parameter in chain(model.parameters(), optimized)
        if parameter.grad is not None
    }
    if holding:
        raise CheckpointError(
            f"{len(holding)} parameters still hold a .grad (e.g. {sorted(holding)[0]}): save at "
            "an update boundary, after optimizer.zero_grad(set_to_none=True)"
        )
