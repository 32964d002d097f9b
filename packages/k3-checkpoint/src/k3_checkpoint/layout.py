"""Optimizer identity and per-parameter layout, and the structural check of a saved optimizer state.

``torch.optim.Optimizer.load_state_dict`` matches saved state to live parameters by position
only: with groups rebuilt in another order, or a parameter renamed or reshaped, it would load
Adam moments into the wrong tensors without a word. The layout (group, name, shape, dtype per
parameter, in optimizer order) makes that match explicit and checkable.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch

from .errors import CheckpointError

__all__ = [
    "check_layout", "check_optimizer_state", "layout_names", "optimizer_identity",
    "optimizer_layout", "parameter_shaped",
]  # fmt: skip

_LISTED = 5  # items named in a message before "…"


def optimizer_identity(optimizer: torch.optim.Optimizer) -> str:
    """``module.qualname`` of the optimizer's class, e.g. ``torch.optim.adamw.AdamW``."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def layout_names(*modules: torch.nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` over ``modules`` (the first module owning a parameter wins)."""
    names: dict[int, str] = {}
    for module in reversed(modules):
        names.update({id(parameter): name for name, parameter in module.named_parameters()})
    return names


def optimizer_layout(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | dict[int, str]
) -> list[dict[str, Any]]:
    """One ``{"group", "name", "shape", "dtype"}`` per optimized parameter, in optimizer order.

    Names come from the group's ``param_names`` when the optimizer keeps them (torch >= 2.6 does
    for named parameters; ``k3_optim.MuonAdamW`` always does), else from
    ``model.named_parameters()`` (or a ``layout_names`` map). A parameter the model does not
    own is an error: loading the
    model would not restore it, so its optimizer state would resume against stale values.
    """
    model_names = model if isinstance(model, dict) else layout_names(model)
    layout = []
    for group_index, group in enumerate(optimizer.param_groups):
        parameters = group["params"]
        names = group.get("param_names")
        if names is not None and len(names) != len(parameters):
            raise CheckpointError(
                f"optimizer group {group_index} has {len(parameters)} params but "
                f"{len(names)} param_names"
            )
        for index, parameter in enumerate(parameters):
            if id(parameter) not in model_names:
                raise CheckpointError(
                    f"optimizer group {group_index} parameter {index} (shape "
                    f"{list(parameter.shape)}) is not a parameter of the model"
                )
            layout.append(
                {
                    "group": group_index,
                    "name": names[index] if names is not None else model_names[id(parameter)],
                    "shape": list(parameter.shape),
                    "dtype": str(parameter.dtype),
                }
            )
    return layout


def parameter_shaped(state: tuple[int, ...], parameter: tuple[int, ...]) -> bool:
    """Whether optimizer state of shape ``state`` fits a parameter of shape ``parameter``:
    the same shape, or its leading dims (one statistic per row, or per row of each matrix
    of a stack, as NorMuon's ``row_second_moment``)."""
    return 0 < len(state) <= len(parameter) and state == parameter[:len(state)]


