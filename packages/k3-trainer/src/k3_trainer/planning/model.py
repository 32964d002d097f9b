"""The model a plan is for: a preset, a hub folder's ``config.json`` or a config file's
``preset`` and ``[model]`` table. The planner counts K3's layers by kind (KDA, MLA,
LatentMoE, Attention Residuals), so it is, beside ``models/k3.py``, the one part of the
trainer that knows ``k3_model``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from k3_model import K3Config

from ..config import ConfigError


def plannable(model_config: Any) -> bool:
    """Whether the planner's formulas describe this model (K3's configuration)."""
    return isinstance(model_config, K3Config)


def planned_model(preset: str | None = None, folder: Path | None = None,
                  config_file: dict[str, Any] | None = None) -> K3Config:
    """The model of exactly one of ``preset``, a hub ``folder`` or a TOML config file's
    contents (``preset`` and ``[model]``); a ``ConfigError`` naming the flags otherwise, or
    for a value the config refuses."""
    if sum(x is not None for x in (preset, folder, config_file)) != 1:
        raise ConfigError("plan: give exactly one of --preset NAME, --model DIR, --config FILE")
    from k3_model.presets import preset as named_preset

    try:
        if preset is not None:
            return named_preset(preset)
        if folder is not None:
            from k3_model.hub import from_hub_config

            return from_hub_config(json.loads((folder / "config.json").read_text()))
        assert config_file is not None
        return named_preset(config_file.get("preset", "tiny"), **config_file.get("model", {}))
    except ValueError as exc:
        raise ConfigError(f"plan: {exc}") from None
