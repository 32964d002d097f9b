"""The K3 Kimi Delta Attention layer: short-convolution q/k/v, the per-channel gated delta
rule (:mod:`k3_model.delta_rule`, whose operators this module re-exports), and a gated
RMSNorm on the way out; exact under context parallelism (:mod:`k3_model.state_passing`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import KDAState, Step
from .context_parallel import ContextParallel
from .delta_rule import (
    BACKENDS,
    CHUNK_SIZES,
    DECAY_LOWER_BOUND,
    DECAYS,
    bounded_gate_option,
    chunk_kda,
    compute_dtype,
    fla_available,
    fla_chunk_kda_kernel,
    fla_kernel,
    l2_normalize,
    recurrent_kda,
    recurrent_step_,
)
from .documents import Documents
from .norm import RMSNorm
from .state_passing import carry_in, settle, slice_summary


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
            fla_kda = fla_chunk_kda_kernel()
            bounded = self.decay_bound is not None and self.decay_bound >= DECAY_LOWER_BOUND
            options = bounded_gate_option(fla_kda) if bounded else {}
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
            fla_kda = fla_kernel("fused_recurrent_kda" if t == 1 else "chunk_kda")
            o, state = fla_kda(q, k, v, g, beta, scale=e**-0.5, initial_state=entry.state,
                               output_final_state=True, use_qk_l2norm_in_kernel=False)
        elif t == 1:
            if entry.state is None:
                entry.state = torch.zeros(b, h, e, e, dtype=compute_dtype(q, k, v),
                                          device=x.device)
            o, state = recurrent_step_(entry.state, q[:, 0], k[:, 0], v[:, 0], g[:, 0],
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
