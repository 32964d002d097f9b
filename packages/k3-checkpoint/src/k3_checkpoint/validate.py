"""Every check a resume must pass, in the spec's order, before anything is restored.

All functions here read live objects and never change them: ``check_payload`` either returns
what the restore step needs or raises the first incompatibility as ``CheckpointError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .errors import CheckpointError
from .layout import check_optimizer_state, optimizer_identity, optimizer_layout
from .plain import differences, is_count, to_plain
from .policy import CompatibilityPolicy
from .rng import validate_rng_state
from .runtime import runtime_signature

__all__ = [
    "REQUIRED_COUNTERS",
    "Checked",
    "StatefulLoader",
    "check_counters",
    "check_payload",
    "check_vocab_size",
    "loader_states",
    "qk_clip_record",
]

REQUIRED_COUNTERS = ("step", "tokens_seen", "skipped_updates")
"""Counters every checkpoint carries; others (``fixed_batch_offset``...) are the caller's."""

_LISTED = 5


class StatefulLoader(Protocol):
    """A data loader as the checkpoint sees it: ``{"offset", "manifest_digest", ...}`` state."""

    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any], /) -> None: ...


@dataclass(frozen=True)
class Checked:
    """What validation established: the saved counters and the loaders' current states."""

    counters: dict[str, int | None]
    live_loader_states: dict[str, dict[str, Any]]


def check_counters(counters: Any, where: str = "counters") -> dict[str, int | None]:
    """``counters`` as a plain dict, or ``CheckpointError`` unless each is a sane count.

    ``step``, ``tokens_seen`` and ``skipped_updates`` are required non-negative integers; any
    other counter is a non-negative integer or None (an unset ``fixed_batch_offset``).
    """
    counters = to_plain(counters, where)
    if not isinstance(counters, dict):
        raise CheckpointError(f"{where} must be a mapping, got {type(counters).__name__}")
    missing = [name for name in REQUIRED_COUNTERS if name not in counters]
    if missing:
        raise CheckpointError(f"{where} lack {missing}")
    bad = [
        f"{name}={value!r}"
        for name, value in counters.items()
        if not is_count(value) and (value is not None or name in REQUIRED_COUNTERS)
    ]
    if bad:
        raise CheckpointError(
            f"{where} must be non-negative integers (None only for optional ones such as "
            f"fixed_batch_offset): {', '.join(bad)}"
        )
    return counters


def loader_states(loaders: Mapping[str, StatefulLoader]) -> dict[str, dict[str, Any]]:
    """Each loader's state as plain data, checked to carry its cursor and identity."""
    states = {}
    for name, loader in loaders.items():
        if not isinstance(name, str):
            raise CheckpointError(f"loader names must be strings, got {name!r}")
        state = to_plain(loader.state_dict(), f"loaders.{name}")
        _check_loader_state(name, state)
        states[name] = state
    return states


def qk_clip_record(policy: Mapping[str, Any] | None, geometry: Mapping[str, Any] | None) -> Any:
    """How QK-Clip's policy and geometry are stored and compared: plain data, or None."""
    if policy is None and geometry is None:
        return None
    return {
        "policy": to_plain(policy, "qk_clip.policy"),
        "geometry": to_plain(geometry, "qk_clip.geometry"),
    }


