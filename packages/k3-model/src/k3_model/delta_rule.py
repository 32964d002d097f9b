"""The gated delta rule, Kimi Delta Attention's operator (the K3 layer around it is
:mod:`k3_model.kda`).

The operator, per head with state ``S ∈ R^{K×V}``, for each step t::

    S ← Diag(exp g_t) · S
    S ← S + β_t k_t (v_t − k_tᵀ S)ᵀ
    o_t = scale · q_tᵀ S

``recurrent_kda`` runs it step by step (the reference); ``chunk_kda`` computes the same
thing chunk by chunk: the within-chunk interactions as a few batched matmuls and one unit
lower-triangular solve per chunk (the WY/UT transform), and only the chunk-to-chunk state
pass as a Python loop. Both are correct for any log decay g ≤ 0; ``chunk_kda`` takes a
faster path when told a lower bound on g (``gate_lower_bound``, as K3's layer does). Both
compute in fp32 (fp64 when an input is fp64) whatever autocast is active, so the
triangular solve never sees bf16.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_SIZES = (16, 32, 64)
BACKENDS = ("auto", "torch", "fla")
DECAYS = ("bounded", "softplus")
DECAY_LOWER_BOUND = -5.0  # K3's g = −5·sigmoid(·): every step keeps at least e⁻⁵ of the state
# Sub-block length for the pairwise decay exp(G_t − G_j). Across sub-blocks every factor
# is ≤ 1 for any g ≤ 0. Within one, chunk_kda's fast form has a factor up to
# exp(|g|·(SUB − 1)), e⁷⁵ at K3's bound, which fp32 holds; without a known bound it forms
# exp(G_t − G_j) per pair instead (SUB × SUB × K per sub-block).
SUB = 16


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
           initial_state: Tensor | None) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"k and g must have q's shape {tuple(q.shape)}, "
                         f"got k {tuple(k.shape)} and g {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with q's B, T, H {tuple(q.shape[:3])}, "
                         f"got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")
    b, _, h, dk = q.shape
    expected = (b, h, dk, v.shape[-1])
    if initial_state is not None and tuple(initial_state.shape) != expected:
        raise ValueError(f"initial_state must be [B, H, K, V] = {expected}, "
                         f"got {tuple(initial_state.shape)}")


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """fp64 if any input is fp64, else fp32: never less than fp32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) \
        else torch.float32


def recurrent_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                  scale: float | None = None, initial_state: Tensor | None = None,
                  output_final_state: bool = False) -> tuple[Tensor, Tensor | None]:
    """The KDA recurrence, one step at a time (the reference ``chunk_kda`` is tested against).

    Shapes: ``q, k, g`` [B, T, H, K] (q, k L2-normalized; g the log decay, ≤ 0), ``v``
    [B, T, H, V], ``beta`` [B, T, H] in (0, 1), states [B, H, K, V]. ``scale=None`` means
    ``K ** -0.5``. Returns ``o`` [B, T, H, V] in v's dtype and the final state (in the
    compute dtype, fp32 or fp64) when ``output_final_state``.
    """
    _check(q, k, v, g, beta, initial_state)
    b, t, h, dk = q.shape
    dtype, out_dtype = compute_dtype(q, k, v, g, beta, initial_state), v.dtype
    scale = dk**-0.5 if scale is None else scale
    with torch.autocast(q.device.type, enabled=False):
        q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
        state = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None \
            else initial_state.to(dtype)
        decay = g.exp()
        outputs = []
        for i in range(t):
            state = decay[:, i, :, :, None] * state
            k_i = k[:, i]
            error = v[:, i] - torch.einsum("bhk,bhkv->bhv", k_i, state)
            state = state + (beta[:, i, :, None] * k_i)[..., None] * error[..., None, :]
            outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, i] * scale, state))
        o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return o.to(out_dtype), (state if output_final_state else None)


def recurrent_step_(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                     beta: Tensor, scale: float) -> Tensor:
    """One token of :func:`recurrent_kda` (``q, k, g`` [B, H, K], ``v`` [B, H, V],
    ``beta`` [B, H]) applied to ``state`` [B, H, K, V] in place (a decoding step: no
    state allocated per token); returns ``o`` [B, H, V] in the state's dtype."""
    with torch.autocast(q.device.type, enabled=False):
        dtype = state.dtype
        q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
        state.mul_(g.exp()[..., None])
        error = v - torch.matmul(k[:, :, None], state)[:, :, 0]
        state.add_((beta[..., None] * k)[..., None] * error[:, :, None])
        return torch.matmul((q * scale)[:, :, None], state)[:, :, 0]