def check_optimizer_state(
    saved: Any, optimizer: torch.optim.Optimizer, layout: list[dict[str, Any]]
) -> None:
    """Raise unless ``optimizer.load_state_dict(saved)`` would put every tensor where it belongs.

    Checks what ``load_state_dict`` assumes without checking: the same number of groups and of
    parameters per group, the same hyperparameter keys per group (so no setting silently keeps
    a constructor default; keys the optimizer declares in ``legacy_hyperparameters`` may be
    missing from an older checkpoint, as its ``load_state_dict`` fills them), distinct
    parameter ids, state only for known parameters, and every
    multi-element state tensor shaped like its parameter (or like its leading dims: per-row
    statistics, as NorMuon keeps). ``layout`` (the live one, already
    compared with the checkpoint's) names parameters in messages. Optimizers whose state is
    not parameter-shaped (factored moments) fail the last check; see the README.
    """
    if not isinstance(saved, Mapping) or not isinstance(saved.get("param_groups"), list):
        raise CheckpointError("optimizer state has no 'param_groups' list")
    if not isinstance(saved.get("state"), Mapping):
        raise CheckpointError("optimizer state has no 'state' mapping")
    saved_groups, live_groups = saved["param_groups"], optimizer.param_groups
    if len(saved_groups) != len(live_groups):
        raise CheckpointError(
            f"optimizer parameter groups: checkpoint {len(saved_groups)}, current "
            f"{len(live_groups)}"
        )
    for index, (saved_group, live_group) in enumerate(zip(saved_groups, live_groups)):
        if not isinstance(saved_group, Mapping) or not isinstance(saved_group.get("params"), list):
            raise CheckpointError(f"optimizer group {index} has no 'params' list")
        if len(saved_group["params"]) != len(live_group["params"]):
            raise CheckpointError(
                f"optimizer group {index} parameters: checkpoint {len(saved_group['params'])}, "
                f"current {len(live_group['params'])}"
            )
        # Keys an optimizer added after the checkpoint was written, and fills in with their
        # old behaviour when it loads it (MuonAdamW.legacy_hyperparameters).
        filled = set(getattr(optimizer, "legacy_hyperparameters", ()))
        only_saved, only_live = (
            set(saved_group) - set(live_group),
            set(live_group) - set(saved_group) - filled,
        )
        if only_saved or only_live:
            raise CheckpointError(
                f"optimizer group {index} hyperparameter keys differ: only in the checkpoint "
                f"{sorted(only_saved)}, only in the optimizer {sorted(only_live)}"
            )
    ids = list(chain.from_iterable(group["params"] for group in saved_groups))
    if any(type(key) is not int for key in ids) or len(set(ids)) != len(ids):
        raise CheckpointError("optimizer parameter ids are not distinct integers")
    live = list(chain.from_iterable(group["params"] for group in live_groups))
    position = {key: index for index, key in enumerate(ids)}
    wrong: list[str] = []
    for key, entry in saved["state"].items():
        if key not in position or not isinstance(entry, Mapping):
            raise CheckpointError(f"optimizer state entry {key!r} matches no parameter")
        parameter, name = live[position[key]], layout[position[key]]["name"]
        for field, value in entry.items():
            if (
                isinstance(value, torch.Tensor)
                and value.numel() > 1
                and not parameter_shaped(tuple(value.shape), tuple(parameter.shape))
            ):
                wrong.append(f"{name}.{field} {list(value.shape)} vs {list(parameter.shape)}")
    if wrong:
        raise CheckpointError(
            "optimizer state tensors do not match their parameters' shapes: "
            + ", ".join(wrong[:_LISTED])
            + (" …" if len(wrong) > _LISTED else "")
        )


def check_layout(saved: Any, current: list[dict[str, Any]], key: str) -> None:
    """Raise unless the saved layout (payload ``key``) equals the live one, entry by entry."""
    if not isinstance(saved, list):
        raise CheckpointError(f"{key} in the checkpoint is not a list")
    wrong = [
        f"[{index}] checkpoint {_entry(old)}, current {_entry(new)}"
        for index, (old, new) in enumerate(zip(saved, current))
        if old != new
    ]
    if len(saved) != len(current):
        wrong.append(f"checkpoint {len(saved)} parameters, current {len(current)}")
    if wrong:
        shown = "; ".join(wrong[:_LISTED]) + (" …" if len(wrong) > _LISTED else "")
        raise CheckpointError(f"incompatible {key} — {shown}")


def _entry(entry: Any) -> str:
    if not isinstance(entry, Mapping):
        return repr(entry)
    group, name, shape, dtype = (entry.get(key) for key in ("group", "name", "shape", "dtype"))
    return f"group {group} {name} {shape} {dtype}"
