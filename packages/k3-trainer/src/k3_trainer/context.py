"""Context parallelism in the trainer (``--context-parallel N``, alias ``--cp``): the
forward that gives each rank its slice of the rows (the layouts it refuses are
:func:`k3_trainer.planning.layout.check_launch`'s).

The ``N`` ranks of a ``cp`` group (adjacent ranks of the ``(pp, dp, cp)`` mesh) read the
*same* rows (the loaders hand rows out by data rank) and each runs the model on its
contiguous ``seq_len / N`` tokens of every row; the model exchanges what its token mixers
need across the slices (its spec's :class:`~k3_trainer.models.ContextParallelHooks`;
K3Model's are :mod:`k3_model.context_parallel`). FSDP2 shards the parameters over
``dp × cp`` (the world, as torchtitan's ``dp_shard_cp``; under pipeline stages, each
stage's ``dp × cp`` ranks).

One process's mathematics: :class:`ContextSlices` returns each rank's *share* of the
whole rows' mean token loss (its slice's summed losses over the rows' scored targets),
so the shares sum over ``cp`` to the mean and the loss reduce (a sum over the world over
the data ranks) reads as one process's. FSDP2 (and expert parallelism) average
gradients over every rank of ``dp × cp``, where the shares' gradients must be summed over
``cp``: the trainer backpropagates ``N`` times the share (:attr:`Slices.
gradient_scale`; exact, N a small integer). Validation runs under the same layout: each
rank scores its slices, the losses are summed over the world and the token counts over
the data ranks. QK-Clip's maxima are taken over ``dp × cp`` and the MoE balancer sees
every slice's tokens (:class:`~k3_trainer.distributed.Parallel`). Under pipeline stages
the stages run on the slices themselves (:class:`~k3_trainer.pipeline.Pipeline`, with the
same :class:`Slices` arithmetic in its loss function).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

IGNORED = -100
"""A target the loss does not score (as ``F.cross_entropy``'s ``ignore_index``)."""


class Slices:
    """This rank's place among the ``size`` contiguous slices of every row (rank ``rank``
    of its ``cp`` group), and the arithmetic that makes the slices' losses one
    process's: what the trainer's forward (:class:`ContextSlices`) and the pipeline
    stages (:class:`~k3_trainer.pipeline.Pipeline`) both use."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    @property
    def gradient_scale(self) -> int:
        """What the backward multiplies the share by, so that the average over ``dp × cp``
        (FSDP2's, expert parallelism's) becomes a sum over ``cp``."""
        return self.size

    def own(self, rows: Tensor) -> Tensor:
        """This rank's contiguous slice of every row of ``rows`` ``(B, T)``."""
        length = rows.shape[1]
        if length % self.size:
            raise ValueError(f"context parallelism: a row of {length} tokens does not split "
                             f"into {self.size} equal slices")
        part = length // self.size
        return rows[:, self.rank * part:(self.rank + 1) * part]

    def mine(self, targets: Tensor) -> Tensor:
        """``targets`` ``(B, T)`` with those outside this rank's slice ignored, so that
        counts summed over the ranks count each target once."""
        kept = torch.full_like(targets, IGNORED)
        part = targets.shape[1] // self.size
        kept[:, self.rank * part:(self.rank + 1) * part] = self.own(targets)
        return kept

    def spread(self, losses: Tensor) -> Tensor:
        """The slice's per-target ``losses`` ``(…, B, T/N)`` in the whole rows' shape,
        zero outside this slice (each token's loss lives on one rank: sums over the ranks
        are the whole rows')."""
        part = losses.shape[-1]
        return torch.nn.functional.pad(
            losses, (self.rank * part, (self.size - 1 - self.rank) * part))

    @staticmethod
    def share(losses: Tensor, targets: Tensor) -> Tensor:
        """The slice's share of the whole rows' mean token loss: its summed ``losses``
        over the scored targets of the whole rows ``targets`` ``(B, T)``."""
        return losses.sum() / (targets != IGNORED).sum().clamp(min=1)


class ContextSlices(nn.Module):
    """The trainer's forward under context parallelism: takes whole rows, runs ``model``
    (already set to context parallelism over a group where this process holds
    ``slices``) on this rank's slice of every row, and returns the slice's logits and its
    share of the whole rows' mean loss.

    Signature as the model's: ``(x, targets=None, *, document_ids=None, reduction=
    "mean")``. ``reduction="none"`` gives each target's loss in the rows' shape, zero
    outside this slice (:meth:`Slices.spread`). Not part of any checkpoint: ``model`` is
    checkpointed by itself.
    """

    def __init__(self, model: nn.Module, slices: Slices) -> None:
        super().__init__()
        self.model, self.slices = model, slices

    def forward(self, x: Tensor, targets: Tensor | None = None, *,
                document_ids: Tensor | None = None, reduction: str = "mean"
                ) -> tuple[Tensor | None, Tensor | None]:
        own = self.slices.own
        documents: dict[str, Any] = {} if document_ids is None else {
            "document_ids": own(document_ids)}
        if targets is None:
            logits, _ = self.model(own(x), **documents)
            return logits, None
        logits, losses = self.model(own(x), targets=own(targets), reduction="none",
                                    **documents)
        if reduction == "none":
            return logits, self.slices.spread(losses)
        return logits, self.slices.share(losses, targets)


__all__ = ["ContextSlices", "Slices"]
