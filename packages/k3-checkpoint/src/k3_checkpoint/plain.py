"""Plain data: the only non-tensor values a checkpoint stores, and readable differences.

Configs, counters and loader states are stored as dicts of str/int/float/bool/None and lists, so
a checkpoint loads under ``torch.load(weights_only=True)`` and never names a project class: a
checkpoint outlives the code that wrote it.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .errors import CheckpointError

__all__ = [
    "MISSING", "describe", "differences", "is_count", "leaf_differences", "show", "tensors_in",
    "to_plain",
]  # fmt: skip

_SHOWN = 60  # characters of a value shown in a difference

MISSING: Any = type("Missing", (), {"__repr__": lambda self: "<missing>"})()
"""Stands for the absent side of a key present on one side only."""


def to_plain(
    value: Any, where: str, *, tensors: bool = False, _inside: frozenset[int] = frozenset()
) -> Any:
    """A copy of ``value`` made only of dict (str keys), list, str, int, float, bool and None.

    Tuples become lists and numeric scalars (NumPy's included) become Python numbers, so what
    is saved compares equal to what a caller passes later. Anything else (an object, a set, an
    enum) raises ``CheckpointError`` naming its place, e.g. ``train_config.betas``. Tensors are
    refused too unless ``tensors`` (a component's state may hold them; metadata may not), and
    so is a container that contains itself (``_inside``: the containers around ``value``).
    """
    if value is None or type(value) in (bool, str):
        return value
    if tensors and isinstance(value, torch.Tensor):
        return value
    if isinstance(value, enum.Enum):
        raise CheckpointError(f"{where} is the enum {value!r}; store its .value instead")
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (Mapping, list, tuple)):
        if id(value) in _inside:
            raise CheckpointError(
                f"{where} contains itself (a reference cycle); a checkpoint stores trees"
            )
        _inside = _inside | {id(value)}
    if isinstance(value, Mapping):
        plain = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{where} has the non-string key {key!r}; use string keys")
            plain[str.__str__(key)] = to_plain(
                item, f"{where}.{key}", tensors=tensors, _inside=_inside
            )
        return plain
    if isinstance(value, (list, tuple)):
        return [
            to_plain(item, f"{where}[{index}]", tensors=tensors, _inside=_inside)
            for index, item in enumerate(value)
        ]
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}; checkpoints hold "
        "plain data only (dict, list, str, int, float, bool, None), so convert it first "
        "(dataclasses.asdict for a dataclass)"
    )


def is_count(value: object) -> bool:
    """True for a non-negative ``int`` that is not a ``bool``: a step, token or offset count."""
    return type(value) is int and value >= 0


def leaf_differences(saved: Any, current: Any, where: str) -> list[tuple[str, Any, Any]]:
    """``(place, saved, current)`` per leaf where two plain values differ; ``MISSING`` marks
    a key on one side only. Mappings are compared key by key, any other pair whole."""
    if isinstance(saved, Mapping) and isinstance(current, Mapping):
        found: list[tuple[str, Any, Any]] = []
        for key in sorted(set(saved) | set(current), key=str):
            place = f"{where}.{key}" if where else str(key)
            found += leaf_differences(saved.get(key, MISSING), current.get(key, MISSING), place)
        return found
    if _same(saved, current):
        return []
    return [(where, saved, current)]


def describe(place: str, saved: Any, current: Any) -> str:
    """One readable line for a difference, e.g. ``model_config.d_model: checkpoint 64, current
    128``."""
    if current is MISSING:
        return f"{place}: only in the checkpoint ({show(saved)})"
    if saved is MISSING:
        return f"{place}: not in the checkpoint (current {show(current)})"
    return f"{place}: checkpoint {show(saved)}, current {show(current)}"


def differences(saved: Any, current: Any, where: str) -> list[str]:
    """One line per leaf where two plain values differ (see ``describe``)."""
    return [describe(*difference) for difference in leaf_differences(saved, current, where)]


def _same(saved: Any, current: Any) -> bool:
    # bool == int in Python (True == 1); a config that changed True to 1 has changed.
    if isinstance(saved, bool) != isinstance(current, bool):
        return False
    if isinstance(saved, list) and isinstance(current, list):
        return len(saved) == len(current) and all(map(_same, saved, current))
    return bool(saved == current)


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 1] + "…"


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside mappings, lists and tuples (a payload holds no other containers)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
