"""Causal self-attention that takes part in QK-Clip: GQA/MHA and (gated) multi-head latent.

Each class declares which rows of which weight feed each head's logits (``qk_clip_spec``)
and carries a ``qk_observer`` attribute that :class:`k3_qkclip.QKClip` fills while it is
active. ``observed_attention`` is plain ``F.scaled_dot_product_attention`` unless an
observer is installed and the module is training; then it also records each head's
exact maximum pre-softmax logit. ``forward`` starts from scratch (training and evaluation);
``forward_cached`` continues from a decoding cache (:mod:`k3_model.cache`).
:func:`build_attention` also builds the KDA layers of a hybrid model
(:mod:`k3_model.kda`), which take no part in QK-Clip: they L2-normalize q and k, so
their logits are bounded by construction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3_qkclip import QKObserver, QKSpec, observed_attention

from .cache import KVCache, LatentCache, Step
from .config import K3Config
from .context_parallel import ContextParallel, context_attention
from .documents import Documents
from .kda import KimiDeltaAttention
from .norm import RMSNorm
from .rope import apply_rotary


class GQAttention(nn.Module):
    """Grouped-query attention with RoPE on the whole head; MHA when ``n_kv_heads == n_heads``.

    Weights: ``q_proj`` (``n_heads`` row blocks of ``head_dim``), ``k_proj`` and ``v_proj``
    (``n_kv_heads`` blocks each), ``o_proj``. Query head h reads key/value head
    ``h // (n_heads // n_kv_heads)``.
    """

    qk_observer: QKObserver | None = None  # installed by k3_qkclip.QKClip while active
    context_parallel: ContextParallel | None = None  # K3Model.set_context_parallel

    def __init__(self, config: K3Config):
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.kv_heads
        self.head_dim = config.attn_head_dim
        d, h, kv, e = config.d_model, self.n_heads, self.n_kv_heads, self.head_dim
        self.q_proj = nn.Linear(d, h * e, bias=False)
        self.k_proj = nn.Linear(d, kv * e, bias=False)
        self.v_proj = nn.Linear(d, kv * e, bias=False)
        self.o_proj = nn.Linear(h * e, d, bias=False)

    def qk_clip_spec(self) -> QKSpec:
        """QK-Clip geometry: per-head row blocks of ``q_proj`` and ``k_proj``."""
        if self.n_kv_heads == self.n_heads:
            return QKSpec.mha(self.n_heads, self.head_dim, q="q_proj", k="k_proj")
        return QKSpec.gqa(self.n_heads, self.n_kv_heads, self.head_dim, q="q_proj", k="k_proj")

    def muon_heads(self) -> dict[str, int]:
        """Per-head Muon row blocks of this module's weights (relative names)."""
        return {"q_proj.weight": self.n_heads, "k_proj.weight": self.n_kv_heads,
                "v_proj.weight": self.n_kv_heads}

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                documents: Documents | None = None) -> Tensor:
        """``x`` ``(B, T, d)``; ``cos``/``sin`` the rotary tables at the tokens' positions;
        with ``documents``, each token attends within its own document only."""
        b, t, _ = x.shape
        h, kv, e = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(b, t, h, e).transpose(1, 2)
        k = self.k_proj(x).view(b, t, kv, e).transpose(1, 2)
        v = self.v_proj(x).view(b, t, kv, e).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        mask = None if documents is None else documents.mask
        if self.context_parallel is None:
            y = observed_attention(q, k, v, self.qk_observer, mask=mask)
        else:  # the keys and values of this slice and every earlier one
            seen = self.context_parallel.visible(torch.cat([k, v], dim=-1), 2)
            keys, values = torch.split(seen, e, dim=-1)
            y = context_attention(q, keys, values, self.qk_observer, mask)
        out: Tensor = self.o_proj(y.transpose(1, 2).reshape(b, t, h * e))
        return out

    def forward_cached(self, x: Tensor, entry: KVCache, step: Step,
                       rope: tuple[Tensor, Tensor] | None) -> Tensor:
        """:meth:`forward` for ``T`` new tokens after the cached ones (``rope``: the rotary
        tables at the tokens' own positions, ``[B, 1, T, dim/2]``); writes their keys and
        values into the cache."""
        if rope is None:
            raise ValueError("GQAttention needs the rotary tables cos and sin")
        b, t, _ = x.shape
        h, kv, e = self.n_heads, self.n_kv_heads, self.head_dim
        q = apply_rotary(self.q_proj(x).view(b, t, h, e).transpose(1, 2), *rope)
        k = apply_rotary(self.k_proj(x).view(b, t, kv, e).transpose(1, 2), *rope)
        keys, values = entry.write(step, k.transpose(1, 2).reshape(b, t, kv * e),
                                   self.v_proj(x))
        length = keys.shape[1]
        keys = keys.view(b, length, kv, e).transpose(1, 2)
        values = values.view(b, length, kv, e).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=step.attention_mask,
                                           enable_gqa=kv != h)
        out: Tensor = self.o_proj(y.transpose(1, 2).reshape(b, t, h * e))
        return out


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 / Kimi K2 layout), optionally gated (K3).

    Query: ``q_proj`` (full rank) or ``q_down`` → ``q_norm`` → ``q_up``; rows per head
    ``[q_nope | q_rope]``. Key/value: ``kv_down`` rows ``[latent | k_rope]`` (one key
    slice shared by all heads), ``kv_norm`` on the latent, ``kv_up`` rows per head
    ``[k_nope | v]``. Logit of head h: ``q_nope·k_nope + rope(q_rope)·rope(k_rope)``,
    scaled by ``(nope + rope) ** -0.5``; with ``mla_rope`` off (NoPE, as Kimi K3) the
    shared slice is used as it is, without rotation. Gated (``mla_gate``): the heads'
    output is multiplied by ``σ(g_proj x)`` (``g_proj``: d → H·v) before ``o_proj``.
    """

    qk_observer: QKObserver | None = None  # installed by k3_qkclip.QKClip while active
    context_parallel: ContextParallel | None = None  # K3Model.set_context_parallel

    def __init__(self, config: K3Config):
        super().__init__()
        self.n_heads = config.n_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_rank = config.v_head_dim, config.kv_lora_rank
        self.q_rank = config.q_lora_rank
        self.rope, self.gated = config.mla_uses_rope, config.mla_gated
        d, h = config.d_model, self.n_heads
        q_rows = h * (self.nope_dim + self.rope_dim)
        if self.q_rank:
            self.q_down = nn.Linear(d, self.q_rank, bias=False)
            self.q_norm = RMSNorm(self.q_rank, config.latent_norm_eps)
            self.q_up = nn.Linear(self.q_rank, q_rows, bias=False)
        else:
            self.q_proj = nn.Linear(d, q_rows, bias=False)
        self.kv_down = nn.Linear(d, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, config.latent_norm_eps)
        self.kv_up = nn.Linear(self.kv_rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.g_proj = nn.Linear(d, h * self.v_dim, bias=False) if self.gated else None
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=False)

    @property
    def q_name(self) -> str:
        """The weight whose rows are per-head ``[q_nope | q_rope]``."""
        return "q_up" if self.q_rank else "q_proj"

    def qk_clip_spec(self) -> QKSpec:
        """QK-Clip geometry: per-head query and ``[k_nope | v]`` rows; the shared key slice
        (rotated or not) is declared and never scaled."""
        return QKSpec.mla(
            self.n_heads,
            self.nope_dim,
            self.rope_dim,
            self.v_dim,
            q=self.q_name,
            kv="kv_up",
            k_rope="kv_down",
            k_rope_offset=self.kv_rank,
        )

    def muon_heads(self) -> dict[str, int]:
        """Per-head Muon row blocks of this module's weights (relative names)."""
        return {f"{self.q_name}.weight": self.n_heads, "kv_up.weight": self.n_heads}

    def forward(self, x: Tensor, cos: Tensor | None = None, sin: Tensor | None = None,
                documents: Documents | None = None) -> Tensor:
        """``x`` ``(B, T, d)``; ``cos``/``sin`` are the rotary tables (unused with NoPE);
        with ``documents``, each token attends within its own document only."""
        b, t, _ = x.shape
        h, dn, dr, dv = self.n_heads, self.nope_dim, self.rope_dim, self.v_dim
        q = self.q_up(self.q_norm(self.q_down(x))) if self.q_rank else self.q_proj(x)
        q = q.view(b, t, h, dn + dr).transpose(1, 2)
        latent, k_shared = self.kv_down(x).split([self.kv_rank, dr], dim=-1)
        k_shared = k_shared.unsqueeze(1)
        if self.rope:
            if cos is None or sin is None:
                raise ValueError("MLAttention with RoPE needs the rotary tables cos and sin")
            q_nope, q_rope = q.split([dn, dr], dim=-1)
            q = torch.cat([q_nope, apply_rotary(q_rope, cos, sin)], dim=-1)
            k_shared = apply_rotary(k_shared, cos, sin)
        if self.context_parallel is not None:  # the latents of this slice and earlier ones
            compressed = torch.cat([latent, k_shared.squeeze(1)], dim=-1)
            seen = self.context_parallel.visible(compressed, 1)
            latent, k_shared = torch.split(seen, [self.kv_rank, dr], dim=-1)
            k_shared = k_shared.unsqueeze(1)
        s = latent.shape[1]
        kv = self.kv_up(self.kv_norm(latent)).view(b, s, h, dn + dv).transpose(1, 2)
        k_nope, v = kv.split([dn, dv], dim=-1)
        k = torch.cat([k_nope, k_shared.expand(b, h, s, dr)], dim=-1)
        mask = None if documents is None else documents.mask
        if self.context_parallel is None:
            y = observed_attention(q, k, v, self.qk_observer, mask=mask)
        else:
            y = context_attention(q, k, v, self.qk_observer, mask)
        y = y.transpose(1, 2).reshape(b, t, h * dv)
        return self._output(x, y)

    def _output(self, x: Tensor, y: Tensor) -> Tensor:
        if self.g_proj is not None:
            y = y * torch.sigmoid(self.g_proj(x))
        out: Tensor = self.o_proj(y)
        return out

    latent_steps: bool | None = None
    """Whether cached steps attend in the latent space (None: when it is cheaper, see
    :meth:`attends_in_latent_space`); True/False force one form (tests, benchmarks)."""

    def attends_in_latent_space(self, t: int) -> bool:
        """Whether a cached step of ``t`` new tokens attends over the latents directly.

        Per cached key and head, the expanded form pays ``r·(nope + v)`` multiply-adds to
        rebuild the key and value from the latent (rank r), then ``t·(nope + rope + v)``
        for the attention; the latent form pays ``t·(2r + rope)``. So decoding steps and
        short continuations take the latent form, a prefill the expanded one.
        """
        if self.latent_steps is not None:
            return self.latent_steps
        r, dn, dr, dv = self.kv_rank, self.nope_dim, self.rope_dim, self.v_dim
        return t * (2 * r + dr) < r * (dn + dv) + t * (dn + dr + dv)

    def forward_cached(self, x: Tensor, entry: LatentCache, step: Step,
                       rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """:meth:`forward` for ``T`` new tokens after the cached ones: writes each token's
        normalized latent and shared key slice (rotated at its own position with RoPE,
        ``rope`` ``[B, 1, T, rope/2]`` tables) into the cache, then attends over every
        cached token, in the latent space or expanded (:meth:`attends_in_latent_space`)."""
        b, t, _ = x.shape
        h, dn, dr, dv = self.n_heads, self.nope_dim, self.rope_dim, self.v_dim
        q = self.q_up(self.q_norm(self.q_down(x))) if self.q_rank else self.q_proj(x)
        q = q.view(b, t, h, dn + dr).transpose(1, 2)
        latent, k_shared = self.kv_down(x).split([self.kv_rank, dr], dim=-1)
        if self.rope:
            if rope is None:
                raise ValueError("MLAttention with RoPE needs the rotary tables cos and sin")
            q_nope, q_rope = q.split([dn, dr], dim=-1)
            q = torch.cat([q_nope, apply_rotary(q_rope, *rope)], dim=-1)
            k_shared = apply_rotary(k_shared.unsqueeze(1), *rope).squeeze(1)
        (cached,) = entry.write(step, torch.cat([self.kv_norm(latent), k_shared], dim=-1))
        if self.attends_in_latent_space(t):
            y = self._latent_attention(q, cached, step.attention_mask)
        else:
            y = self._expanded_attention(q, cached, step.attention_mask)
        return self._output(x, y.transpose(1, 2).reshape(b, t, h * dv))

    def _expanded_attention(self, q: Tensor, cached: Tensor, mask: Tensor) -> Tensor:
        """Every cached latent expanded through ``kv_up`` into per-head keys and values
        (the training forward's attention): ``[B, H, T, v]``."""
        b, length, _ = cached.shape
        h, dn, dr, dv = self.n_heads, self.nope_dim, self.rope_dim, self.v_dim
        latent, k_shared = torch.split(cached, [self.kv_rank, dr], dim=-1)
        kv = self.kv_up(latent).view(b, length, h, dn + dv).transpose(1, 2)
        k_nope, v = kv.split([dn, dv], dim=-1)
        k = torch.cat([k_nope, k_shared.unsqueeze(1).expand(b, h, length, dr)], dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def _latent_attention(self, q: Tensor, cached: Tensor, mask: Tensor) -> Tensor:
        """The same attention over the cached latents directly (DESIGN §10): with
        ``kv_up`` = ``[W_uk; W_uv]`` per head, ``q_nopeᵀ(W_uk c) = (W_ukᵀ q_nope)ᵀ c`` and
        ``Σ a (W_uv c) = W_uv (Σ a c)``; so each head's query is mapped into the latent
        space once, every head attends over the one shared ``[latent | key slice]`` row
        per token (multi-query attention, heads folded into the query rows), and the
        value up-projection is applied to the weighted latent: ``[B, H, T, v]``."""
        b, t = q.shape[0], q.shape[2]
        h, dn, dr, dv, r = self.n_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank
        w = self.kv_up.weight.view(h, dn + dv, r)
        q_nope, q_rope = torch.split(q, [dn, dr], dim=-1)
        query = torch.cat([torch.einsum("bhtn,hnr->bhtr", q_nope, w[:, :dn]), q_rope], -1)
        scores = torch.matmul(query.reshape(b, h * t, r + dr), cached.transpose(1, 2))
        scores = scores.view(b, h, t, -1).float() * (dn + dr) ** -0.5
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(cached.dtype)
        weighted = torch.matmul(probs.view(b, h * t, -1), cached[..., :r]).view(b, h, t, r)
        return torch.einsum("bhtr,hvr->bhtv", weighted, w[:, dn:])


def build_attention(config: K3Config, kind: str) -> GQAttention | MLAttention | KimiDeltaAttention:
    """The token mixer of one layer: ``kind`` is an entry of ``config.layer_types()``."""
    if kind == "kda":
        return KimiDeltaAttention(
            config.d_model, config.kda_n_heads, config.kda_dim,
            conv_size=config.kda_conv_size, norm_eps=config.norm_eps,
            chunk_size=config.kda_chunk_size, backend=config.kda_backend,
            decay=config.kda_decay, gate_lower_bound=config.kda_gate_lower_bound,
            output_gate_rank=config.kda_output_gate_rank,
        )
    return MLAttention(config) if kind == "mla" else GQAttention(config)
