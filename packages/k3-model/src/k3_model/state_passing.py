"""KDA's state passed between the slices of one sequence: exact context parallelism.

Per head, one KDA step is affine in the state, ``S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t})
S_{t−1} + β_t k_t v_tᵀ``, so a whole slice is too: ``S_out = M S_in + S₀`` with ``M``
(K×K) the product of the slice's per-token maps and ``S₀`` (K×V) its final state from a
zero incoming state. The outputs are affine in ``S_in`` as well: ``o_t = o⁰_t + P_t S_in``
with ``o⁰`` the slice's outputs from zero and ``P_t = scale · q_tᵀ M_{≤t}`` (``M_{≤t}``:
the map from the slice start to token t).

:func:`slice_summary` gets all four in **one** chunked pass: it runs ``chunk_kda`` on
``[v | 0]`` (V + K value columns) from the incoming state ``[0 | I]``; by linearity the
first V columns of the state and outputs are ``S₀`` and ``o⁰`` and the last K are ``M``
and ``P``. A document starting inside the slice zeroes the state there (``restart``), so
``M`` and the later ``P_t`` are zero as they must be. :func:`carry_in` chains the
summaries of the earlier slices, ``S_in^{r} = M^{r−1} S_in^{r−1} + S₀^{r−1}``, in the
compute dtype (fp32, or fp64 for fp64 inputs), and :func:`settle` adds ``P S_in``.

Nothing here communicates: the same functions run the slices of one process (the unit
tests, ``gpu_check.py``'s ``cp`` section) and, through :mod:`k3_model.context_parallel`'s
all-gather, the ranks of a context-parallel group, where autograd carries ``∂/∂S_in``
back through the chain to the ranks that produced each summary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .delta_rule import chunk_kda


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def slice_summary(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                  scale: float, chunk_size: int, gate_lower_bound: float | None = None,
                  restart: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """One slice from a zero incoming state, and how an incoming state would change it.

    Arguments as :func:`~k3_model.kda.chunk_kda` (``q, k, g`` [B, T, H, K], ``v``
    [B, T, H, V], ``beta`` [B, T, H]; ``restart`` [B, chunks] for documents packed
    chunk-aligned). Returns, in the compute dtype (fp32, or fp64 for fp64 inputs):
    ``o0`` [B, T, H, V] the outputs from a zero state, ``reads`` [B, T, H, K] the
    ``P_t`` above, and ``summary`` [B, H, K, V + K] = ``[S₀ | M]``.
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    dtype = _compute_dtype(q, k, v, g, beta)
    # fp32 value columns, so the outputs (hence P) come back unrounded under autocast too.
    wide = torch.cat([v.to(dtype), v.new_zeros(b, t, h, dk, dtype=dtype)], dim=-1)
    identity = torch.eye(dk, dtype=dtype, device=q.device).expand(b, h, dk, dk)
    start = torch.cat([identity.new_zeros(b, h, dk, dv), identity], dim=-1)
    out, summary = chunk_kda(q, k, wide, g, beta, scale=scale, initial_state=start,
                             output_final_state=True, chunk_size=chunk_size,
                             gate_lower_bound=gate_lower_bound, restart=restart)
    assert summary is not None
    o0, reads = torch.split(out, [dv, dk], dim=-1)
    return o0, reads, summary


def carry_in(summaries: Sequence[Tensor], rank: int) -> Tensor:
    """Slice ``rank``'s incoming state [B, H, K, V] from every slice's ``[S₀ | M]``.

    ``S = 0; S ← M_j S + S₀_j`` for j < rank. Every slice's summary takes part in the
    result's autograd graph whatever ``rank`` is (the steps at j ≥ rank are computed and
    discarded by ``torch.where``): under context parallelism the gradient of the
    all-gather that produced ``summaries`` is itself a collective, which every rank must
    reach, the first rank too.
    """
    dk = summaries[0].shape[-2]
    dv = summaries[0].shape[-1] - dk
    state = summaries[0].new_zeros(*summaries[0].shape[:-1], dv)
    before = torch.arange(len(summaries), device=state.device) < rank
    for j, summary in enumerate(summaries[:-1]):  # the last slice feeds no one
        final, transition = torch.split(summary, [dv, dk], dim=-1)
        state = torch.where(before[j], torch.matmul(transition, state) + final, state)
    if len(summaries) == 1:  # nothing earlier; keep the summary in the graph
        state = torch.where(before[0], summaries[0][..., :dv], state)
    return state


def settle(o0: Tensor, reads: Tensor, incoming: Tensor, dtype: torch.dtype) -> Tensor:
    """The slice's true outputs ``o⁰ + P S_in`` [B, T, H, V], cast to ``dtype`` at the end."""
    return (o0 + torch.einsum("bthk,bhkv->bthv", reads, incoming)).to(dtype)


def kda_over_slices(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, slices: int,
                    *, scale: float, chunk_size: int,
                    gate_lower_bound: float | None = None) -> Tensor:
    """``chunk_kda``'s outputs computed as ``slices`` equal contiguous slices in one
    process, through the same summaries and composition as a context-parallel group:
    what the unit tests and ``gpu_check.py`` compare with the whole sequence."""
    t = q.shape[1]
    if t % slices:
        raise ValueError(f"kda_over_slices: T = {t} is not divisible by slices = {slices}")
    n = t // slices
    parts = [slice_summary(*(x[:, i * n:(i + 1) * n] for x in (q, k, v, g, beta)),
                           scale=scale, chunk_size=chunk_size,
                           gate_lower_bound=gate_lower_bound) for i in range(slices)]
    summaries = [summary for _, _, summary in parts]
    return torch.cat([settle(o0, reads, carry_in(summaries, r), v.dtype)
                      for r, (o0, reads, _) in enumerate(parts)], dim=1)


__all__ = ["carry_in", "kda_over_slices", "settle", "slice_summary"]
