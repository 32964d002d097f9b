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

Under context parallelism (:mod:`k3_model.context_parallel`) each rank builds the layout of
its slice from the whole rows' ids (``Documents.from_ids(..., start=, length=)``): positions
count from each document's start wherever it began, the mask covers the keys of this slice
and every earlier one, and the KDA packing keeps the incoming state at the slice's first
token unless a document starts there.

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
    mask: Tensor  # (B, 1, T, S) bool: query t may attend key s (same document, s ≤ t);
    # S = T, or under context parallelism the keys of this slice and every earlier one
    packings: dict[int, Packing] = field(default_factory=dict)

    @classmethod
    def from_ids(cls, ids: Tensor, shape: tuple[int, ...],
                 chunk_sizes: tuple[int, ...] = (), *, start: int = 0,
                 length: int | None = None) -> Documents:
        """Validate ``ids`` against the tokens' ``shape`` and precompute the masks (and a
        :class:`Packing` per KDA chunk size in ``chunk_sizes``).

        ``start``/``length`` (context parallelism): ``ids`` are the whole rows and the
        layout is that of the tokens ``[start, start + length)`` alone: their positions
        within their documents (a document may have begun before ``start``), their mask
        over the keys ``[0, start + length)``, and a packing in which the slice's first
        token begins a chunk whose incoming state is kept unless a document starts there.
        """
        if ids.shape != shape:
            raise ValueError(f"document_ids must have the tokens' shape {tuple(shape)}, got "
                             f"{tuple(ids.shape)}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"document_ids must be integers, got {ids.dtype}")
        b, t = shape
        length = t - start if length is None else length
        stop = start + length
        if not 0 <= start < stop <= t:
            raise ValueError(f"Documents.from_ids: the slice [{start}, {stop}) is not inside "
                             f"rows of {t} tokens")
        if t > 1 and bool((ids[:, 1:] < ids[:, :-1]).any()):
            raise ValueError("document_ids must be non-decreasing along each row (each "
                             "document's tokens contiguous)")
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        steps = torch.arange(t, device=ids.device).expand(b, t)
        first = torch.where(starts, steps, torch.zeros_like(steps)).cummax(dim=1).values
        positions = steps - first
        local = ids[:, start:stop]
        same = local[:, :, None] == ids[:, None, :stop]
        queries = torch.arange(start, stop, device=ids.device)
        causal = torch.arange(stop, device=ids.device)[None, :] <= queries[:, None]
        documents = cls(local, starts[:, start:stop], positions[:, start:stop],
                        (same & causal)[:, None])
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
        # Segments: the documents, and the slice's first token (under context parallelism
        # a document may continue from the previous rank); only documents restart.
        segments = self.starts.clone()
        segments[:, 0] = True
        steps = torch.arange(t, device=self.ids.device).expand(b, t)
        first = torch.where(segments, steps, torch.zeros_like(steps)).cummax(dim=1).values
        ends = torch.ones_like(segments)
        ends[:, :-1] = segments[:, 1:]
        # After each segment's last token, the padding up to the next chunk boundary.
        pad = torch.where(ends, (-(steps - first + 1)) % chunk, 0)
        index = torch.arange(t, device=self.ids.device) + pad.cumsum(dim=1) - pad
        longest = int((t + pad.sum(dim=1)).max())  # the one host read
        restart = torch.zeros(b, longest // chunk, dtype=torch.bool, device=self.ids.device)
        rows = torch.arange(b, device=self.ids.device)[:, None].expand(b, t)
        restart[rows[self.starts], index[self.starts] // chunk] = True
        return Packing(index, restart, longest, chunk)


__all__ = ["Documents", "Packing"]
