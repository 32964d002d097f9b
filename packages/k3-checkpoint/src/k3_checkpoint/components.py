"""Stateful components: what a checkpoint saves, checks and restores by ``state_dict()``.

A component is anything with ``state_dict()`` and ``load_state_dict(state)``; a plain mapping
of components is a group (``{"train": loader, "val": loader}``), saved as a nested mapping.
The library knows two kinds by their torch class, and checks them before anything changes:

- a ``torch.nn.Module``: the saved state has the module's keys, shapes and dtypes;
- a ``torch.optim.Optimizer``: its class and per-parameter layout (recorded beside it as
  ``<name>_type`` and ``<name>_layout``) and the structure of its saved state.

Every other component judges its own state in ``load_state_dict``. Those are restored first,
all or none: if one refuses, each one already restored (and the one refusing) gets its
previous state back, so a refusal changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import chain
from typing import Any, Protocol, runtime_checkable

import torch

from .errors import CheckpointError, ComponentRefused
from .layout import (
    check_layout,
    check_optimizer_state,
    layout_names,
    optimizer_identity,
    optimizer_layout,
)
from .plain import to_plain

__all__ = ["Components", "Stateful", "Tree"]

_LISTED = 5  # items named in a message before "…"


@runtime_checkable
class Stateful(Protocol):
    """Anything a checkpoint can hold: model, optimizer, data loader, counters, scaler."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


Components = Mapping[str, Any]
"""``{name: Stateful or a Components group}``."""


class Tree:
    """A components mapping flattened to dotted names, with the torch ones picked out."""

    def __init__(self, components: Components) -> None:
        self.groups: dict[str, list[str]] = {}
        self.leaves: dict[str, Stateful] = dict(_flatten(components, "", self.groups))
        self.roots = list(components)
        self.modules = {n: c for n, c in self.leaves.items() if isinstance(c, torch.nn.Module)}
        self.optimizers = {
            n: c for n, c in self.leaves.items() if isinstance(c, torch.optim.Optimizer)
        }
        self.others = {
            n: c
            for n, c in self.leaves.items()
            if n not in self.modules and n not in self.optimizers
        }

    def structure_keys(self) -> list[str]:
        """The payload keys ``structure`` fills."""
        return [f"{name}_{kind}" for name in self.optimizers for kind in ("type", "layout")]

    def structure(self) -> dict[str, Any]:
        """``<name>_type`` and ``<name>_layout`` of every optimizer (payload keys)."""
        names = layout_names(*self.modules.values())
        record: dict[str, Any] = {}
        for name, optimizer in self.optimizers.items():
            record[f"{name}_type"] = optimizer_identity(optimizer)
            record[f"{name}_layout"] = optimizer_layout(optimizer, names)
        return record

    def states(self) -> dict[str, Any]:
        """Every component's state, nested like the components (payload keys)."""
        states: dict[str, Any] = {}
        for name, component in self.leaves.items():
            state = component.state_dict()
            if name in self.others:
                state = to_plain(state, name, tensors=True)
            *groups, last = name.split(".")
            node = states
            for group in groups:
                node = node.setdefault(group, {})
            node[last] = state
        return states

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """Every parameter of the modules and the optimizers (a shared one more than once)."""
        return chain(
            chain.from_iterable(module.parameters() for module in self.modules.values()),
            chain.from_iterable(
                group["params"] for o in self.optimizers.values() for group in o.param_groups
            ),
        )

    def require_no_gradients(self) -> None:
        """A ``.grad`` on any parameter means a half-accumulated attempt: not a boundary."""
        names = layout_names(*self.modules.values())
        holding = {
            names.get(id(p), "<optimizer-only parameter>")
            for p in self.parameters()
            if p.grad is not None
        }
        if holding:
            raise CheckpointError(
                f"{len(holding)} parameters still hold a .grad (e.g. {sorted(holding)[0]}): save "
                "at an update boundary, after optimizer.zero_grad(set_to_none=True)"
            )

    def check(self, payload: Mapping[str, Any], structure: Mapping[str, Any]) -> dict[str, Any]:
        """Raise unless every component has a saved state and the torch ones fit; return the
        saved states by dotted name. ``structure``: this tree's ``structure()`` (a loader has
        it from comparing optimizer types). Reads live objects, changes none."""
        for group, members in self.groups.items():
            held = _saved_state(payload, group)
            if not isinstance(held, Mapping) or set(held) != set(members):
                found = sorted(held, key=str) if isinstance(held, Mapping) else type(held).__name__
                raise CheckpointError(f"{group} differ: checkpoint {found}, current {members}")
        saved = {name: _saved_state(payload, name) for name in self.leaves}
        for name, optimizer in self.optimizers.items():
            layout = structure[f"{name}_layout"]
            check_layout(_field(payload, f"{name}_layout"), layout, f"{name}_layout")
            check_optimizer_state(saved[name], optimizer, layout)
        for name, module in self.modules.items():
            _check_module_state(name, saved[name], module)
        return saved

    def restore_others(self, saved: Mapping[str, Any]) -> None:
        """Restore the components judged by their own ``load_state_dict``, all or none.

        The spec restores weights and optimizer first and cursors after. These steps write
        disjoint objects and none reads another's state, so the order does not change the
        result; these go first because a refusal here must stay undoable, and undoing a
        weight restore would need a second copy of the model. The RNG still comes last.
        """
        previous = {name: _snapshot(c.state_dict(), name) for name, c in self.others.items()}
        done: list[str] = []
        for name, component in self.others.items():
            done.append(name)
            try:
                component.load_state_dict(saved[name])
            except Exception as error:
                _roll_back(self.others, previous, done)
                raise ComponentRefused(
                    f"{name} refused its saved state ({type(error).__name__}: {error}); nothing "
                    "was restored", component=name, error=error,
                ) from error

    def restore_torch(self, saved: Mapping[str, Any]) -> None:
        """Restore modules and optimizers (already checked to fit), then clear gradients."""
        for name, module in self.modules.items():
            module.load_state_dict(saved[name], strict=True)
        for name, optimizer in self.optimizers.items():
            optimizer.load_state_dict(saved[name])  # with the checkpoint's hyperparameters
        # What zero_grad(set_to_none=True) does, without its profiler hook (whose first call
        # imports a module, on the critical path of a fresh process's resume).
        for parameter in self.parameters():
            parameter.grad = None


