"""The plan's memory line for the run ``k3-train train`` is starting: the same formulas
as ``k3-train plan``, for the trainer's own layout, so the figure a run was sized with
is in its log beside what it then allocates."""

from __future__ import annotations

import dataclasses

from k3_model import K3Config

from ..config import TrainConfig
from .gpus import GPU
from .inventory import inventory
from .layout import launch_layout
from .plan import Options, make_plan

GiB, MiB = 2**30, 2**20


def gib(n: int) -> str:
    """Bytes in GiB, or in MiB below one GiB (a small model's line stays readable)."""
    return f"{n / GiB:,.2f} GiB" if n >= GiB else f"{n / MiB:,.1f} MiB"


def memory_line(model_config: K3Config, train: TrainConfig, *, world_size: int, mode: str,
                device_memory: int | None = None) -> str:
    """One line: the planned parameters, gradients, optimizer state, activations and
    buffers per rank for ``train``'s layout (its pipeline stages, context parallelism and
    expert parallelism over ``world_size`` processes; under stages, the most loaded
    stage's rank), batch, precision, checkpointing and optimizer (``mode``
    ``none``/``ddp``/``fsdp``; DDP counted replicated, an upper bound for Muon's state),
    against ``device_memory`` bytes when known (a GPU)."""
    layout = launch_layout(train, mode, world_size)
    if mode != "fsdp":  # replicated: every rank holds the whole model
        layout = dataclasses.replace(layout, dp=1)
    gpu = GPU("this device", device_memory or 1, 1.0)
    plan = make_plan(inventory(model_config), layout, gpu, Options(
        precision="fp32" if train.precision == "fp32" else "bf16",
        checkpointing=train.activation_checkpointing == "block", normuon=train.muon_normuon,
        headroom=0.0))
    stage = max(plan.stages, key=lambda s: s.total_bytes)

    line = (f"plan: params {gib(stage.params_bytes)}, grads {gib(stage.grads_bytes)}, "
            f"optimizer {gib(stage.optimizer_bytes)}, activations "
            f"{gib(stage.activations_bytes)}, buffers {gib(stage.buffers_bytes)} = "
            f"{gib(stage.total_bytes)} per rank")
    if len(plan.stages) > 1:
        line += f" (the most loaded of {len(plan.stages)} stages)"
    if device_memory:
        line += f" of {gib(device_memory)} on this device"
    return line + " (k3-train plan's formulas; not counting fragmentation and workspaces)"
