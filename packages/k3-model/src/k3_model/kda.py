"""Kimi Delta Attention (KDA): the gated delta-rule operator and the K3 layer around it.

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
from torch import Tensor, nn

from .cache import KDAState, Step
from .context_parallel import ContextParallel
from .documents import Documents
from .norm import RMSNorm

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


def _compute_dtype(*tensors: Tensor | None) -> torch.dtype:
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
    dtype, out_dtype = _compute_dtype(q, k, v, g, beta, initial_state), v.dtype
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


def _recurrent_step_(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
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
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
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


def _fla_chunk_kda() -> Any:
    """flash-linear-attention's chunked KDA kernel, imported only when asked for."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    return fla_chunk_kda


def _fla_kernel(name: str) -> Any:
    """One of flash-linear-attention's KDA kernels by name, imported only when asked for."""
    import fla.ops.kda as fla_kda

    return getattr(fla_kda, name)


@functools.cache
def _bounded_gate_option(fla_kda: Any) -> dict[str, bool]:
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
        _fla_chunk_kda()
    except ImportError:
        return False
    return True


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x · rsqrt(Σx² + eps)`` over the last dim, in fp32, returned in x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """The K3 KDA layer: short-conv q/k/v, per-channel gated delta rule, gated RMSNorm out.

    Every forward starts from a zero state (training: no cache leaks between batches);
    ``forward_cached`` continues from a decoding state (:mod:`k3_model.cache`).
    Parameters: ``q_proj``/``k_proj``/``v_proj`` (per-head row blocks, see
    ``muon_heads``), ``q_conv``/``k_conv``/``v_conv`` (depthwise causal, 3-D weights),
    ``f_a``/``f_b`` (low-rank forget gate), ``b_proj`` (β), ``g_proj`` (output gate),
    ``o_norm``, ``o_proj``, and two vectors that a model-wide normal init must skip:
    ``A_log`` [H] (init log U(1, 16)) and ``dt_bias`` [H·K] (init 0); ``reset_parameters``
    sets them. ``backend``: "torch" runs ``chunk_kda``; "fla" runs flash-linear-attention's
    kernel (CUDA); "auto" picks fla for CUDA inputs when it imports, else ``chunk_kda``.
    """

    context_parallel: ContextParallel | None = None
    """This rank's context-parallel group (``K3Model.set_context_parallel``); None: off."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, *, conv_size: int = 4,
                 norm_eps: float = 1e-5, chunk_size: int = 64, backend: str = "auto",
                 decay: str = "bounded", gate_lower_bound: float = DECAY_LOWER_BOUND,
                 output_gate_rank: int = 0):
        super().__init__()
        for name, value in (("d_model", d_model), ("n_heads", n_heads),
                            ("head_dim", head_dim), ("conv_size", conv_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps!r}")
        if chunk_size not in CHUNK_SIZES:
            raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
        if not (math.isfinite(gate_lower_bound) and gate_lower_bound < 0):
            raise ValueError(f"gate_lower_bound must be a finite number < 0, "
                             f"got {gate_lower_bound!r}")
        if not isinstance(output_gate_rank, int) or output_gate_rank < 0:
            raise ValueError(f"output_gate_rank must be an int ≥ 0 (0 = full rank), "
                             f"got {output_gate_rank!r}")
        if backend == "fla" and not fla_available():
            raise ImportError("backend='fla' needs flash-linear-attention "
                              "(pip install flash-linear-attention); or use backend='auto'")
        self.n_heads, self.head_dim, self.conv_size = n_heads, head_dim, conv_size
        self.chunk_size, self.backend = chunk_size, backend
        self.decay_form, self.gate_lower_bound = decay, float(gate_lower_bound)
        inner = n_heads * head_dim
        self.q_proj = nn.Linear(d_model, inner, bias=False)
        self.k_proj = nn.Linear(d_model, inner, bias=False)
        self.v_proj = nn.Linear(d_model, inner, bias=False)
        self.q_conv, self.k_conv, self.v_conv = (
            nn.Conv1d(inner, inner, conv_size, groups=inner, bias=False) for _ in range(3))
        self.f_a = nn.Linear(d_model, head_dim, bias=False)
        self.f_b = nn.Linear(head_dim, inner, bias=False)
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.dt_bias = nn.Parameter(torch.empty(inner))
        self.b_proj = nn.Linear(d_model, n_heads, bias=False)
        if output_gate_rank:  # Kimi Linear: low rank, like the forget gate
            self.g_a = nn.Linear(d_model, output_gate_rank, bias=False)
            self.g_b = nn.Linear(output_gate_rank, inner, bias=False)
        else:  # K3: full rank
            self.g_proj = nn.Linear(d_model, inner, bias=False)
        self.o_norm = RMSNorm(head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(inner, d_model, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Design init for what a normal init of 2-D weights does not cover.

        Bounded decay (K3): ``dt_bias = 0``, as torchtitan's and NeMo's K3 ports: at init a
        token keeps about e^{−2.5} ≈ 8% of the state per step. fla's init (``dt_bias`` =
        softplus⁻¹ of a log-uniform dt in [1e-3, 0.1], ≈ 95% kept) trained worse in
        ``bench:quality``'s ``kda_gate_init`` comparison (0.027 bits per byte, every
        seed; BENCHMARKS.md). Softplus decay (Kimi Linear): fla's init, which that form
        was published with (with ``dt_bias = 0`` it would start at up to e^{−11} kept).
        """
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
            if self.decay_form == "softplus":
                dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(0.1))
                dt = dt.exp().clamp_min(1e-4)
                self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)
            else:
                self.dt_bias.zero_()
            self.o_norm.weight.fill_(1.0)
        for conv in (self.q_conv, self.k_conv, self.v_conv):
            conv.reset_parameters()

    def muon_heads(self) -> dict[str, int]:
        """Per-head Muon row blocks of this module's weights (relative names)."""
        h = self.n_heads
        return {"q_proj.weight": h, "k_proj.weight": h, "v_proj.weight": h}

    def _short_conv(self, conv: nn.Conv1d, x: Tensor, documents: Documents | None = None,
                    halo: Tensor | None = None) -> Tensor:
        """Depthwise causal conv over time ([B, T, C] in and out) then SiLU; with
        ``documents``, tap ``j`` tokens back reads zero where that token belongs to an
        earlier document (the document's own convolution, restarted). ``halo`` [B,
        kernel − 1, C]: the inputs before ``x`` (context parallelism: the previous
        slice's last ones) instead of zeros."""
        width = self.conv_size
        padded = F.pad(x, (0, 0, width - 1, 0)) if halo is None else torch.cat([halo, x], 1)
        if documents is None:
            return F.silu(conv(padded.transpose(1, 2))).transpose(1, 2)
        t = x.shape[1]
        taps = conv.weight[:, 0].to(x.dtype)  # [C, width]: tap i reads width − 1 − i back
        out = padded[:, width - 1:] * taps[:, -1]
        for i in range(width - 1):
            back = width - 1 - i
            seen = (documents.positions >= back)[..., None].to(x.dtype)
            out = out + padded[:, i:i + t] * taps[:, i] * seen
        return F.silu(out)

    def decay(self, x: Tensor) -> Tensor:
        """The log decay g [B, T, H, K] in fp32: K3's bounded
        ``bound·sigmoid(exp(A_log)·(f + dt_bias))``, or Kimi Linear's
        ``−exp(A_log)·softplus(f + dt_bias)``."""
        b, t, _ = x.shape
        f = self.f_b(self.f_a(x)).float() + self.dt_bias.float()
        f = f.view(b, t, self.n_heads, self.head_dim)
        rate = self.A_log.float().exp().view(self.n_heads, 1)
        if self.decay_form == "softplus":
            return -rate * F.softplus(f)
        return self.gate_lower_bound * torch.sigmoid(rate * f)

    @property
    def decay_bound(self) -> float | None:
        """The least g the decay can take (None: unbounded), what ``chunk_kda`` is told."""
        return self.gate_lower_bound if self.decay_form == "bounded" else None

    def output_gate(self, x: Tensor) -> Tensor:
        """``W_g x`` before the sigmoid: full rank (``g_proj``) or low rank (``g_b(g_a x)``)."""
        out: Tensor = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b(self.g_a(x))
        return out

    def _use_fla(self, x: Tensor) -> bool:
        if self.backend == "torch":
            return False
        if self.backend == "fla":
            if x.device.type != "cuda":
                raise RuntimeError("backend='fla' runs on CUDA only; use backend='auto' "
                                   f"or 'torch' for {x.device.type} inputs")
            return True
        return x.device.type == "cuda" and fla_available()

    def forward(self, x: Tensor, documents: Documents | None = None) -> Tensor:
        """The layer's output for ``x`` [B, T, d] from a zero state; with ``documents``,
        the state and the convolution restart at each document's first token (every
        document as if alone). Under context parallelism (``context_parallel`` set),
        ``x`` is this rank's slice and the state and the convolution continue from the
        earlier slices (:meth:`_forward_slice`)."""
        if self.context_parallel is not None:
            return self._forward_slice(x, self.context_parallel, documents)
        b, t, _ = x.shape
        h, e = self.n_heads, self.head_dim
        q = self._short_conv(self.q_conv, self.q_proj(x), documents).view(b, t, h, e)
        k = self._short_conv(self.k_conv, self.k_proj(x), documents).view(b, t, h, e)
        v = self._short_conv(self.v_conv, self.v_proj(x), documents).view(b, t, h, e)
        q, k = l2_normalize(q), l2_normalize(k)
        g = self.decay(x)
        beta = torch.sigmoid(self.b_proj(x).float())
        scale = e**-0.5
        if self._use_fla(x):
            # safe_gate=True: fla's faster intra-chunk kernel for a g bounded below, which for
            # a precomputed g (use_gate_in_kernel=False) the caller guarantees; fla sizes it
            # for bounds ≥ −5, K3's DECAY_LOWER_BOUND. fla's lower_bound only shapes its
            # in-kernel gate (use_gate_in_kernel=True), which K3 does not use.
            fla_kda = _fla_chunk_kda()
            bounded = self.decay_bound is not None and self.decay_bound >= DECAY_LOWER_BOUND
            options = _bounded_gate_option(fla_kda) if bounded else {}
            if documents is None:
                o, _ = fla_kda(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=False,
                               **options)
            else:  # fla's varlen form: every document one sequence of a flat batch of one
                flat = [z.reshape(1, b * t, *z.shape[2:]) for z in (q, k, v, g, beta)]
                bounds = torch.nonzero(documents.starts.flatten()).flatten()
                cu_seqlens = F.pad(bounds, (0, 1), value=b * t)
                o, _ = fla_kda(*flat, scale=scale, use_qk_l2norm_in_kernel=False,
                               cu_seqlens=cu_seqlens, **options)
                o = o.view(b, t, h, e)
        elif documents is None:
            o, _ = chunk_kda(q, k, v, g, beta, scale=scale, chunk_size=self.chunk_size,
                             gate_lower_bound=self.decay_bound)
        else:  # each row's documents chunk-aligned, the state zeroed where each begins
            packing = documents.packing(self.chunk_size)
            o, _ = chunk_kda(*(packing.pack(z) for z in (q, k, v, g, beta)), scale=scale,
                             chunk_size=self.chunk_size, gate_lower_bound=self.decay_bound,
                             restart=packing.restart)
            o = packing.unpack(o)
        o = self.o_norm(o) * torch.sigmoid(self.output_gate(x)).view(b, t, h, e)
        out: Tensor = self.o_proj(o.reshape(b, t, h * e))
        return out

    def _forward_slice(self, x: Tensor, cp: ContextParallel,
                       documents: Documents | None) -> Tensor:
        """:meth:`forward` on rank ``cp.rank``'s slice of the sequence, exactly (see
        :mod:`k3_model.state_passing`): the short convolutions read the previous slice's
        last ``kernel − 1`` projected inputs, and the recurrence starts from the state
        the earlier slices hand over, composed from every slice's ``[S₀ | M]``. Runs
        ``chunk_kda`` (any device; flash-linear-attention's kernel is not used here)."""
        from .state_passing import carry_in, settle, slice_summary

        b, t, _ = x.shape
        h, e, width = self.n_heads, self.head_dim, self.conv_size
        if t < width - 1:
            raise ValueError(f"context parallelism: a slice of {t} tokens is shorter than "
                             f"the short convolution's reach ({width - 1}); use fewer ranks")
        projected = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]
        halo = cp.previous(torch.cat([p[:, t - (width - 1):] for p in projected], dim=-1))
        q, k, v = (self._short_conv(conv, p, documents, part).view(b, t, h, e)
                   for conv, p, part in zip((self.q_conv, self.k_conv, self.v_conv),
                                            projected, torch.split(halo, h * e, dim=-1)))
        q, k = l2_normalize(q), l2_normalize(k)
        g = self.decay(x)
        beta = torch.sigmoid(self.b_proj(x).float())
        packing = None if documents is None else documents.packing(self.chunk_size)
        if packing is not None:  # documents chunk-aligned; the slice's first chunk
            q, k, v, g, beta = (packing.pack(z) for z in (q, k, v, g, beta))  # restarts
        o0, reads, summary = slice_summary(  # only where a document starts
            q, k, v, g, beta, scale=e**-0.5, chunk_size=self.chunk_size,
            gate_lower_bound=self.decay_bound,
            restart=None if packing is None else packing.restart)
        if packing is not None:
            o0, reads = packing.unpack(o0), packing.unpack(reads)
        incoming = carry_in(cp.gather(summary).unbind(0), cp.rank)
        o = settle(o0, reads, incoming, v.dtype)
        o = self.o_norm(o) * torch.sigmoid(self.output_gate(x)).view(b, t, h, e)
        out: Tensor = self.o_proj(o.reshape(b, t, h * e))
        return out

    def forward_cached(self, x: Tensor, entry: KDAState, step: Step,
                       rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """:meth:`forward` for ``T`` new tokens continuing from ``entry`` (the recurrent
        state and the convolution's tail), which it overwrites in place. Padded inputs
        (``step.real`` False) are zeroed, so they write nothing and a sequence's state is
        its own. One token at a time runs the recurrence, longer steps the chunked form.
        ``rope`` is unused (KDA has no positions)."""
        b, t, _ = x.shape
        h, e = self.n_heads, self.head_dim
        if step.padded:
            x = x * step.real[..., None].to(x.dtype)
        # q, k and v side by side: one depthwise conv over [tail | new] as windows times
        # taps (for a few tokens far cheaper than a conv1d call, whose setup dominates)
        proj = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        tail = entry.tail if entry.tail is not None else \
            proj.new_zeros(b, self.conv_size - 1, proj.shape[-1])
        full = torch.cat([tail, proj], dim=1)  # [B, kernel − 1 + T, 3·H·K]
        taps = torch.cat([self.q_conv.weight[:, 0], self.k_conv.weight[:, 0],
                          self.v_conv.weight[:, 0]]).to(full.dtype)
        mixed = F.silu((full.unfold(1, self.conv_size, 1) * taps).sum(-1))
        q, k, v = (m.reshape(b, t, h, e) for m in torch.split(mixed, h * e, dim=-1))
        q, k = l2_normalize(q), l2_normalize(k)
        g = self.decay(x)
        beta = torch.sigmoid(self.b_proj(x).float())
        if self._use_fla(x):  # fla's kernels: fused recurrent for one token, else chunked
            fla_kda = _fla_kernel("fused_recurrent_kda" if t == 1 else "chunk_kda")
            o, state = fla_kda(q, k, v, g, beta, scale=e**-0.5, initial_state=entry.state,
                               output_final_state=True, use_qk_l2norm_in_kernel=False)
        elif t == 1:
            if entry.state is None:
                entry.state = torch.zeros(b, h, e, e, dtype=_compute_dtype(q, k, v),
                                          device=x.device)
            o, state = _recurrent_step_(entry.state, q[:, 0], k[:, 0], v[:, 0], g[:, 0],
                                        beta[:, 0], e**-0.5)[:, None].to(v.dtype), entry.state
        else:
            o, state = chunk_kda(q, k, v, g, beta, scale=e**-0.5, chunk_size=self.chunk_size,
                                 gate_lower_bound=self.decay_bound,
                                 initial_state=entry.state, output_final_state=True)
        entry.update(state, full[:, full.shape[1] - (self.conv_size - 1):])
        o = self.o_norm(o) * torch.sigmoid(self.output_gate(x)).view(b, t, h, e)
        out: Tensor = self.o_proj(o.reshape(b, t, h * e))
        return out

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, head_dim={self.head_dim}, conv={self.conv_size}, "
                f"chunk={self.chunk_size}, backend={self.backend!r}, "
                f"decay={self.decay_form!r}")


__all__ = ["KimiDeltaAttention", "chunk_kda", "fla_available", "l2_normalize",
           "recurrent_kda"]
