"""``--data``'s two forms, one dataset folder or a mixture's ``NAME=DIR:WEIGHT`` sources,
read from the command line, the config file's ``[data.sources]`` or the run's record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..data import DataError
from ..data.mixture import Source, check_sources
from ..record import RunRecord


def toml_sources(toml: dict[str, Any]) -> tuple[Source, ...]:
    """``[data.sources]``: ``web = { path = "data/web", weight = 0.7 }`` per source."""
    sources = []
    for name, entry in toml.get("data", {}).get("sources", {}).items():
        if not (isinstance(entry, dict) and set(entry) == {"path", "weight"}
                and isinstance(entry["path"], str)
                and isinstance(entry["weight"], int | float)
                and not isinstance(entry["weight"], bool)):
            raise ConfigError(f"config file [data.sources] {name}: expected "
                              "{ path = \"DIR\", weight = W }, got " + repr(entry))
        sources.append(Source(str(name), Path(entry["path"]), float(entry["weight"])))
    return tuple(sources)


def data_of(values: list[str] | None, toml: dict[str, Any]) -> tuple[Path | None,
                                                                      tuple[Source, ...]]:
    """``--data``: one dataset folder, or a mixture's ``NAME=DIR:WEIGHT`` sources (else
    the config file's ``[data.sources]``); ``(None, ())`` when neither names any."""
    if values:
        return command_line_data(values)
    sources = toml_sources(toml)
    if sources:
        try:
            check_sources(sources)
        except DataError as exc:
            raise ConfigError(f"config file [data.sources]: {exc}") from None
        return sources[0].path, sources
    return None, ()


def command_line_data(values: list[str], default_weight: float | None = None
                      ) -> tuple[Path, tuple[Source, ...]]:
    """Repeated ``--data``: one dataset folder (no sources), or every source of a mixture
    as ``NAME=DIR:WEIGHT`` (``NAME=DIR`` too where a ``default_weight`` is given)."""
    named = [value for value in values if "=" in value]
    if not named and len(values) == 1:
        return Path(values[0]), ()
    if len(named) != len(values):
        form = "NAME=DIR[:WEIGHT]" if default_weight is not None else "NAME=DIR:WEIGHT"
        raise ConfigError(f"--data: give one dataset folder, or every source of a mixture "
                          f"as {form}")
    try:
        sources = tuple(Source.parse(value, default_weight) for value in values)
        check_sources(sources)
    except DataError as exc:
        raise ConfigError(str(exc)) from None
    return sources[0].path, sources


def recorded_sources(record: RunRecord) -> tuple[Source, ...]:
    """The mixture a run's record names (none for a run on one dataset)."""
    return tuple(Source(s.name, Path(s.dir), s.weight) for s in record.data.sources)
