"""Speed settings applied to a model before training: regional compilation, activation
checkpointing, and a clock for the time torch.compile spends compiling.

Regional compilation compiles each decoder block on its own (``block.compile()``), not the
whole model: blocks of one kind share their compiled code, so compile time does not grow
with depth, and what stays outside the blocks (embedding, Attention-Residual reads, the
loss) runs eagerly. QK-Clip's observers, the MoE balancer's buffer updates, autocast and
the FP16 scaler all work through it (tested against eager).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from torch import nn

from .config import ConfigError, TrainConfig


def compiled_regions(model: nn.Module) -> list[nn.Module]:
    """The modules ``compile`` applies to: each entry of ``model.layers`` when the model
    has such a list of blocks (k3-model's ``K3Model`` does), else the model itself."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        return list(layers)
    return [model]


def prepare_model(model: nn.Module, config: TrainConfig) -> None:
    """Apply ``config.activation_checkpointing`` and ``config.compile`` to ``model``.

    Activation checkpointing is the model's own business (only it knows which state a
    recomputation must not touch twice, such as the MoE balancer): a model offers it with
    ``set_activation_checkpointing(mode)``. Both settings leave the state dict alone.
    """
    setter = getattr(model, "set_activation_checkpointing", None)
    if callable(setter):
        setter(config.activation_checkpointing)
    elif config.activation_checkpointing != "none":
        raise ConfigError(
            f"activation_checkpointing={config.activation_checkpointing!r}: "
            f"{type(model).__name__} has no set_activation_checkpointing(mode); use 'none'")
    if config.compile:
        for region in compiled_regions(model):
            # Static shapes: a run's batches all have one shape, and dynamic-shape
            # compilation of the KDA chunk padding trips an inductor bug (torch 2.13).
            region.compile(dynamic=False)


class CompileClock:
    """Seconds torch.compile spent compiling while active (dynamo's compile callbacks),
    so the first steps' extra time is reported as compilation, not as slow training."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started: dict[str, float] = {}
        self._lock = threading.Lock()
        self._active = False

    def _start(self, args: Any) -> None:
        with self._lock:
            self._started[str(getattr(args, "compile_id", ""))] = time.perf_counter()

    def _end(self, args: Any) -> None:
        with self._lock:
            start = self._started.pop(str(getattr(args, "compile_id", "")), None)
            if start is not None:
                self.seconds += time.perf_counter() - start

    def __enter__(self) -> CompileClock:
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        from torch._dynamo.callback import callback_handler

        if self._active:
            callback_handler.remove_start_callback(self._start)
            callback_handler.remove_end_callback(self._end)
            self._active = False
