"""FSDP2 checkpoints, first form: the whole state gathered into a one-process replica.

An FSDP2 rank holds row shards (DTensors) of every weight and of the optimizer state.
Here they are gathered into a plain replica of the model and its optimizer (every rank
keeps one), so the checkpoint is the ordinary format-7 file, validated by the same gate,
and independent of the world size; on resume each rank loads the file into its replica
and takes back its own rows. The cost is one full copy of the state per rank: right for
models that fit one host, and the reason sharded ``torch.distributed.checkpoint``
folders are the next step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def _full(value: Any) -> Any:
    """A DTensor gathered whole (a collective, so every rank must call it in the same
    order), anything else as it is."""
    full = getattr(value, "full_tensor", None)
    return full().detach().clone() if callable(full) else value


def _shard_like(full: Tensor, like: Any) -> Tensor:
    """This rank's part of ``full`` with the placement of DTensor ``like`` (sliced
    locally: every rank holds the same full tensor)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh,
                             like.placements, src_data_rank=None)


def gather_into(model: nn.Module, optimizer: torch.optim.Optimizer, replica: nn.Module,
                replica_optimizer: torch.optim.Optimizer) -> None:
    """Copy the sharded ``model``/``optimizer`` state, whole, into the replicas."""
    with torch.no_grad():
        replica.load_state_dict({k: _full(v) for k, v in model.state_dict().items()})
    saved = optimizer.state_dict()
    saved["state"] = {index: {k: _full(v) for k, v in entry.items()}
                      for index, entry in saved["state"].items()}
    replica_optimizer.load_state_dict(saved)


def scatter_from(replica: nn.Module, replica_optimizer: torch.optim.Optimizer,
                 model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Give the sharded ``model``/``optimizer`` their rows of the replicas' state."""
    full = replica.state_dict()
    with torch.no_grad():
        for name, value in model.state_dict().items():
            if hasattr(value, "device_mesh"):
                local: Any = _shard_like(full[name], value)
                value.to_local().copy_(local.to_local())
            else:
                value.copy_(full[name])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = replica_optimizer.state_dict()
    state: dict[Any, Any] = {}
    for index, entry in saved["state"].items():
        param = params[index]
        state[index] = {
            key: _shard_like(value, param)
            if hasattr(param, "device_mesh") and isinstance(value, Tensor)
            and tuple(value.shape) == tuple(param.shape) else value
            for key, value in entry.items()}
    optimizer.load_state_dict({**saved, "state": state})
    optimizer.zero_grad(set_to_none=True)
