"""Fixed-prefix validation: the token-weighted mean loss over the first batches of a split,
and the same loss in bits per UTF-8 byte (comparable across tokenizers)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from k3_checkpoint import capture_rng, restore_rng

from .data import BatchLoader, DataExhausted
from .data.documents import document_ids
from .precision import autocast


@dataclass(frozen=True)
class EvalResult:
    """``loss``: mean nats per scored target token (targets ``-100`` are not scored).
    ``bytes``: UTF-8 bytes those targets stand for (None when the loader has no
    bytes-per-token table)."""

    loss: float
    tokens: int
    bytes: int | None
    by_source: Mapping[str, EvalResult] | None = None
    """A mixture's result per source; then ``loss`` is their weighted mean and ``bytes``
    the tokens' weighted bytes per token × ``tokens`` (so ``bpb`` is the mixture's)."""

    @property
    def bpb(self) -> float | None:
        """Bits per byte: ``loss / ln 2 × tokens / bytes``."""
        if not self.bytes:
            return None
        return self.loss / math.log(2) * self.tokens / self.bytes


@torch.no_grad()
def evaluate_split(model: nn.Module, loader: BatchLoader, device: torch.device | str,
                   max_batches: int, precision: str = "fp32", *,
                   all_reduce: Callable[[torch.Tensor], object] | None = None,
                   document_boundary: int | None = None) -> EvalResult:
    """Loss over up to ``max_batches`` full batches from the start of ``loader``, with the
    byte count of exactly the evaluated targets (from the dataset's bytes-per-token table).

    The loader is reset first (validation always reads the same prefix; its cursor is not
    restored afterwards). Python, NumPy and torch RNG are captured and restored, and the
    model's previous training flag comes back even on failure, so evaluation changes
    nothing the training run depends on.

    Data parallel: each rank evaluates its rows of every batch and ``all_reduce`` (an
    in-place sum over ranks) combines the sums, so every rank gets the global result.

    A mixture (a loader with ``sources`` and ``weights``, :class:`~k3_trainer.data.
    MixtureLoader`) is evaluated source by source, ``max_batches`` each, and combined by
    its weights (:attr:`EvalResult.by_source`).

    ``document_boundary`` (the end-of-document id): the model keeps the rows' documents
    apart (``document_ids``, as a run with ``document_masking`` trains).
    """
    sources = getattr(loader, "sources", None)
    if isinstance(sources, Mapping):
        return _mixture(model, sources, loader.weights,  # type: ignore[attr-defined]
                        lambda part: evaluate_split(model, part, device, max_batches,
                                                    precision, all_reduce=all_reduce,
                                                    document_boundary=document_boundary))
    device = torch.device(device)
    table = getattr(loader, "token_bytes", None)
    rng = capture_rng()
    was_training = model.training
    model.eval()
    try:
        loader.reset()
        total, tokens, nbytes = 0.0, 0, 0
        for _ in range(max_batches):
            try:
                x, y = loader.next_batch()
            except DataExhausted:
                break
            scored = y >= 0  # target -100 is ignored by the loss, so it weighs nothing here
            count = int(scored.sum())
            if count == 0:
                continue
            if table is not None:
                nbytes += int(np.asarray(table)[y[scored].numpy()].sum())
            x, y = x.to(device), y.to(device)
            documents = {} if document_boundary is None else {
                "document_ids": document_ids(x, document_boundary)}
            with autocast(device, precision):
                _, loss = model(x, targets=y, **documents)
            total += float(loss) * count
            tokens += count
        if all_reduce is not None:
            sums = torch.tensor([total, tokens, nbytes], dtype=torch.float64)
            all_reduce(sums)
            total, tokens, nbytes = sums[0].item(), int(sums[1].item()), int(sums[2].item())
        if tokens == 0:
            raise ValueError("evaluate: the validation loader yielded no scored target")
        return EvalResult(total / tokens, tokens, nbytes if table is not None else None)
    finally:
        model.train(was_training)
        restore_rng(rng)


def _mixture(model: nn.Module, sources: Mapping[str, Any], weights: Mapping[str, float],
             measure: Callable[[Any], EvalResult]) -> EvalResult:
    """Each source measured on its own, then the weighted mean of nats and bytes per
    token."""
    parts = {name: measure(part) for name, part in sources.items()}
    loss = sum(weights[name] * part.loss for name, part in parts.items())
    tokens = sum(part.tokens for part in parts.values())
    if any(part.bytes is None for part in parts.values()):
        return EvalResult(loss, tokens, None, parts)
    per_token = sum(weights[name] * (part.bytes or 0) / part.tokens
                    for name, part in parts.items())
    return EvalResult(loss, tokens, round(per_token * tokens), parts)


def evaluate(model: nn.Module, loader: BatchLoader, device: torch.device | str,
             max_batches: int, precision: str = "fp32") -> float:
    """Mean token loss over up to ``max_batches`` full batches from the start of ``loader``
    (:func:`evaluate_split` without the byte count)."""
    return evaluate_split(model, loader, device, max_batches, precision).loss
