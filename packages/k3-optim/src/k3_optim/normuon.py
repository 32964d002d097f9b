"""NorMuon: neuron-wise normalization of Muon's orthogonalized update (arXiv 2510.05491).

An orthogonalized update ``O`` has equal singular values but not equal row norms, so some
output neurons (rows of the weight as ``nn.Linear`` stores it) still get much larger
steps than others. NorMuon keeps per row an EMA of the row's mean square,
``v_i ← β₂·v_i + (1 − β₂)·mean_j O_ij²``, divides each row by ``√v_i + ε``, and rescales
each orthogonalized matrix (a parameter, a per-head block, an expert) back to the
Frobenius norm ``O`` had: the direction changes, the size is Muon's, so ``update_scale``
and the learning rate mean what they mean for Muon.

The rows of a parameter's update may be split over ranks (FSDP2 shards by rows): each
rank normalizes its own rows, and only the per-matrix sums of squares behind the
rescale are summed across ranks (one small all-reduce per group and step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowBlocks:
    """Which matrices the rows of one parameter's local update belong to.

    The parameter's rows are its update viewed as ``(rows, cols)`` (all dims but the
    last flattened into rows; a ``flatten``ed kernel's first dim alone). The local piece
    holds ``first_row`` onward; the orthogonalized matrices are consecutive runs of
    ``rows_per_block`` rows, ``blocks`` of them in the whole parameter.
    """

    first_row: int
    rows_per_block: int
    blocks: int
    sharded: bool = False
    """True when other ranks hold some of this parameter's rows (sums are all-reduced)."""


def row_view(t: torch.Tensor, *, flatten: bool) -> torch.Tensor:
    """``t`` as ``(rows, cols)``: output neurons as rows."""
    return t.reshape(t.shape[0], -1) if flatten else t.reshape(-1, t.shape[-1])


def second_moment_shape(shape: Sequence[int], *, flatten: bool) -> tuple[int, ...]:
    """The shape of NorMuon's per-row state for a parameter of ``shape``."""
    shape = tuple(int(s) for s in shape)
    return shape[:1] if flatten else shape[:-1]


def normuon_normalize(
    updates: Sequence[torch.Tensor],
    second_moments: Sequence[torch.Tensor],
    blocks: Sequence[RowBlocks],
    *,
    beta2: float,
    eps: float,
    flatten: bool,
    all_reduce: Callable[[torch.Tensor], object] | None = None,
) -> list[torch.Tensor]:
    """NorMuon on local orthogonalized ``updates`` (contiguous, the caller's to change),
    in place, as are ``second_moments`` (this rank's rows of each parameter's ``v``);
    returns the updates. ``all_reduce`` sums a flat tensor over the ranks that share the
    ``sharded`` parameters (needed only when some are)."""
    scaled, row_sums, block_index = [], [], []
    for update, v, where in zip(updates, second_moments, blocks):
        rows = row_view(update, flatten=flatten)  # a view: the updates are contiguous
        # In at least fp32 whatever the parameters' dtype; v is kept in theirs, as torch's
        # optimizers keep their state (load_state_dict casts state to it).
        acc = torch.promote_types(v.dtype, torch.float32)
        squares = torch.linalg.vector_norm(rows, dim=-1, dtype=acc).square()  # Σ_j O_ij²
        v_rows = v.view(-1)
        v_rows.lerp_((squares / rows.shape[-1]).to(v.dtype), 1.0 - beta2)
        inverse = (v_rows.to(acc).sqrt() + eps).reciprocal()
        scaled.append((rows, inverse))
        row_sums.append((squares, squares * inverse.square()))
        first = where.first_row
        block_index.append(torch.div(torch.arange(first, first + rows.shape[0], device=rows.device),
                                     where.rows_per_block, rounding_mode="floor"))
    # Per matrix: Σ O² before and after the row division (rows of other ranks included).
    totals = []
    for (before, after), index, where in zip(row_sums, block_index, blocks):
        sums = before.new_zeros(2, where.blocks)
        sums[0].index_add_(0, index, before)
        sums[1].index_add_(0, index, after)
        totals.append(sums)
    if all_reduce is not None and any(where.sharded for where in blocks):
        shared = [i for i, where in enumerate(blocks) if where.sharded]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in shared:
            by_dtype.setdefault(totals[i].dtype, []).append(i)
        for indices in by_dtype.values():
            flat = torch.cat([totals[i].reshape(-1) for i in indices])
            all_reduce(flat)
            for i, part in zip(indices, torch.split(flat, [totals[i].numel() for i in indices])):
                totals[i] = part.view_as(totals[i])
    for (rows, inverse), index, sums in zip(scaled, block_index, totals):
        before, after = sums
        # ‖O‖ / ‖O / (√v + ε)‖ per matrix; a zero matrix stays zero.
        tiny = torch.finfo(after.dtype).tiny
        rescale = torch.where(after > 0, before / after.clamp_min(tiny), 0.0).sqrt()
        rows.mul_((inverse * rescale[index]).to(rows.dtype)[:, None])
    return list(updates)
