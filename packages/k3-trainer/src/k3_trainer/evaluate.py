"""Fixed-prefix validation: the token-weighted mean loss over the first batches of a split."""

from __future__ import annotations

import torch
from torch import nn

from k3_checkpoint import capture_rng, restore_rng

from .data import DataExhausted, TokenDataLoader
from .precision import autocast


@torch.no_grad()
def evaluate(model: nn.Module, loader: TokenDataLoader, device: torch.device | str,
             max_batches: int, precision: str = "fp32") -> float:
    """Mean token loss over up to ``max_batches`` full batches from the start of ``loader``.

    The loader is reset first (validation always reads the same prefix; its cursor is not
    restored afterwards). Python, NumPy and torch RNG are captured and restored, and the
    model's previous training flag comes back even on failure, so evaluation changes
    nothing the training run depends on.
    """
    device = torch.device(device)
    rng = capture_rng()
    was_training = model.training
    model.eval()
    try:
        loader.reset()
        total, tokens = 0.0, 0
        for _ in range(max_batches):
            try:
                x, y = loader.next_batch()
            except DataExhausted:
                break
            x, y = x.to(device), y.to(device)
            with autocast(device, precision):
                _, loss = model(x, targets=y)
            total += float(loss) * y.numel()
            tokens += y.numel()
        if tokens == 0:
            raise ValueError("evaluate: the validation loader yielded no batch")
        return total / tokens
    finally:
        model.train(was_training)
        restore_rng(rng)
