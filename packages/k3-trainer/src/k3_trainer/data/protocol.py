"""``BatchLoader``: what the trainer reads a split through.

``TokenDataLoader`` is the one k3-trainer ships; any object with these members trains,
evaluates and checkpoints the same way (its ``state_dict`` is its checkpoint component, so
it must name the data it reads and refuse a state of other data).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


@runtime_checkable
class BatchLoader(Protocol):
    """Causal ``(x, y)`` batches from one split, read from a cursor (``offset``) that never
    wraps by itself: ``next_batch`` raises ``DataExhausted`` at the end, the trainer resets.
    ``vocab_size`` is the data's vocabulary; ``token_bytes`` (optional attribute) the UTF-8
    bytes per token id, for bits per byte."""

    num_tokens: int
    vocab_size: int

    @property
    def offset(self) -> int: ...
    @property
    def tokens_per_batch(self) -> int: ...
    def next_batch(self) -> Batch: ...
    def batch_at(self, offset: int) -> Batch: ...
    def reset(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Any, /) -> None: ...
