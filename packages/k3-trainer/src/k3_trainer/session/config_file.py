"""The ``--config`` TOML file of a training session: ``preset``, ``[train]``, ``[model]``
and ``[data.sources]``, read and checked (an unknown key names the closest known one)."""

from __future__ import annotations

import dataclasses
import difflib
import sys
from pathlib import Path
from typing import Any

from ..config import ConfigError, TrainConfig
from ..data import DataError
from ..data.mixture import Source, check_sources
from ..models import ModelSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def read_toml(path: Path | None) -> dict[str, Any]:
    """``--config``: a TOML file with ``preset``, ``[train]`` and ``[model]``, checked."""
    if path is None:
        return {}
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"preset", "train", "model", "data"})
    if unknown:
        known = ["preset", "train", "model", "data"]
        raise ConfigError(
            f"config file {path}: unknown key {suggest(unknown[0], known)}; "
            "expected preset, [train], [model], [data.sources]"
        )
    if not isinstance(data.get("preset", ""), str):
        raise ConfigError(f"config file {path}: preset must be a string, got {data['preset']!r}")
    for table in ("train", "model", "data"):
        if not isinstance(data.get(table, {}), dict):
            raise ConfigError(
                f"config file {path}: {table} must be a table ([{table}]), got {data[table]!r}"
            )
    table = data.get("data", {})
    if set(table) - {"sources"} or not isinstance(table.get("sources", {}), dict):
        raise ConfigError(
            f"config file {path}: [data] holds one table, [data.sources], of "
            'NAME = {{ path = "DIR", weight = W }}'
        )
    return data


def suggest(name: str, known: list[str]) -> str:
    """``'name'`` and, when a known name is close, ``(did you mean 'that'?)``."""
    close = difflib.get_close_matches(name, known, n=1)
    return f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def check_toml_fields(toml: dict[str, Any], spec: ModelSpec, path: Path | None) -> None:
    """Refuse a ``[train]`` or ``[model]`` key that names no field, with the closest one."""
    for table, names in (
        ("train", [f.name for f in dataclasses.fields(TrainConfig)]),
        ("model", list(spec.field_names)),
    ):
        for key in toml.get(table, {}):
            if key not in names:
                raise ConfigError(
                    f"config file {path}: [{table}] has no field {suggest(key, names)}"
                )


def toml_sources(toml: dict[str, Any]) -> tuple[Source, ...]:
    """``[data.sources]``: ``web = { path = "data/web", weight = 0.7 }`` per source."""
    sources = []
    for name, entry in toml.get("data", {}).get("sources", {}).items():
        if not (
            isinstance(entry, dict)
            and set(entry) == {"path", "weight"}
            and isinstance(entry["path"], str)
            and isinstance(entry["weight"], int | float)
            and not isinstance(entry["weight"], bool)
        ):
            raise ConfigError(
                f"config file [data.sources] {name}: expected "
                '{ path = "DIR", weight = W }, got ' + repr(entry)
            )
        sources.append(Source(str(name), Path(entry["path"]), float(entry["weight"])))
    return tuple(sources)


def data_of(
    data: Path | tuple[Source, ...] | None, toml: dict[str, Any]
) -> tuple[Path | None, tuple[Source, ...]]:
    """The session's data: ``data`` (one dataset folder, or a mixture's sources), else the
    config file's ``[data.sources]``; ``(None, ())`` when neither names any."""
    if isinstance(data, Path):
        return data, ()
    sources = data or toml_sources(toml)
    if sources:
        try:
            check_sources(sources)
        except DataError as exc:
            where = "--data" if data else "config file [data.sources]"
            raise ConfigError(f"{where}: {exc}") from None
        return sources[0].path, tuple(sources)
    return None, ()
