"""``inspect_checkpoint``: what a checkpoint holds, without building a model or optimizer."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .payload import read_verified

__all__ = ["CheckpointSummary", "inspect_checkpoint"]


@dataclass(frozen=True)
class CheckpointSummary:
    """A verified checkpoint at a glance: counters, configs, identities and sizes."""

    path: Path
    digest: str
    format_version: int
    file_bytes: int
    counters: dict[str, int | None]
    train_config: dict[str, Any]
    model_config: dict[str, Any]
    vocab_size: int
    optimizer_type: str
    parameters: int
    """Elements over all optimized parameters."""
    model_bytes: int
    optimizer_bytes: int
    loaders: dict[str, dict[str, Any]]
    runtime: dict[str, Any]
    qk_clip: dict[str, Any] | None
    has_grad_scaler: bool

    def lines(self) -> list[str]:
        """Human-readable summary, one fact per line (what ``k3-train inspect`` prints)."""
        counters = ", ".join(f"{name}={value}" for name, value in self.counters.items())
        loaders = ", ".join(
            f"{name} @ {state.get('offset')} ({str(state.get('manifest_digest'))[:12]})"
            for name, state in self.loaders.items()
        )
        runtime = self.runtime
        return [
            f"checkpoint     {self.path} (format {self.format_version}, "
            f"{_size(self.file_bytes)}, digest {self.digest[:16]}…)",
            f"counters       {counters}",
            f"model          {self.parameters:,} parameters, {_size(self.model_bytes)} of state, "
            f"vocab {self.vocab_size}",
            f"optimizer      {self.optimizer_type}, {_size(self.optimizer_bytes)} of state",
            f"loaders        {loaders or 'none'}",
            f"runtime        torch {runtime.get('torch_version')} on "
            f"{'+'.join(runtime.get('device_type', []))}, {runtime.get('num_threads')} threads, "
            f"deterministic={runtime.get('deterministic_algorithms')}",
            f"grad scaler    {'saved' if self.has_grad_scaler else 'none'}",
            f"qk-clip        {'recorded' if self.qk_clip is not None else 'none'}",
            f"model_config   {self.model_config}",
            f"train_config   {self.train_config}",
        ]


def inspect_checkpoint(path: str | os.PathLike[str]) -> CheckpointSummary:
    """Read and verify ``path`` and summarize it; raises ``CheckpointError`` like the loader."""
    payload, digest = read_verified(path)
    try:
        return _summary(Path(path), payload, digest)
    except (AttributeError, KeyError, TypeError, ValueError) as error:  # a crafted payload
        raise CheckpointError(f"is not a complete format-7 payload ({error})", path=path) from error


def _summary(path: Path, payload: dict[str, Any], digest: str) -> CheckpointSummary:
    layout = payload.get("optimizer_layout", [])
    return CheckpointSummary(
        path=path,
        digest=digest,
        format_version=payload["format_version"],
        file_bytes=path.stat().st_size,
        counters=dict(payload.get("counters", {})),
        train_config=dict(payload.get("train_config", {})),
        model_config=dict(payload.get("model_config", {})),
        vocab_size=payload.get("vocab_size", 0),
        optimizer_type=payload.get("optimizer_type", "?"),
        parameters=sum(_numel(entry.get("shape", [])) for entry in layout),
        model_bytes=sum(tensor.nbytes for tensor in _tensors(payload.get("model"))),
        optimizer_bytes=sum(tensor.nbytes for tensor in _tensors(payload.get("optimizer"))),
        loaders=dict(payload.get("loaders", {})),
        runtime=dict(payload.get("runtime", {})),
        qk_clip=payload.get("qk_clip"),
        has_grad_scaler=payload.get("grad_scaler") is not None,
    )


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _size(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"
