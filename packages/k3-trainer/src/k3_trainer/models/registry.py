"""Model specs by name: the built-in ``k3``, those a program registers, and those an
installed package declares under the ``k3_trainer.models`` entry-point group (its value
an importable ``module:SPEC``), so a plugin's model trains with ``k3-train train --model
NAME`` without any change here.

Torch-free: the command reads a spec's config class and presets before torch loads.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from ..config import ConfigError
from .spec import ModelSpec

ENTRY_POINT_GROUP = "k3_trainer.models"
DEFAULT_MODEL = "k3"
_BUILTIN = {"k3": "k3_trainer.models.k3:SPEC"}
_registered: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec, *, replace: bool = False) -> ModelSpec:
    """Make ``spec`` available by its name; refuses a name already taken unless
    ``replace``."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"register_model needs a ModelSpec, got {type(spec).__name__}")
    if not replace and spec.name in model_names():
        raise ValueError(f"a model named {spec.name!r} is already registered")
    _registered[spec.name] = spec
    return spec


def unregister_model(name: str) -> None:
    """Forget a model :func:`register_model` added (built-in and installed ones stay)."""
    _registered.pop(name, None)


def _declared() -> dict[str, str]:
    """``{name: "module:attribute"}``: the built-in specs, then installed packages'."""
    found = dict(_BUILTIN)
    for point in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(point.name, point.value)
    return found


def model_names() -> list[str]:
    return sorted({*_declared(), *_registered})


def get_model_spec(name: str) -> ModelSpec:
    """The spec registered as ``name``; ``ConfigError`` listing the known names."""
    if name in _registered:
        return _registered[name]
    target = _declared().get(name)
    if target is None:
        raise ConfigError(f"--model: unknown model {name!r}; known models: "
                          f"{', '.join(model_names())}")
    module, _, attribute = target.partition(":")
    try:
        spec = getattr(importlib.import_module(module), attribute or "SPEC")
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--model {name}: {target} cannot be loaded ({exc})") from None
    if not isinstance(spec, ModelSpec) or spec.name != name:
        raise ConfigError(f"--model {name}: {target} is not the ModelSpec named {name!r}")
    _registered[name] = spec
    return spec


def spec_for_model_type(model_type: object) -> ModelSpec:
    """The spec whose hub format reads ``config.json``'s ``model_type``."""
    specs = [get_model_spec(name) for name in model_names()]
    for spec in specs:
        if spec.hub is not None and model_type in spec.hub.model_types:
            return spec
    readable = sorted({kind for spec in specs if spec.hub for kind in spec.hub.model_types})
    raise ConfigError(f"model_type {model_type!r} is not one any registered model reads "
                      f"({', '.join(readable)})")
