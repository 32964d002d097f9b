"""``run.json``: where a run records what ran (written by the ``k3-train`` command, read
by the report and by a later session)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RUN_RECORD = "run.json"


def read_run_record(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / RUN_RECORD
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: {run_dir} is not a k3-train run "
                                "directory") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is unreadable: {exc}") from None
    if not isinstance(record, dict) or "train_config" not in record:
        raise ValueError(f"{path} is not a k3-train run record")
    return record
