"""What a real step allocates, to hold the plan to: a rank's local parameter, gradient
and optimizer-state bytes, and the bytes autograd saves in a forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def state_nbytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """``numel × element_size`` summed over this rank's local shards of the parameters,
    their gradients and every tensor in the optimizer's state."""
    params = list(model.parameters())
    state = 0
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                state += _nbytes(value)
    return {"params": sum(_nbytes(p) for p in params),
            "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": state}


def saved_activation_bytes(model: nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Bytes of every tensor autograd saves during ``forward()`` (a loss), each storage
    once and the parameters left out; then runs the backward."""
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    loss.backward()  # type: ignore[no-untyped-call]
    return sum(seen.values())
