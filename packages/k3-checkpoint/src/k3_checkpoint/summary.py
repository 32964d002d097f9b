"""``inspect_checkpoint``: what a checkpoint holds, without building any component."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .payload import read_verified
from .plain import tensors_in

__all__ = ["CheckpointSummary", "format_bytes", "format_value", "inspect_checkpoint"]

_SHOWN = 160  # characters of a value shown on a summary line


@dataclass(frozen=True)
class CheckpointSummary:
    """A verified checkpoint at a glance: one entry per payload key."""

    path: Path
    digest: str
    format_version: int
    file_bytes: int
    entries: dict[str, Any]
    """The payload without its tensors: each tensor becomes ``"<tensor [shape] dtype>"``."""
    tensor_bytes: dict[str, int]
    """Bytes of tensor data under each payload key (0 for plain metadata)."""

    def lines(self) -> list[str]:
        """Human-readable summary, one payload key per line (what a CLI's ``inspect`` prints)."""
        lines = [
            f"checkpoint     {self.path} (format {self.format_version}, "
            f"{format_bytes(self.file_bytes)}, checksum {self.digest[:16]}…)"
        ]
        for key, value in self.entries.items():
            if key in ("format_version", "rng"):
                continue
            size = self.tensor_bytes.get(key, 0)
            text = f"{format_bytes(size)} of tensors" if size else format_value(value)
            lines.append(f"{key:<14} {text}")
        return lines


def inspect_checkpoint(path: str | os.PathLike[str]) -> CheckpointSummary:
    """Read and verify ``path`` and summarize it; raises ``CheckpointError`` like the loader."""
    payload, digest = read_verified(path)
    path = Path(path)
    return CheckpointSummary(
        path=path,
        digest=digest,
        format_version=int(payload["format_version"]),
        file_bytes=path.stat().st_size,
        entries={str(key): _described(value) for key, value in payload.items()},
        tensor_bytes={
            str(key): sum(tensor.nbytes for tensor in tensors_in(value))
            for key, value in payload.items()
        },
    )


def _described(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return f"<tensor {list(value.shape)} {value.dtype}>"
    if isinstance(value, Mapping):
        return {key: _described(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_described(item) for item in value]
    return value


def format_value(value: Any) -> str:
    """``a=1, b=2`` for a mapping of scalars (counters), else the value's repr, shortened
    to a summary line's width (what :meth:`CheckpointSummary.lines` shows of a value)."""
    if isinstance(value, Mapping) and all(
        not isinstance(item, (Mapping, list)) for item in value.values()
    ):
        text = ", ".join(f"{key}={item}" for key, item in value.items())
    else:
        text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 1] + "…"


def format_bytes(size: int) -> str:
    """``size`` bytes in the largest binary unit that keeps it ≥ 1 (``1.5 MiB``, ``12 B``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"