def _chunked(x: Tensor, chunk: int, dtype: torch.dtype) -> Tensor:
    """[B, T, H, ...] → contiguous [B·H, N, C, ...] in ``dtype``, zero-padded to whole chunks.

    Zero padding is inert: k = 0 writes nothing, g = 0 decays nothing, q = 0 reads nothing.
    """
    b, t, h = x.shape[:3]
    x = x.to(dtype).transpose(1, 2)  # [B, H, T, ...]
    pad = -t % chunk
    if pad:
        x = F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
    return x.reshape(b * h, (t + pad) // chunk, chunk, *x.shape[3:]).contiguous()


def _exp_limit(dtype: torch.dtype) -> float:
    """The largest exponent the fast diagonal may form in ``dtype``: ln(max) less a margin.

    ln(finfo.max) is ≈ 88.7 in fp32 and ≈ 709.8 in fp64; the margin of 8 (a factor e⁸ ≈ 3000)
    leaves room for the k and gradient magnitudes that multiply the factor.
    """
    return math.log(torch.finfo(dtype).max) - 8.0


def _pairwise_diagonal(q: Tensor, kb: Tensor, k: Tensor, gcum: Tensor) -> Tensor:
    """The diagonal sub-blocks' scores, safe for any g ≤ 0: ``Σ_d x_td k_jd e^{G_td − G_jd}``.

    ``q``, ``kb`` (= βk), ``k``, ``gcum``: [BH, N, blocks, SUB, K]. The decay
    ``e^{G_t − G_j}`` is formed per (t, j, channel) for j ≤ t, every sub-block at once
    ([BH, N, blocks, SUB, SUB, K], SUB times the size of q); j > t is set to −inf before
    the exp (by adding a 0/−inf mask), so no factor exceeds 1 and gradients stay finite.
    Returns [BH, N, blocks, SUB, SUB, 2]: the q scores (…, 0) and the βk scores (…, 1),
    both including j = t (the caller masks what it does not keep).
    """
    sub = gcum.shape[-2]
    future = torch.full((sub, sub), -math.inf, dtype=gcum.dtype, device=gcum.device)
    future = future.triu_(1).unsqueeze(-1)  # [t, j, 1]: −inf where j > t, else 0
    # (G_t + mask) + (−G_j), in place: ~30% faster than a sub and a masked_fill, forward
    # and backward (no full-size neg or where in the backward).
    decay = (gcum.unsqueeze(-2) + future).add_(gcum.neg().unsqueeze(-3)).exp_()
    decayed_k = decay * k.unsqueeze(-3)  # [.., t, j, K]: k_j e^{G_t − G_j}
    return torch.matmul(decayed_k, torch.stack([q, kb], dim=-1))  # [.., t, j, 2]


def _intra_chunk(q_in: Tensor, k_in: Tensor, k_tail: Tensor, ref: Tensor, last: Tensor,
                 diagonal: Tensor | None) -> tuple[Tensor, Tensor]:
    """Within-chunk scores ``Σ_d x_td k_jd e^{G_td − G_jd}`` for x = q (j ≤ t) and x = βk (j < t).

    For j in an earlier sub-block than t the decay is split at the first step r(t) of
    t's sub-block and at the last step l(j) of j's:
    ``e^{G_t − G_r(t)} · e^{G_r(t) − G_l(j)} · e^{G_l(j) − G_j}``, each factor ≤ 1 for any
    g ≤ 0. Inputs carry the outer ones (``q_in``, ``k_in``: [BH, N, blocks, SUB, K], rows
    scaled by the first; ``k_tail`` by the last); ``ref`` and ``last`` are G at each
    sub-block's first and last step. The diagonal sub-blocks (t and j in one sub-block)
    come from ``diagonal`` (``_pairwise_diagonal``'s result) when given; when None, the
    same three-factor split is used for them too, where the middle factor
    ``e^{G_r − G_l} ≤ e^{|g|·(SUB − 1)}`` is now ≥ 1: the fast form, for bounded gates only.
    Returns ``(Aqk, Akk)``, [BH, N, C, C], zero above (Aqk) or on and above (Akk) the
    diagonal.
    """
    bh, n, blocks, sub, dk = q_in.shape
    c = blocks * sub
    aqk_rows: list[Tensor] = []
    akk_rows: list[Tensor] = []
    for i in range(blocks):  # row sub-block i against column sub-blocks 0..i
        width = i + 1 if diagonal is None else i  # column sub-blocks done by matmul here
        aqk_parts: list[Tensor] = []
        akk_parts: list[Tensor] = []
        if width:
            across = torch.exp(ref[:, :, i:i + 1] - last[:, :, :width])
            cols = (k_tail[:, :, :width] * across).view(bh, n, width * sub, dk).transpose(-1, -2)
            aqk_parts.append(torch.matmul(q_in[:, :, i], cols))
            akk_parts.append(torch.matmul(k_in[:, :, i], cols))
        if diagonal is not None:
            aqk_diag, akk_diag = diagonal[:, :, i].unbind(-1)
            aqk_parts.append(aqk_diag)
            akk_parts.append(akk_diag)
        pad = (0, c - (i + 1) * sub)
        for parts, rows in ((aqk_parts, aqk_rows), (akk_parts, akk_rows)):
            rows.append(F.pad(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1), pad))
    aqk, akk = torch.cat(aqk_rows, dim=2), torch.cat(akk_rows, dim=2)
    idx = torch.arange(c, device=ref.device)
    # In place: cat keeps nothing for backward.
    return aqk.masked_fill_(idx[:, None] < idx[None, :], 0.0), \
        akk.masked_fill_(idx[:, None] <= idx[None, :], 0.0)


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
              scale: float | None = None, initial_state: Tensor | None = None,
              output_final_state: bool = False, chunk_size: int = 64,
              gate_lower_bound: float | None = None, restart: Tensor | None = None
              ) -> tuple[Tensor, Tensor | None]:
    """``recurrent_kda``'s result, chunk by chunk (same arguments, plus three).

    Per chunk with cumulative decay G: ``(I + Akk) [u | w] = [β v | β e^G k]`` (one unit
    lower-triangular solve, the UT transform), then sequentially over chunks
    ``v' = u − w S``, ``S ← e^{G_last} ⊙ S + (e^{G_last − G} ⊙ k)ᵀ v'``; finally
    ``o = scale · ((e^G ⊙ q) S_start + Aqk v')`` for all chunks at once. Any T (padded
    internally); ``chunk_size`` in {16, 32, 64}.

    Correct for any g ≤ 0 (−inf excluded), in fp32 and fp64: no exp(−G) is formed, and
    every decay factor is ≤ 1 except, on the fast path, within one 16-step sub-block.
    ``gate_lower_bound`` (finite, ≤ 0; default None) is the caller's promise that every
    g ≥ it; it is not checked against g. When ``−gate_lower_bound · 15`` stays a margin
    below the compute dtype's exp overflow (fp32: bounds down to ≈ −5.4, so K3's −5;
    fp64: ≈ −46.8), the diagonal sub-blocks use the fast factorized form, whose factor
    reaches ``e^{−gate_lower_bound · 15}``: a g below the promised bound can then give
    inf/NaN. Otherwise (and by default) they use the pairwise decay
    ``e^{G_t − G_j}``, exact for any g ≤ 0 but materializing a tensor 16× the size of q.

    ``restart`` ``(B, ⌈T / chunk_size⌉)`` bool: True for the chunks whose incoming state
    is zero, where a new sequence begins (documents laid out chunk-aligned,
    :class:`k3_model.documents.Packing`).
    """
    _check(q, k, v, g, beta, initial_state)
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size}")
    if gate_lower_bound is not None and not (
            isinstance(gate_lower_bound, numbers.Real) and not isinstance(gate_lower_bound, bool)
            and math.isfinite(gate_lower_bound) and gate_lower_bound <= 0):
        raise ValueError(f"gate_lower_bound must be None or a finite float ≤ 0, "
                         f"got {gate_lower_bound!r}")
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    dtype = compute_dtype(q, k, v, g, beta, initial_state)
    scale = dk**-0.5 if scale is None else scale
    state = q.new_zeros(b * h, dk, dv, dtype=dtype) if initial_state is None \
        else initial_state.to(dtype).reshape(b * h, dk, dv)
    if t == 0:
        return v.new_zeros(v.shape), (state.view(b, h, dk, dv) if output_final_state else None)
    with torch.autocast(q.device.type, enabled=False):
        qc, kc, vc, gc = (_chunked(x, chunk_size, dtype) for x in (q, k, v, g))
        betac = _chunked(beta, chunk_size, dtype).unsqueeze(-1)  # [BH, N, C, 1]
        bh, n = qc.shape[:2]
        sub = min(SUB, chunk_size)
        fast = gate_lower_bound is not None \
            and -float(gate_lower_bound) * (sub - 1) <= _exp_limit(dtype)
        blocks = (bh, n, chunk_size // sub, sub, dk)  # sub-block view of [BH, N, C, K]
        gcum = gc.cumsum(dim=2).view(blocks)
        ref = gcum[:, :, :, :1]  # G at each sub-block's first step
        last = gcum[:, :, :, -1:]  # and at its last step
        inside = torch.exp(gcum - ref)  # e^{G_t − G_r} ≤ 1
        kb = kc.view(blocks) * betac.view(*blocks[:-1], 1)
        diagonal = None if fast else _pairwise_diagonal(qc.view(blocks), kb, kc.view(blocks), gcum)
        k_tail = kc.view(blocks) * torch.exp(last - gcum)  # k_j e^{G_l(j) − G_j}, ≤ 1 factor
        aqk, akk = _intra_chunk(qc.view(blocks) * inside, kb * inside, k_tail, ref, last,
                                diagonal)
        decay = (inside * ref.exp()).view_as(kc)  # e^{G_t}, a product of factors ≤ 1
        chunk_last = gcum[:, :, -1:, -1:]  # [BH, N, 1, 1, K]
        # k_j e^{G_end − G_j} = k_tail · e^{G_end − G_l(j)}: both factors ≤ 1.
        k_to_end = (k_tail * torch.exp(chunk_last - last)).view_as(kc).transpose(-1, -2)
        chunk_decay = chunk_last.exp().view(bh, n, dk, 1)
        rhs = torch.cat([vc, kc * decay], dim=-1) * betac
        # (I + Akk) X = rhs, posed as Xᵀ (I + Akk)ᵀ = rhsᵀ: the same solve, measured 1.4–2×
        # faster on CPU (MKL) than the left-sided call, forward and backward; a blocked
        # inverse built from matmuls was slower.
        solved = torch.linalg.solve_triangular(akk.transpose(-1, -2), rhs.transpose(-1, -2),
                                               upper=True, left=False,
                                               unitriangular=True).transpose(-1, -2)
        u, w = solved.split([dv, dk], dim=-1)

        keep: list[Tensor | None] = [None] * n
        if restart is not None:
            if restart.shape != (b, n):
                raise ValueError(f"restart must be [B, chunks] = {(b, n)}, got "
                                 f"{tuple(restart.shape)}")
            kept = (~restart).to(dtype).repeat_interleave(h, dim=0)  # [BH, N]
            keep = list(kept[:, :, None, None].unbind(1))
        starts, v_new = [], []
        # unbind, not u[:, i]: each indexing op's backward would write a full-size zero grad.
        for u_i, w_i, d_i, k_i, keep_i in zip(u.unbind(1), w.unbind(1), chunk_decay.unbind(1),
                                              k_to_end.unbind(1), keep):  # the sequential part
            if keep_i is not None:
                state = state * keep_i
            starts.append(state)
            v_i = torch.baddbmm(u_i, w_i, state, alpha=-1.0)  # u − w S
            v_new.append(v_i)
            state = torch.baddbmm(d_i * state, k_i, v_i)
        o = torch.matmul(qc * decay, torch.stack(starts, dim=1)).view(-1, chunk_size, dv)
        o = torch.baddbmm(o, aqk.view(-1, chunk_size, chunk_size),
                          torch.stack(v_new, dim=1).view(-1, chunk_size, dv),
                          beta=scale, alpha=scale)
        o = o.view(b, h, -1, dv)[:, :, :t].transpose(1, 2)
    final = state.view(b, h, dk, dv) if output_final_state else None
    return o.to(v.dtype), final


def fla_chunk_kda_kernel() -> Any:
    """flash-linear-attention's chunked KDA kernel, imported only when asked for."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    return fla_chunk_kda


def fla_kernel(name: str) -> Any:
    """One of flash-linear-attention's KDA kernels by name, imported only when asked for."""
    import fla.ops.kda as fla_kda

    return getattr(fla_kda, name)


@functools.cache
def bounded_gate_option(fla_kda: Any) -> dict[str, bool]:
    """``{"safe_gate": True}`` where the installed fla's ``chunk_kda`` takes it (fla-core
    0.6 does; an older one has no such argument and gets none). Read once per kernel
    function, not on every forward."""
    parameters = inspect.signature(fla_kda).parameters.values()
    takes = any(p.name == "safe_gate" or p.kind is p.VAR_KEYWORD for p in parameters)
    return {"safe_gate": True} if takes else {}


@functools.cache
def fla_available() -> bool:
    """Whether flash-linear-attention's KDA kernel imports (checked once per process)."""
    try:
        fla_chunk_kda_kernel()
    except ImportError:
        return False
    return True


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x · rsqrt(Σx² + eps)`` over the last dim, in fp32, returned in x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.square().sum(-1, keepdim=True) + eps)).to(x.dtype)
