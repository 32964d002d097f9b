"""``snapshot_checkpoint``: a checkpoint taken now and written later, off the training path.

A synchronous save stops training for the whole serialize + checksum + fsync. A snapshot
splits it: the payload is built at the update boundary as ``save_checkpoint`` builds it
(checks, metadata, runtime signature and RNG are of that boundary) with every tensor
copied off the live objects, so training can change them at once, and
:meth:`CheckpointSnapshot.write` writes exactly what ``save_checkpoint`` would have written
then, atomically, on whatever thread calls it. Copies go to host memory (pinned when they
come from a GPU, so the device-to-host copies run at full speed); tensors that share a
storage (tied weights, a view and its base) share one copy, so the file keeps the sharing.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .components import Components
from .errors import CheckpointError
from .payload import write_payload
from .save import build_payload

__all__ = ["CheckpointSnapshot", "snapshot_checkpoint"]


@dataclass(frozen=True)
class CheckpointSnapshot:
    """A payload held in host memory until :meth:`write` puts it on disk."""

    payload: dict[str, Any]
    nbytes: int
    """Bytes of tensor data the snapshot copied: the memory it holds until written."""

    def write(self, path: str | os.PathLike[str]) -> str:
        """Write the snapshot to ``path`` as ``save_checkpoint`` does (atomic, fsynced);
        return the checksum. Safe on another thread: nothing live is read."""
        try:
            return write_payload(path, self.payload)
        except CheckpointError as error:
            raise error.with_path(path) from error


def snapshot_checkpoint(
    components: Components,
    metadata: Mapping[str, Any] | None = None,
    *,
    modules: Sequence[torch.nn.Module] = (),
) -> CheckpointSnapshot:
    """The checkpoint ``save_checkpoint(path, components, metadata)`` would write now, held
    in memory with every tensor copied; refused (``CheckpointError``, nothing held) for the
    same reasons a save is refused."""
    copier = _Copier()
    payload = build_payload(components, metadata or {}, modules, copy=copier.states)
    copier.finish()
    return CheckpointSnapshot(payload, copier.nbytes)


class _Copier:
    """Copies every storage once, then rebuilds each tensor as the same view of its copy."""

    def __init__(self) -> None:
        self.copies: dict[tuple[str, int], torch.UntypedStorage] = {}
        self.nbytes = 0
        self.from_device = False

    def states(self, states: dict[str, Any]) -> dict[str, Any]:
        copied: dict[str, Any] = self.value(states)
        return copied

    def value(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, dict):  # a copy of its own type: a module state keeps _metadata
            copied = copy.copy(value)
            for key, item in value.items():
                copied[key] = self.value(item)
            return copied
        if isinstance(value, Mapping):
            return {key: self.value(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.value(item) for item in value]
        if isinstance(value, tuple):
            return tuple(self.value(item) for item in value)
        return value

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        storage = tensor.untyped_storage()
        key = (str(storage.device), storage.data_ptr())
        copy = self.copies.get(key)
        if copy is None:
            copy = self.copies[key] = self.storage(storage)
        out = torch.empty((0,), dtype=tensor.dtype)
        return out.set_(copy, tensor.storage_offset(), tensor.shape, tensor.stride())

    def storage(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        size = storage.nbytes()
        self.nbytes += size
        source = torch.empty((0,), dtype=torch.uint8, device=storage.device).set_(storage)
        if storage.device.type == "cpu":
            return source.clone().untyped_storage()
        self.from_device = True
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        pinned.copy_(source, non_blocking=True)
        return pinned.untyped_storage()

    def finish(self) -> None:
        """Device-to-host copies are asynchronous: wait for them before anyone reads."""
        if self.from_device and torch.cuda.is_available():
            torch.cuda.synchronize()