def check_payload(
    payload: Mapping[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loaders: Mapping[str, StatefulLoader],
    train_config: Mapping[str, Any],
    model_config: Mapping[str, Any],
    vocab_size: int,
    qk_clip: Any,
    policy: CompatibilityPolicy,
) -> Checked:
    """Compare a read payload with the live run; raise the first incompatibility found."""
    counters = check_counters(_field(payload, "counters"), "checkpoint counters")
    scaler = _field(payload, "grad_scaler")
    if scaler is not None and not isinstance(scaler, Mapping):
        raise CheckpointError(f"grad_scaler must be a mapping or None, got {type(scaler).__name__}")
    saved_config = _field(payload, "train_config")
    if not isinstance(saved_config, Mapping):
        raise CheckpointError("train_config in the checkpoint is not a mapping")
    current_config = to_plain(train_config, "train_config")
    policy.check_train_config(saved_config, current_config, _step(counters))
    _require_same("vocab_size", _field(payload, "vocab_size"), check_vocab_size(vocab_size))
    _require_same(
        "model_config", _field(payload, "model_config"), to_plain(model_config, "model_config")
    )
    saved_runtime = _field(payload, "runtime")
    if not isinstance(saved_runtime, Mapping):
        raise CheckpointError("runtime in the checkpoint is not a mapping")
    _require_same(
        "runtime",
        policy.comparable_runtime(saved_runtime),
        policy.comparable_runtime(runtime_signature(model)),
        hint="bitwise continuation needs the same runtime; a policy can give a key up with "
        "runtime_may_differ",
    )
    _require_same("qk_clip", _field(payload, "qk_clip"), qk_clip)
    _require_same(
        "optimizer_type", _field(payload, "optimizer_type"), optimizer_identity(optimizer)
    )
    layout = optimizer_layout(optimizer, model)
    _check_layout(_field(payload, "optimizer_layout"), layout)
    check_optimizer_state(_field(payload, "optimizer"), optimizer, layout)
    _check_model_state(_field(payload, "model"), model)
    live_loader_states = _check_loaders(_field(payload, "loaders"), loaders)
    validate_rng_state(_field(payload, "rng"))
    return Checked(counters=counters, live_loader_states=live_loader_states)


def _field(payload: Mapping[str, Any], name: str) -> Any:
    if name not in payload:
        raise CheckpointError(f"payload has no '{name}' (was it written by save_checkpoint?)")
    return payload[name]


def _step(counters: Mapping[str, int | None]) -> int:
    step = counters["step"]
    assert step is not None  # check_counters requires it
    return step


def check_vocab_size(vocab_size: object) -> int:
    """``vocab_size`` if it is a positive int, else ``CheckpointError``."""
    if not is_count(vocab_size) or vocab_size == 0:
        raise CheckpointError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    assert isinstance(vocab_size, int)
    return vocab_size


def _require_same(section: str, saved: Any, current: Any, hint: str = "") -> None:
    lines = differences(saved, current, section)
    if lines:
        message = f"incompatible {section} — " + "; ".join(lines)
        raise CheckpointError(message + (f" ({hint})" if hint else ""))


def _check_layout(saved: Any, current: list[dict[str, Any]]) -> None:
    if not isinstance(saved, list):
        raise CheckpointError("optimizer_layout in the checkpoint is not a list")
    wrong = [
        f"[{index}] checkpoint {_entry(old)}, current {_entry(new)}"
        for index, (old, new) in enumerate(zip(saved, current))
        if old != new
    ]
    if len(saved) != len(current):
        wrong.append(f"checkpoint {len(saved)} parameters, current {len(current)}")
    if wrong:
        shown = "; ".join(wrong[:_LISTED]) + (" …" if len(wrong) > _LISTED else "")
        raise CheckpointError(f"incompatible optimizer_layout — {shown}")


def _entry(entry: Any) -> str:
    if not isinstance(entry, Mapping):
        return repr(entry)
    group, name, shape, dtype = (entry.get(key) for key in ("group", "name", "shape", "dtype"))
    return f"group {group} {name} {shape} {dtype}"


def _check_model_state(saved: Any, model: torch.nn.Module) -> None:
    """What ``model.load_state_dict(saved, strict=True)`` needs, plus equal dtypes (it casts)."""
    if not isinstance(saved, Mapping):
        raise CheckpointError("model state in the checkpoint is not a mapping")
    live = model.state_dict()
    missing, unexpected = sorted(live.keys() - saved.keys()), sorted(saved.keys() - live.keys())
    if missing or unexpected:
        raise CheckpointError(
            f"model state keys differ: missing from the checkpoint {missing[:_LISTED]}, not in "
            f"the model {unexpected[:_LISTED]}"
        )
    wrong = []
    for key, tensor in live.items():
        value = saved[key]
        if not isinstance(tensor, torch.Tensor):
            continue  # a module's extra state: its own load hook judges it
        if not isinstance(value, torch.Tensor):
            wrong.append(f"{key} is a {type(value).__name__}")
        elif value.shape != tensor.shape or value.dtype != tensor.dtype:
            wrong.append(
                f"{key}: checkpoint {list(value.shape)} {value.dtype}, model "
                f"{list(tensor.shape)} {tensor.dtype}"
            )
    if wrong:
        shown = "; ".join(wrong[:_LISTED]) + (" …" if len(wrong) > _LISTED else "")
        raise CheckpointError(f"model state does not fit the model — {shown}")


def _check_loader_state(name: str, state: Any) -> None:
    if not isinstance(state, Mapping):
        raise CheckpointError(f"loader '{name}' state is not a mapping")
    if not is_count(state.get("offset")):
        raise CheckpointError(
            f"loader '{name}' offset {state.get('offset')!r} is not a non-negative integer"
        )
    digest = state.get("manifest_digest")
    if not isinstance(digest, str) or not digest:
        raise CheckpointError(f"loader '{name}' has no manifest_digest (its data identity)")


def _check_loaders(saved: Any, loaders: Mapping[str, StatefulLoader]) -> dict[str, dict[str, Any]]:
    if not isinstance(saved, Mapping):
        raise CheckpointError("loaders in the checkpoint is not a mapping")
    if set(saved) != set(loaders):
        raise CheckpointError(
            f"loaders differ: checkpoint {sorted(saved)}, current {sorted(loaders)}"
        )
    live = loader_states(loaders)
    for name, state in saved.items():
        _check_loader_state(name, state)
        if state["manifest_digest"] != live[name]["manifest_digest"]:
            raise CheckpointError(
                f"loader '{name}' identity differs: checkpoint manifest_digest "
                f"{state['manifest_digest']!r}, current {live[name]['manifest_digest']!r}; the "
                "data changed, so resume on the shards the run started with"
            )
    return live
