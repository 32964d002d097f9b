"""Small reference attention modules that take part in QK-Clip.

They show the whole declaration (a ``qk_observer`` attribute, a ``qk_clip_spec()``
method, one ``observed_attention`` call) and serve the tests and the benchmark; a
model package can copy the pattern. Causal self-attention only, no KV cache.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .observe import QKObserver, observed_attention
from .spec import Kind, QKSpec


def apply_rope(x: Tensor, base: float = 10000.0) -> Tensor:
    """Rotary position embedding on the last dim of ``x`` ``(..., T, E)``, half-split pairs."""
    t, e = x.shape[-2], x.shape[-1]
    half = e // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    angles = torch.arange(t, dtype=torch.float64, device=x.device).unsqueeze(1) * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class ReferenceAttention(nn.Module):
    """Causal MHA (``n_kv_heads == n_heads``) or GQA with RoPE.

    ``fused=True`` uses one ``qkv`` projection with rows ``[q heads | k heads | v heads]``
    instead of ``q_proj``/``k_proj``/``v_proj``.
    """

    qk_observer: QKObserver | None = None  # installed by QKClip while active

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        fused: bool = False,
        bias: bool = False,
        rope: bool = True,
    ):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.head_dim = head_dim or dim // n_heads
        self.fused = fused
        self.rope = rope
        q_rows, kv_rows = n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if fused:
            self.qkv = nn.Linear(dim, q_rows + 2 * kv_rows, bias=bias)
        else:
            self.q_proj = nn.Linear(dim, q_rows, bias=bias)
            self.k_proj = nn.Linear(dim, kv_rows, bias=bias)
            self.v_proj = nn.Linear(dim, kv_rows, bias=bias)
        self.o_proj = nn.Linear(q_rows, dim, bias=False)

    def qk_clip_spec(self) -> QKSpec:
        kind: Kind = "mha" if self.n_kv_heads == self.n_heads else "gqa"
        if self.fused:
            return QKSpec.gqa(self.n_heads, self.n_kv_heads, self.head_dim, qkv="qkv", kind=kind)
        return QKSpec.gqa(
            self.n_heads, self.n_kv_heads, self.head_dim, q="q_proj", k="k_proj", kind=kind
        )

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        h, kv, e = self.n_heads, self.n_kv_heads, self.head_dim
        if self.fused:
            q, k, v = self.qkv(x).split([h * e, kv * e, kv * e], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, h, e).transpose(1, 2)
        k = k.view(b, t, kv, e).transpose(1, 2)
        v = v.view(b, t, kv, e).transpose(1, 2)
        if self.rope:
            q, k = apply_rope(q), apply_rope(k)
        y = observed_attention(q, k, v, self.qk_observer)
        out: Tensor = self.o_proj(y.transpose(1, 2).reshape(b, t, h * e))
        return out


class ReferenceMLA(nn.Module):
    """Causal multi-head latent attention (DeepSeek-V2 / Kimi K2 shape, no query LoRA).

    ``q_proj`` rows per head: ``[q_nope | q_rope]``. ``kv_a_proj`` rows: ``[latent |
    shared k_rope]``. ``kv_b_proj`` (reads the normed latent) rows per head: ``[k_nope | v]``.
    """

    qk_observer: QKObserver | None = None

    def __init__(
        self,
        dim: int,
        n_heads: int,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        kv_rank: int,
        *,
        bias: bool = False,
    ):
        super().__init__()
        self.n_heads, self.nope_dim, self.rope_dim = n_heads, nope_dim, rope_dim
        self.v_dim, self.kv_rank = v_dim, kv_rank
        self.q_proj = nn.Linear(dim, n_heads * (nope_dim + rope_dim), bias=bias)
        self.kv_a_proj = nn.Linear(dim, kv_rank + rope_dim, bias=bias)
        self.kv_norm = nn.RMSNorm(kv_rank)
        self.kv_b_proj = nn.Linear(kv_rank, n_heads * (nope_dim + v_dim), bias=bias)
        self.o_proj = nn.Linear(n_heads * v_dim, dim, bias=False)

    def qk_clip_spec(self) -> QKSpec:
        return QKSpec.mla(
            self.n_heads,
            self.nope_dim,
            self.rope_dim,
            self.v_dim,
            q="q_proj",
            kv="kv_b_proj",
            k_rope="kv_a_proj",
            k_rope_offset=self.kv_rank,
        )

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        h, dn, dr, dv = self.n_heads, self.nope_dim, self.rope_dim, self.v_dim
        q_nope, q_rope = self.q_proj(x).view(b, t, h, dn + dr).transpose(1, 2).split([dn, dr], -1)
        latent, k_rope = self.kv_a_proj(x).split([self.kv_rank, dr], dim=-1)
        kv = self.kv_b_proj(self.kv_norm(latent)).view(b, t, h, dn + dv).transpose(1, 2)
        k_nope, v = kv.split([dn, dv], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(1)).expand(b, h, t, dr)  # one key, every head
        q = torch.cat([q_nope, apply_rope(q_rope)], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        y = observed_attention(q, k, v, self.qk_observer)
        out: Tensor = self.o_proj(y.transpose(1, 2).reshape(b, t, h * dv))
        return out
