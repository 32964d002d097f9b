"""Context parallelism in the trainer (``--context-parallel N``, alias ``--cp``): the
forward that gives each rank its slice of the rows (the layouts it refuses are
:func:`k3_trainer.planning.layout.check_launch`'s).

The ``N`` ranks of a ``cp`` group (adjacent ranks of the ``(pp, dp, cp)`` mesh) read the
*same* rows (the loaders hand rows out by data rank) and each runs the model on its
contiguous ``seq_len / N`` tokens of every row; the model exchanges what its token mixers
need across the slices (its spec's :class:`~k3_trainer.models.ContextParallelHooks`;
K3Model's are :mod:`k3_model.context_parallel`). FSDP2 shards the parameters over
``dp × cp`` (the world, as torchtitan's ``dp_shard_cp``).

One process's mathematics: :class:`ContextSlices` returns each rank's *share* of the
whole rows' mean token loss (its slice's summed losses over the rows' scored targets),
so the shares sum over ``cp`` to the mean and the loss reduce (a sum over the world over
the data ranks) reads as one process's. FSDP2 (and expert parallelism) average
gradients over every rank of ``dp × cp``, where the shares' gradients must be summed over
``cp``: the trainer backpropagates ``N`` times the share (:attr:`ContextSlices.
gradient_scale`; exact, N a small integer). Validation runs under the same layout: each
rank scores its slices, the losses are summed over the world and the token counts over
the data ranks. QK-Clip's maxima are taken over ``dp × cp`` and the MoE balancer sees
every slice's tokens (:class:`~k3_trainer.distributed.Parallel`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

IGNORED = -100
"""A target the loss does not score (as ``F.cross_entropy``'s ``ignore_index``)."""


class ContextSlices(nn.Module):
    """The trainer's forward under context parallelism: takes whole rows, runs ``model``
    (already set to context parallelism over a group where this process is ``rank`` of
    ``size``) on this rank's slice of every row, and returns the slice's logits and its
    share of the whole rows' mean loss.

    Signature as the model's: ``(x, targets=None, *, document_ids=None, reduction=
    "mean")``. ``reduction="none"`` gives each target's loss in the rows' shape, zero
    outside this slice (each token's loss lives on one rank: sums over the ranks are the
    whole rows'). Not part of any checkpoint: ``model`` is checkpointed by itself.
    """

    def __init__(self, model: nn.Module, rank: int, size: int) -> None:
        super().__init__()
        self.model, self.rank, self.size = model, rank, size

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

    def forward(self, x: Tensor, targets: Tensor | None = None, *,
                document_ids: Tensor | None = None, reduction: str = "mean"
                ) -> tuple[Tensor | None, Tensor | None]:
        documents: dict[str, Any] = {} if document_ids is None else {
            "document_ids": self.own(document_ids)}
        if targets is None:
            logits, _ = self.model(self.own(x), **documents)
            return logits, None
        logits, losses = self.model(self.own(x), targets=self.own(targets),
                                    reduction="none", **documents)
        if reduction == "none":
            part = losses.shape[1]
            return logits, torch.nn.functional.pad(
                losses, (self.rank * part, (self.size - 1 - self.rank) * part))
        scored = (targets != IGNORED).sum().clamp(min=1)
        return logits, losses.sum() / scored


__all__ = ["ContextSlices"]
