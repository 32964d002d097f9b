"""A JSON object read from a file, or one line saying why it cannot be: the one reader of
the files the commands open that hold a JSON object (a dataset's manifest, a hub folder's
``config.json`` and ``generation_config.json``), each refusal in the caller's error class.

Torch-free, like its callers' modules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_object(path: Path, error: type[Exception], *, missing: str | None = None,
                     what: str | None = None) -> dict[str, Any]:
    """``path``'s JSON object. Raises ``error``: with ``missing`` (default ``"PATH not
    found"``) when there is no file, and naming ``what`` (default the path) when it cannot
    be read, is not valid JSON, or holds something else than an object."""
    name = what or str(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(missing or f"{path} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{name} must hold a JSON object, not {type(data).__name__}")
    return data
