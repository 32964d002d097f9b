"""Documents packed into one training row, kept apart: intra-document masking.

A pretraining row packs several documents back to back. :class:`Documents` describes which
document each token belongs to (``document_ids`` ``(B, T)``, equal for the tokens of one
document, non-decreasing along a row) and precomputes, once per forward, what every layer
kind needs to treat each document as if it ran alone:

- attention (MLA, GQA): a block-diagonal causal mask (:attr:`Documents.mask`), and the
  position of each token within its document (:attr:`Documents.positions`) for RoPE;
- KDA: its short convolution sees no token of an earlier document (the positions again),
  and its recurrent state restarts at each document's first token. The chunked form does
  that by laying each row's documents out chunk-aligned (:meth:`Documents.packing`): every
  document begins a chunk whose incoming state is zero and ends in zero padding, which is
  inert, so each chunk computes exactly what the document alone would.

Everything here is computed outside the decoder blocks (one host read for the packed
length), so a compiled block sees plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class Packing:
    """Each row's documents laid out chunk-aligned for the chunked KDA.

    ``index`` ``(B, T)``: where token ``t`` of row ``b`` sits in the packed row of
    ``length`` positions (a multiple of ``chunk``); ``restart`` ``(B, length // chunk)``:
    True for the chunks a document begins, whose incoming state is zero.
    """

    index: Tensor
    restart: Tensor
    length: int
    chunk: int

    def pack(self, x: Tensor) -> Tensor:
        """``x`` ``(B, T, ...)`` → ``(B, length, ...)``, zeros between documents."""
        b = x.shape[0]
        out = x.new_zeros(b, self.length, *x.shape[2:])
        rows = torch.arange(b, device=x.device)[:, None].expand_as(self.index)
        return out.index_put((rows, self.index), x)

    def unpack(self, y: Tensor) -> Tensor:
        """The inverse of :meth:`pack`: ``(B, length, ...)`` → ``(B, T, ...)``."""
        rows = torch.arange(y.shape[0], device=y.device)[:, None].expand_as(self.index)
        return y[rows, self.index]


@dataclass(frozen=True)
class Documents:
    """Which document each token of a ``(B, T)`` batch belongs to (see the module
    docstring); build it with :meth:`from_ids`, which validates the ids."""

    ids: Tensor
    starts: Tensor  # (B, T) bool: the token begins a document
    positions: Tensor  # (B, T) long: the token's index within its document
    mask: Tensor  # (B, 1, T, T) bool: query t may attend key s (same document, s ≤ t)
    packings: dict[int, Packing] = field(default_factory=dict)

    @classmethod
    def from_ids(cls, ids: Tensor, shape: tuple[int, ...],
                 chunk_sizes: tuple[int, ...] = ()) -> Documents:
        """Validate ``ids`` against the tokens' ``shape`` and precompute the masks (and a
        :class:`Packing` per KDA chunk size in ``chunk_sizes``)."""
        if ids.shape != shape:
            raise ValueError(f"document_ids must have the tokens' shape {tuple(shape)}, got "
                             f"{tuple(ids.shape)}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"document_ids must be integers, got {ids.dtype}")
        b, t = shape
        if t > 1 and bool((ids[:, 1:] < ids[:, :-1]).any()):
            raise ValueError("document_ids must be non-decreasing along each row (each "
                             "document's tokens contiguous)")
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        steps = torch.arange(t, device=ids.device).expand(b, t)
        first = torch.where(starts, steps, torch.zeros_like(steps)).cummax(dim=1).values
        positions = steps - first
        same = ids[:, :, None] == ids[:, None, :]
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        documents = cls(ids, starts, positions, (same & causal)[:, None])
        for chunk in sorted(set(chunk_sizes)):
            documents.packings[chunk] = documents._packing(chunk)
        return documents

    def packing(self, chunk: int) -> Packing:
        """The chunk-aligned layout for KDA chunks of ``chunk`` tokens (precomputed)."""
        found = self.packings.get(chunk)
        if found is None:
            raise ValueError(f"Documents has no packing for KDA chunks of {chunk}; pass "
                             "the chunk size to Documents.from_ids")
        return found

    def _packing(self, chunk: int) -> Packing:
        b, t = self.ids.shape
        ends = torch.ones_like(self.starts)
        ends[:, :-1] = self.starts[:, 1:]
        # After each document's last token, the padding up to the next chunk boundary.
        pad = torch.where(ends, (-(self.positions + 1)) % chunk, 0)
        index = torch.arange(t, device=self.ids.device) + pad.cumsum(dim=1) - pad
        longest = int((t + pad.sum(dim=1)).max())  # the one host read
        restart = torch.zeros(b, longest // chunk, dtype=torch.bool, device=self.ids.device)
        rows = torch.arange(b, device=self.ids.device)[:, None].expand(b, t)
        restart[rows[self.starts], index[self.starts] // chunk] = True
        return Packing(index, restart, longest, chunk)


__all__ = ["Documents", "Packing"]
