"""The caller's compatibility policy: how a run's config may differ from its checkpoint's.

Everything a checkpoint records is compared exactly, except what the caller relaxes here. The
policy is data, not trainer code: ``k3_checkpoint`` never learns what a ``TrainConfig`` is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from .errors import CheckpointError
from .plain import differences

__all__ = ["CompatibilityPolicy"]

TrainConfigCheck = Callable[[Mapping[str, Any], Mapping[str, Any]], None]


@dataclass(frozen=True)
class CompatibilityPolicy:
    """Which train-config changes a resume accepts; the default accepts none.

    - ``may_grow``: numeric train-config fields that may be larger now than when saved
      (``max_steps`` to extend a run). Smaller is refused.
    - ``may_differ``: train-config fields not compared at all (e.g. a logging interval).
    - ``step_limit``: a train-config field that must be at least the checkpoint's ``step``
      counter (``max_steps``: a run cannot resume past its own end).
    - ``runtime_may_differ``: runtime-signature keys not compared. Each one listed gives up
      bitwise continuation (e.g. ``num_threads`` changes CPU reduction order).
    - ``check``: an extra ``(saved_train_config, current_train_config) -> None`` that raises
      ``CheckpointError`` for anything the fields above cannot express. Runs after them.

    The trainer's policy: ``CompatibilityPolicy(may_grow={"max_steps"}, step_limit="max_steps")``;
    every other field, the cosine-decay settings included, must be equal.
    """

    may_grow: frozenset[str] = field(default_factory=frozenset)
    may_differ: frozenset[str] = field(default_factory=frozenset)
    step_limit: str | None = None
    runtime_may_differ: frozenset[str] = field(default_factory=frozenset)
    check: TrainConfigCheck | None = None

    def __post_init__(self) -> None:
        for name in ("may_grow", "may_differ", "runtime_may_differ"):
            value: Iterable[str] = getattr(self, name)
            if isinstance(value, str):  # "max_steps" would become {"m", "a", ...}
                raise TypeError(f"CompatibilityPolicy.{name} takes a set of names, not a str")
            object.__setattr__(self, name, frozenset(value))
        both = self.may_grow & self.may_differ
        if both:
            raise ValueError(f"fields both in may_grow and may_differ: {sorted(both)}")

    def check_train_config(
        self, saved: Mapping[str, Any], current: Mapping[str, Any], step: int
    ) -> None:
        """Raise ``CheckpointError`` listing every field this policy does not accept."""
        lines: list[str] = []
        for key in sorted(set(saved) | set(current)):
            if key in self.may_differ:
                continue
            if key in self.may_grow and key in saved and key in current:
                before, now = saved[key], current[key]
                if not (_is_number(before) and _is_number(now)):
                    lines.append(f"train_config.{key}: may grow, so it must be a number")
                elif now < before:
                    lines.append(
                        f"train_config.{key}: checkpoint {before}, current {now} (it may grow, "
                        "not shrink)"
                    )
                continue
            lines += differences(_only(saved, key), _only(current, key), "train_config")
        if self.step_limit is not None:
            limit = current.get(self.step_limit)
            if not (_is_number(limit) and step <= limit):
                lines.append(
                    f"train_config.{self.step_limit} {limit!r} is smaller than the checkpoint's "
                    f"step {step}"
                )
        if lines:
            raise CheckpointError("incompatible train_config — " + "; ".join(lines))
        if self.check is not None:
            self.check(saved, current)

    def comparable_runtime(self, signature: Mapping[str, Any]) -> dict[str, Any]:
        """``signature`` without the keys this policy gives up."""
        return {
            key: value for key, value in signature.items() if key not in self.runtime_may_differ
        }


def _only(config: Mapping[str, Any], key: str) -> dict[str, Any]:
    return {key: config[key]} if key in config else {}


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
