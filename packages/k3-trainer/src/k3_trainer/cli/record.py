"""Run provenance: ``run.json`` records what ran, with which model, code, data and
machine; each session of the run appends its own launch."""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from ..observe.run import RUN_RECORD, read_run_record

PACKAGES = ("k3-optim", "k3-qkclip", "k3-checkpoint", "k3-model", "k3-trainer", "torch",
            "numpy")


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def host() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


@dataclass(frozen=True)
class Session:
    """What one session of a run records: the run's resolved configs and data (the latest
    session's win) and the session's own launch."""

    train_config: dict[str, Any]
    model: str
    """The model spec's name (``--model``)."""
    model_config: dict[str, Any]
    preset: str | None
    data_dir: str
    manifest_digest: str
    device: str
    resumed_from_step: int | None = None
    data_parallel: dict[str, Any] | None = None
    init_from: str | None = None
    """The hub folder whose weights a fresh run started from (``--init-from``)."""
    sources: list[dict[str, Any]] | None = None
    """A mixture's sources: name, dir, weight, manifest_digest (None: one dataset)."""
    phase: dict[str, Any] | None = None
    """A phase this session starts: name, step, changes."""
    resumed_from: str | None = None
    """The checkpoint this session resumed from."""
    branch: dict[str, Any] | None = None
    """``--resume-from`` an older checkpoint: from (its path), step, superseded_records."""


def write_run_record(run_dir: str | Path, session: Session) -> None:
    """Create or extend ``run.json`` (one entry per session), written atomically."""
    path = Path(run_dir) / RUN_RECORD
    record: dict[str, Any]
    if path.exists():
        record = read_run_record(run_dir)
    else:
        record = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sessions": []}
    record.update(train_config=session.train_config, model=session.model,
                  model_config=session.model_config,
                  preset=session.preset,
                  data={"dir": session.data_dir, "manifest_digest": session.manifest_digest,
                        **({"sources": session.sources} if session.sources else {})})
    if session.phase is not None:
        record.setdefault("phases", []).append(session.phase)
    if session.branch is not None:
        record.setdefault("branches", []).append(session.branch)
    parallel = session.data_parallel
    if session.init_from is not None:
        record["init_from"] = session.init_from
    record["sessions"].append({
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": sys.argv,
        "resumed_from_step": session.resumed_from_step,
        **({"resumed_from": session.resumed_from} if session.resumed_from is not None else {}),
        **({"branch": session.branch["step"]} if session.branch is not None else {}),
        "device": session.device,
        **({"data_parallel": parallel} if parallel is not None else {}),
        **({"init_from": session.init_from} if session.init_from is not None else {}),
        **({"phase": session.phase["name"]} if session.phase is not None else {}),
        "versions": versions(),
        "host": host(),
    })
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)
