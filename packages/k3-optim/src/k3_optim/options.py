"""MuonAdamW's hyperparameters: their defaults and one check per option.

Every check raises ``ValueError`` naming the option (and the param group, for a group's
override) and what it accepts, before any state exists.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .muon import UPDATE_SCALES
from .newton_schulz import NS_METHODS, resolve_coefficients, resolve_ns_dtype


def validate_options(options: dict[str, Any], *, where: str) -> None:
    """Raise ``ValueError`` naming the offending option for any invalid hyperparameter."""

    def number(name: str, *, low: float = 0.0, high: float | None = None,
               high_inclusive: bool = False, low_open: bool = False) -> None:
        value = options[name]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: {name} must be a finite number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{where}: {name} must be a finite number, got {value!r}")
        too_high = high is not None and (value > high if high_inclusive else value >= high)
        too_low = value <= low if low_open else value < low
        if too_low or too_high:
            open_ = "(" if low_open else "["
            close = "]" if high_inclusive else ")"
            bound = (f"{open_}{low}, {high}{close}" if high is not None
                     else f"> {low}" if low_open else f">= {low}")
            raise ValueError(f"{where}: {name} must be in {bound}, got {value!r}")

    def flag(name: str) -> None:
        if not isinstance(options.get(name, False), bool):
            raise ValueError(f"{where}: {name} must be True or False, got {options[name]!r}")

    number("lr")
    number("weight_decay")
    number("momentum", high=1.0)
    number("ns_eps")
    number("eps")
    number("normuon_beta2", high=1.0)
    number("normuon_eps", low_open=True)
    betas = options["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"{where}: betas[{i}] must be in [0, 1), got {beta!r}")
    for name in ("nesterov", "normuon", "cautious_weight_decay", "flatten"):
        flag(name)
    if options["update_scale"] not in UPDATE_SCALES:
        raise ValueError(
            f"{where}: unknown update_scale {options['update_scale']!r}; "
            f"use one of {', '.join(UPDATE_SCALES)}"
        )
    if options["ns_method"] not in NS_METHODS:
        raise ValueError(
            f"{where}: unknown ns_method {options['ns_method']!r}; "
            f"use one of {', '.join(NS_METHODS)}"
        )
    try:
        resolve_ns_dtype(options["ns_dtype"])
        resolve_coefficients(options["ns_coefficients"], options["ns_steps"])
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    heads = options.get("num_heads")
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
        raise ValueError(f"{where}: num_heads must be a positive integer or None, got {heads!r}")
