"""A mixture's training loss, source by source: each row's summed token losses and scored
tokens added to its source's sums on the device, read once per log window.

The rows of a batch come from the mixture's sources (the loader says which:
``row_sources()``); the model gives each target's loss (``forward(..., reduction=
"none")``), so splitting them costs no forward and no host read: the sums stay on the
device until the log boundary, where a data-parallel run sums them over the ranks (one
all-reduce) and the host reads them with the window's other figures. An attempt's sums join
the window only when the update succeeds, as its loss joins the window's mean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

IGNORED = -100
"""A target the loss does not score (as ``F.cross_entropy``'s ``ignore_index``)."""


class SourceLosses:
    """Per source of ``names``: summed token losses and scored tokens (fp64, on ``device``)
    of the window's successful attempts."""

    def __init__(self, names: Sequence[str], device: torch.device) -> None:
        self.names = list(names)
        self.window = torch.zeros(2, len(self.names), dtype=torch.float64, device=device)
        self.attempt = torch.zeros_like(self.window)

    def add(self, token_losses: Tensor, targets: Tensor, sources: Tensor) -> None:
        """One microbatch: ``token_losses`` and ``targets`` ``(B, T)``, ``sources`` ``(B,)``
        each row's source index (into :attr:`names`)."""
        rows = token_losses.detach().double().sum(dim=1)
        scored = (targets != IGNORED).sum(dim=1).double()
        self.attempt.index_add_(1, sources, torch.stack([rows, scored]))

    def reset(self) -> None:
        """A new window, no attempt under way (a session's start)."""
        self.window.zero_()
        self.attempt.zero_()

    def commit(self) -> None:
        """The attempt's sums join the window (a successful update)."""
        self.window += self.attempt
        self.attempt.zero_()

    def discard(self) -> None:
        """The attempt's sums are dropped (a skipped update)."""
        self.attempt.zero_()

    def summary(self, sum_: Callable[[Tensor], Tensor] | None = None) -> dict[str, float]:
        """``{source: mean token loss}`` over the window (every rank's rows, with
        ``sum_``: an in-place all-reduce), for the sources that had rows; starts a new
        window."""
        totals = self.window.clone()
        if sum_ is not None:
            sum_(totals)
        self.window.zero_()
        losses, tokens = totals.tolist()
        return {name: loss / count for name, loss, count in zip(self.names, losses, tokens)
                if count > 0}
