"""Plain data: the only non-tensor values a checkpoint stores, and readable differences.

Configs, counters and loader states are stored as dicts of str/int/float/bool/None and lists, so
a checkpoint loads under ``torch.load(weights_only=True)`` and never names a project class: a
checkpoint outlives the code that wrote it.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Mapping
from typing import Any

from .errors import CheckpointError

__all__ = ["differences", "is_count", "to_plain"]

_SHOWN = 60  # characters of a value shown in a difference


def to_plain(value: Any, where: str) -> Any:
    """A copy of ``value`` made only of dict (str keys), list, str, int, float, bool and None.

    Tuples become lists and numeric scalars (NumPy's included) become Python numbers, so what
    is saved compares equal to what a caller passes later. Anything else (an object, a set, an
    enum, a tensor) raises ``CheckpointError`` naming its place, e.g. ``train_config.betas``.
    """
    if value is None or type(value) in (bool, str):
        return value
    if isinstance(value, enum.Enum):
        raise CheckpointError(f"{where} is the enum {value!r}; store its .value instead")
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Mapping):
        plain = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{where} has the non-string key {key!r}; use string keys")
            plain[str.__str__(key)] = to_plain(item, f"{where}.{key}")
        return plain
    if isinstance(value, (list, tuple)):
        return [to_plain(item, f"{where}[{index}]") for index, item in enumerate(value)]
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}; checkpoints hold "
        "plain data only (dict, list, str, int, float, bool, None), so convert it first "
        "(dataclasses.asdict for a dataclass)"
    )


def is_count(value: object) -> bool:
    """True for a non-negative ``int`` that is not a ``bool``: a step, token or offset count."""
    return type(value) is int and value >= 0


def differences(saved: Any, current: Any, where: str) -> list[str]:
    """One line per leaf where two plain values differ, e.g. ``model_config.d_model: 64 → 128``.

    Mappings are compared key by key (a key on one side only is reported as such); any other
    pair is compared whole.
    """
    if isinstance(saved, Mapping) and isinstance(current, Mapping):
        lines: list[str] = []
        for key in sorted(set(saved) | set(current), key=str):
            place = f"{where}.{key}"
            if key not in current:
                lines.append(f"{place}: only in the checkpoint ({_show(saved[key])})")
            elif key not in saved:
                lines.append(f"{place}: not in the checkpoint (current {_show(current[key])})")
            else:
                lines.extend(differences(saved[key], current[key], place))
        return lines
    if _same(saved, current):
        return []
    return [f"{where}: checkpoint {_show(saved)}, current {_show(current)}"]


def _same(saved: Any, current: Any) -> bool:
    # bool == int in Python (True == 1); a config that changed True to 1 has changed.
    if isinstance(saved, bool) != isinstance(current, bool):
        return False
    if isinstance(saved, list) and isinstance(current, list):
        return len(saved) == len(current) and all(map(_same, saved, current))
    return bool(saved == current)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 1] + "…"
