"""``--data``'s command-line forms: one dataset folder, or a mixture's
``NAME=DIR:WEIGHT`` sources (``NAME=DIR`` too where a default weight is given)."""

from __future__ import annotations

from pathlib import Path

from ..config import ConfigError
from ..data import DataError
from ..data.mixture import Source, check_sources


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