def _flatten(
    components: Components, prefix: str, groups: dict[str, list[str]]
) -> Iterator[tuple[str, Stateful]]:
    if not isinstance(components, Mapping):
        raise TypeError(
            f"components must be a mapping of names to components, got {components!r:.60}"
        )
    for key, value in components.items():
        if not isinstance(key, str) or not key or "." in key:
            raise CheckpointError(f"component names are non-empty strings without '.', got {key!r}")
        name = prefix + key
        if isinstance(value, Stateful):
            yield name, value
        elif isinstance(value, Mapping) and value:
            groups[name] = sorted(value)
            yield from _flatten(value, name + ".", groups)
        else:
            raise CheckpointError(
                f"component '{name}' is a {type(value).__name__}: give an object with "
                "state_dict() and load_state_dict(), or a non-empty mapping of them"
            )


def _field(payload: Mapping[str, Any], name: str) -> Any:
    if name not in payload:
        raise CheckpointError(f"payload has no '{name}' (was it written by save_checkpoint?)")
    return payload[name]


def _saved_state(payload: Mapping[str, Any], name: str) -> Any:
    node: Any = payload
    parts = name.split(".")
    for depth, key in enumerate(parts):
        if not isinstance(node, Mapping) or key not in node:
            where = ".".join(parts[:depth]) or "payload"
            found = sorted(node, key=str) if isinstance(node, Mapping) and depth else None
            listed = f" (it holds {found})" if found is not None else ""
            raise CheckpointError(
                f"{where} has no '{key}'{listed}: the checkpoint has no state for component "
                f"'{name}'"
            )
        node = node[key]
    return node


def _snapshot(state: Any, name: str) -> Any:
    """A copy of a live state that later changes to the component cannot reach."""
    plain = to_plain(state, name, tensors=True)
    return _clone_tensors(plain)


def _clone_tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _clone_tensors(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_clone_tensors(item) for item in value]
    return value


def _roll_back(
    components: Mapping[str, Stateful], previous: Mapping[str, Any], done: list[str]
) -> None:
    for name in reversed(done):
        try:
            components[name].load_state_dict(previous[name])
        except Exception as error:
            raise CheckpointError(
                f"{name} refused its own previous state while undoing a refused restore "
                f"({type(error).__name__}: {error}); rebuild the components before trying again"
            ) from error


def _check_module_state(name: str, saved: Any, module: torch.nn.Module) -> None:
    """What ``load_state_dict(saved, strict=True)`` needs, plus equal dtypes (it casts)."""
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{name} state in the checkpoint is not a mapping")
    live = module.state_dict()
    missing, unexpected = sorted(live.keys() - saved.keys()), sorted(saved.keys() - live.keys())
    if missing or unexpected:
        raise CheckpointError(
            f"{name} state keys differ: missing from the checkpoint {missing[:_LISTED]}, not in "
            f"the module {unexpected[:_LISTED]}"
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
                f"{key}: checkpoint {list(value.shape)} {value.dtype}, module "
                f"{list(tensor.shape)} {tensor.dtype}"
            )
    if wrong:
        shown = "; ".join(wrong[:_LISTED]) + (" …" if len(wrong) > _LISTED else "")
        raise CheckpointError(f"{name} state does not fit the module — {shown}")
