"""Activation checkpointing per decoder block, with an exact recomputation.

``"block"`` runs each decoder block under ``torch.utils.checkpoint`` (non-reentrant):
the forward keeps only the block's inputs, and the backward runs the block again to
get what it needs. Non-reentrant checkpointing keeps the original autograd graph and
only swaps where saved tensors come from, so if the recomputation produces the same
values, losses and gradients are bitwise those of ``"none"``.

Deterministic kernels give the same values, except where a forward has side effects
that depend on them. The MoE balancer is one: a training forward chooses experts with
the bias *before* its update and then updates it, so a naive recomputation would
update it a second time and route with the new bias (other experts, other
gradients). A :class:`RoutingTape` fixes that: during the original forward each
balancer records the experts it chose; during the recomputation it replays them and
leaves its buffers alone, and MoE routing statistics are not counted twice.

QK-Clip observation needs nothing: it folds each forward's per-head maximum logits
into a running max, and recording the same maxima again changes nothing. RNG and
autocast state are restored by ``torch.utils.checkpoint`` itself.

The tape is found through module-level variables set only inside a checkpointed
block, so a block outside checkpointing pays one global read. Under ``torch.compile``
that read is a guard on a string; with checkpointing on, recording and replaying the
choice run outside the graph (one graph break per MoE layer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeVar, cast

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

CheckpointMode = Literal["none", "block"]
TapeMode = Literal["off", "record", "replay"]
_F = TypeVar("_F", bound=Callable[..., Any])
CHECKPOINT_MODES: tuple[str, ...] = ("none", "block")


class RoutingTape:
    """The experts each MoE layer chose in one checkpointed block, in call order."""

    def __init__(self) -> None:
        self.chosen: list[Tensor] = []
        self._cursor = 0

    @contextmanager
    def recording(self) -> Iterator[None]:
        with _active(self, "record"):
            yield

    @contextmanager
    def replaying(self) -> Iterator[None]:
        self._cursor = 0
        with _active(self, "replay"):
            yield


# The tape of the checkpointed block being run ("record") or recomputed ("replay").
# The mode is a plain string so that torch.compile guards on its value (one graph per
# mode) instead of on a fresh tape object per call; the tape itself is touched only by
# the two functions below, which compiled code calls out of the graph.
_MODE: TapeMode = "off"
_TAPE: RoutingTape | None = None


@contextmanager
def _active(tape: RoutingTape, mode: TapeMode) -> Iterator[None]:
    global _MODE, _TAPE
    previous = _MODE, _TAPE
    _MODE, _TAPE = mode, tape
    try:
        yield
    finally:
        _MODE, _TAPE = previous


def tape_mode() -> TapeMode:
    """``"record"`` in a checkpointed block's forward, ``"replay"`` in its recomputation,
    else ``"off"``."""
    return _MODE


def recomputing() -> bool:
    """True while a checkpointed block is being recomputed for the backward."""
    return _MODE == "replay"


def _outside_graph(fn: _F) -> _F:
    """``fn`` run eagerly even when called from compiled code (typed for mypy)."""
    return cast(_F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]


@_outside_graph
def record_choice(chosen: Tensor) -> None:
    """Keep a balancer's choice for the recomputation (mode ``"record"``)."""
    assert _TAPE is not None
    _TAPE.chosen.append(chosen)


@_outside_graph
def replay_choice() -> Tensor:
    """The next recorded choice (mode ``"replay"``; layers recompute in forward order)."""
    assert _TAPE is not None
    chosen = _TAPE.chosen[_TAPE._cursor]
    _TAPE._cursor += 1
    return chosen


def check_mode(mode: object) -> CheckpointMode:
    """``mode`` if it is a known activation-checkpointing mode, else ``ValueError``."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(
            f"activation checkpointing mode must be one of {', '.join(CHECKPOINT_MODES)}, "
            f"got {mode!r}"
        )
    return mode  # type: ignore[return-value]


def checkpointed(fn: Callable[..., Tensor], *args: Any, **kwargs: Any) -> Tensor:
    """``fn(*args, **kwargs)`` with its activations recomputed in the backward, exactly
    (see above)."""
    tape = RoutingTape()
    out: Tensor = checkpoint(
        fn, *args, use_reentrant=False, **kwargs,
        context_fn=lambda: (tape.recording(), tape.replaying()),
    )
    return out
