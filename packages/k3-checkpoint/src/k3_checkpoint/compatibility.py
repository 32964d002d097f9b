"""The caller's compatibility policy: which metadata may differ from the checkpoint's, and how.

Every metadata value a checkpoint records (the caller's, the runtime signature, optimizer
classes) is compared exactly, except where the caller relaxes it here, by dotted path
(``"train_config.max_steps"``; a path also covers everything below it). The policy is data,
not trainer code: ``k3_checkpoint`` never learns what any of the caller's keys mean.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from .errors import IncompatibleCheckpoint
from .plain import MISSING, describe, leaf_differences

__all__ = ["Changes", "CompatibilityPolicy"]

Changes = dict[str, tuple[Any, Any]]
"""``{dotted path: (saved value, current value)}``; ``MISSING`` marks an absent side."""

MetadataCheck = Callable[[Mapping[str, Any], Mapping[str, Any]], None]

_RUNTIME = "runtime"  # the metadata key the library fills with runtime_signature()
_LISTED = 5  # differences named in a message before "…"


@dataclass(frozen=True)
class CompatibilityPolicy:
    """Which metadata changes a resume accepts; the default accepts none.

    - ``may_grow``: paths of numbers that may be larger now than when saved (a run's step
      budget, to extend it). Smaller is refused.
    - ``may_differ``: paths not compared at all (e.g. a logging interval).
    - ``step_limit``: ``(current metadata path, saved payload path)``: the current number must
      be at least the saved one (a run cannot resume past its own end). The saved path may
      point into a component's state, e.g. ``("train_config.max_steps", "counters.step")``.
    - ``runtime_may_differ``: runtime-signature keys not compared, short for ``may_differ``
      ``runtime.<key>``. Each one gives up bitwise continuation (``num_threads`` changes CPU
      reduction order); ``"device_type"`` also lets CUDA generator states be skipped when the
      device count differs.
    - ``check``: an extra ``(saved_metadata, current_metadata) -> None`` that raises
      ``CheckpointError`` for anything the fields above cannot express. Runs after them.
    """

    may_grow: frozenset[str] = field(default_factory=frozenset)
    may_differ: frozenset[str] = field(default_factory=frozenset)
    step_limit: tuple[str, str] | None = None
    runtime_may_differ: frozenset[str] = field(default_factory=frozenset)
    check: MetadataCheck | None = None

    def __post_init__(self) -> None:
        for name in ("may_grow", "may_differ", "runtime_may_differ"):
            value: Iterable[str] = getattr(self, name)
            if isinstance(value, str):  # "max_steps" would become {"m", "a", ...}
                raise TypeError(f"CompatibilityPolicy.{name} takes a set of names, not a str")
            object.__setattr__(self, name, frozenset(value))
        both = self.may_grow & self.may_differ
        if both:
            raise ValueError(f"paths both in may_grow and may_differ: {sorted(both)}")
        limit = self.step_limit
        if limit is not None and not (
            isinstance(limit, tuple) and len(limit) == 2 and all(isinstance(p, str) for p in limit)
        ):
            raise TypeError(
                "CompatibilityPolicy.step_limit takes (current metadata path, saved payload "
                f"path), e.g. ('train_config.max_steps', 'counters.step'); got {limit!r}"
            )

    def compare(
        self, saved: Mapping[str, Any], current: Mapping[str, Any], payload: Mapping[str, Any]
    ) -> Changes:
        """Return the differences this policy accepts; raise ``CheckpointError`` listing every
        one it does not. ``payload`` is the whole saved payload (for ``step_limit``)."""
        ignored = self.may_differ | {f"{_RUNTIME}.{key}" for key in self.runtime_may_differ}
        accepted: Changes = {}
        refused: list[tuple[str, str]] = []
        for place, before, now in leaf_differences(saved, current, ""):
            if _covered(place, ignored):
                accepted[place] = (before, now)
            elif not _covered(place, self.may_grow):
                refused.append((place, describe(place, before, now)))
            elif not (_is_number(before) and _is_number(now)):
                refused.append((place, f"{place}: may grow, so it must be a number"))
            elif now < before:
                refused.append(
                    (
                        place,
                        f"{place}: checkpoint {before}, current {now} (it may grow, not shrink)",
                    )
                )
            else:
                accepted[place] = (before, now)
        if self.step_limit is not None:
            problem = _limit_problem(self.step_limit, current, payload)
            if problem is not None:
                refused.append((self.step_limit[0], problem))
        if refused:
            order = [*current, *saved]
            sections = sorted({place.split(".", 1)[0] for place, _ in refused},
                              key=order.index)
            raise IncompatibleCheckpoint(_message(refused, order), sections=tuple(sections),
                                         paths=tuple(place for place, _ in refused))
        if self.check is not None:
            self.check(saved, current)
        return accepted


def _message(refused: list[tuple[str, str]], order: list[str]) -> str:
    """The first refused section (in the caller's metadata order) in full, the rest by name."""
    sections = sorted({place.split(".", 1)[0] for place, _ in refused}, key=order.index)
    first = sections[0]
    lines = [line for place, line in refused if place.split(".", 1)[0] == first]
    message = f"incompatible {first} — " + "; ".join(lines[:_LISTED])
    message += " …" if len(lines) > _LISTED else ""
    if first == _RUNTIME:
        message += " (bitwise continuation needs the same runtime)"
    if len(sections) > 1:
        message += f"; {', '.join(sections[1:])} differ too"
    return message


def at_path(tree: Mapping[str, Any], path: str) -> Any:
    """The value at dotted ``path`` of nested mappings, or ``MISSING``."""
    value: Any = tree
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return MISSING
        value = value[key]
    return value


def _limit_problem(
    limit: tuple[str, str], current: Mapping[str, Any], payload: Mapping[str, Any]
) -> str | None:
    bound_path, saved_path = limit
    bound, saved = at_path(current, bound_path), at_path(payload, saved_path)
    if not (type(saved) is int and saved >= 0):
        return f"{saved_path} in the checkpoint is {saved!r}, not a non-negative integer"
    if not (_is_number(bound) and saved <= bound):
        return f"{bound_path} {bound!r} is smaller than the checkpoint's {saved_path} {saved}"
    return None


def _covered(place: str, paths: frozenset[str]) -> bool:
    return any(place == path or place.startswith(path + ".") for path in paths)


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
