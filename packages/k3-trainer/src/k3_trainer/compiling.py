"""Speed settings applied to a model before training: regional compilation, activation
checkpointing, and a clock for the time torch.compile spends compiling.

Regional compilation compiles each decoder block on its own (``block.compile()``), not the
whole model: blocks of one kind share their compiled code, so compile time does not grow
with depth, and what stays outside the blocks (embedding, Attention-Residual reads, the
loss) runs eagerly. QK-Clip's observers, the MoE balancer's buffer updates, autocast and
the FP16 scaler all work through it (tested against eager).

Data parallel (torchrun): the order PyTorch and torchtitan recommend is activation
checkpointing, then per-block compile, then ``fully_shard`` on each block and the root
(FSDP2), or the DDP wrapper around the model, so :func:`prepare_model` belongs before
:meth:`~k3_trainer.distributed.Parallel.wrap`. Applied after it, the program is the same:
``Module.compile`` compiles the block's call, whose first traced frame is the block's
``forward``, so FSDP2's unshard/reshard hooks and DDP's gradient hooks stay eager outside
the graph either way, and activation checkpointing is a flag the root reads around each
block call. What does run inside a block graph: QK-Clip's observation (reduced over ranks
outside it, before ``validate()``) and the MoE balancer's all-gather of the ranks' tokens
(dynamo traces ``dist.all_gather`` as a functional collective). Under DDP, dynamo's
DDPOptimizer splits each block graph at DDP's bucket boundaries so gradient all-reduces
still overlap the backward. ``tests/test_distributed_compile.py`` checks 2 compiled CPU
ranks against eager ones for both wrappers.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from torch import nn

from .config import TrainConfig
from .contract import read_contract


def compiled_regions(model: nn.Module) -> list[nn.Module]:
    """The modules ``compile`` applies to: the model's blocks (``model.layers`` when the
    model has such a list, as k3-model's ``K3Model`` does), else the model itself."""
    return read_contract(model).blocks()


def is_compiled(region: nn.Module) -> bool:
    """Whether ``region.compile()`` has been applied (its calls go through torch.compile)."""
    return getattr(region, "_compiled_call_impl", None) is not None


def prepare_model(model: nn.Module, config: TrainConfig) -> None:
    """Apply ``config.activation_checkpointing`` and ``config.compile`` to ``model``.

    Activation checkpointing is the model's own business (only it knows which state a
    recomputation must not touch twice, such as the MoE balancer): a model offers it with
    ``set_activation_checkpointing(mode)`` (the model contract). Both settings leave the
    state dict alone.

    Idempotent, so a data-parallel session can prepare the model before wrapping it (the
    recommended order) and ``Trainer.fit()`` can prepare it again: a region compiled already is
    left alone, keeping the compiled call (and its dynamo cache) it was given first.
    """
    contract = read_contract(model)
    contract.set_activation_checkpointing(config.activation_checkpointing)
    if config.compile:
        for region in contract.blocks():
            if is_compiled(region):
                continue
            # Static shapes: a run's batches all have one shape, and dynamic-shape
            # compilation of the KDA chunk padding trips an inductor bug (torch 2.13).
            region.compile(dynamic=False)


class CompileClock:
    """Seconds torch.compile spent compiling while active (dynamo's compile callbacks),
    so the first steps' extra time is reported as compilation, not as slow training.

    Those callbacks (``torch._dynamo.callback``) are torch's only compile-event hook and not
    public API, so a torch that moves them must cost the report, never the run: without
    them ``seconds`` is None (unknown)."""

    def __init__(self) -> None:
        self.seconds: float | None = 0.0
        self._started: dict[str, float] = {}
        self._lock = threading.Lock()
        self._handler: Any = None  # dynamo's callback handler while registered

    def _start(self, args: Any) -> None:
        with self._lock:
            self._started[str(getattr(args, "compile_id", ""))] = time.perf_counter()

    def _end(self, args: Any) -> None:
        with self._lock:
            start = self._started.pop(str(getattr(args, "compile_id", "")), None)
            if start is not None and self.seconds is not None:
                self.seconds += time.perf_counter() - start

    def __enter__(self) -> CompileClock:
        try:
            from torch._dynamo.callback import callback_handler as handler

            for name in ("register_start_callback", "register_end_callback",
                         "remove_start_callback", "remove_end_callback"):
                getattr(handler, name)
        except (ImportError, AttributeError):  # moved or renamed by a torch release
            self.seconds = None
            return self
        handler.register_start_callback(self._start)
        handler.register_end_callback(self._end)
        self._handler = handler
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handler is not None:
            self._handler.remove_start_callback(self._start)
            self._handler.remove_end_callback(self._end)
            self._handler = None
