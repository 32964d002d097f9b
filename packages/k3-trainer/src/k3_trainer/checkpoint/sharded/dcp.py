"""The ``torch.distributed.checkpoint`` plumbing that writing, reading and inspecting share.

Which components go through DCP's state-dict API (the model and its optimizer), how one
process runs DCP without a process group, and the load planner that reads a saved value
that is not a tensor as plain data only. DCP itself is imported on first use: it takes
most of a second, which a command that never touches a sharded checkpoint should not pay.
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

import k3_checkpoint

from ...distributed import Parallel
from ..agreement import leaves
from ..components import MODEL, OPTIMIZER, TENSOR_COMPONENTS
from .tree import place_at

if TYPE_CHECKING:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner



def is_main(parallel: Parallel | None) -> bool:
    return parallel is None or parallel.is_main


def no_dist(parallel: Parallel | None) -> bool:
    """One process (``parallel=None``): DCP reads and writes everything here, no group."""
    return parallel is None or not dist.is_initialized()


def model_and_optimizer(states: Mapping[str, Any]
                         ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    model, optimizer = states.get(MODEL), states.get(OPTIMIZER)
    if not isinstance(model, nn.Module):
        raise TypeError("a sharded checkpoint's states need the model under 'model'")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"states['optimizer'] is a {type(optimizer).__name__}, not an optimizer")
    return model, optimizer


def other_components(states: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(dotted name, component)`` of every component but the model and optimizer."""
    return leaves({k: v for k, v in states.items() if k not in TENSOR_COMPONENTS})


def optimizer_record(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """The optimizer's class and layout (``CheckpointError`` for a parameter the model does
    not own)."""
    return {"type": k3_checkpoint.optimizer_identity(optimizer),
            "layout": k3_checkpoint.optimizer_layout(optimizer, model)}


def stage_options(parallel: Parallel | None) -> Any:
    """DCP's state-dict options: under pipeline stages the optimizer's groups are keyed by
    their parameters' names (``flatten_optimizer_state_dict``), since each stage's
    optimizer numbers its own groups from 0 and the stages' entries would collide."""
    if parallel is None or parallel.pipeline == 1:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0]


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: one process reading
    or writing a sharded checkpoint (``eval``, ``sample``, a resume on one device) is
    intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@functools.cache
def weights_only_planner() -> type[DefaultLoadPlanner]:
    """DCP's default load planner, except that a saved value that is not a tensor (a
    counter, a cursor, an optimizer's hyperparameters) is read by
    ``torch.load(weights_only=True)``: plain data, never an arbitrary unpickle (DCP's own
    ``load_bytes`` unpickles anything). Made on first use: importing DCP takes most of a
    second, which a command that never touches a sharded checkpoint should not pay."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                place_at(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return WeightsOnlyLoadPlanner
