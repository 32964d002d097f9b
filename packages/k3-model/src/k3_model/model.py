"""K3Model: a pre-norm decoder of attention + (dense or MoE) SwiGLU blocks.

``forward(x, targets=None) -> (logits, loss)``, loss the mean token cross-entropy. No
state survives a call (no KV cache, no recurrence), which is what the trainer assumes.
The parameter names are chosen so that ``k3_optim.build_parameter_groups`` routes them
without configuration: ``embed`` (nn.Embedding) and ``lm_head`` to AdamW, 1-D norm
weights to AdamW without decay, 2-D projections and the 3-D expert stacks to Muon, with
:meth:`K3Model.muon_per_head` giving the per-head row blocks of Q/K/V.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import GQAttention, MLAttention, build_attention
from .config import K3Config
from .mlp import SwiGLU
from .moe import MoE, RoutingStats
from .norm import RMSNorm
from .rope import RotaryEmbedding


class Block(nn.Module):
    """``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, config: K3Config, index: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn: GQAttention | MLAttention = build_attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp: MoE | SwiGLU = (
            MoE(config) if config.is_moe_layer(index) else SwiGLU(config.d_model, config.d_ff)
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        out: Tensor = x + self.mlp(self.mlp_norm(x))
        return out


class K3Model(nn.Module):
    """The reference K3-style decoder built from a validated :class:`K3Config`."""

    def __init__(self, config: K3Config):
        super().__init__()
        if not isinstance(config, K3Config):
            raise TypeError(f"K3Model needs a K3Config, got {type(config).__name__}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.rotary = RotaryEmbedding(config.rope_dim, config.max_seq_len, config.rope_theta)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; residual output projections (``o_proj``, every
        ``w_down``) shrunk by ``1/√(2·n_layers)`` so the residual stream's variance does
        not grow with depth (GPT-2); norms at one; balancer buffers at zero."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "w_down.weight", "experts.w_down")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)
        for name, buffer in self.named_buffers():
            if name.endswith(("balancer.bias", "balancer.load", "balancer.updates")):
                buffer.zero_()

    def forward(self, x: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits ``(B, T, vocab)`` for token ids ``x`` ``(B, T)``, and the mean token
        cross-entropy against ``targets`` ``(B, T)`` (None without targets; target
        ``-100`` is ignored). The loss is computed in fp32 under autocast too."""
        if x.ndim != 2:
            raise ValueError(
                f"K3Model: x must be (batch, seq) token ids, got shape {tuple(x.shape)}"
            )
        t = x.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(
                f"K3Model: sequence length {t} exceeds K3Config.max_seq_len "
                f"({self.config.max_seq_len}); raise max_seq_len or shorten the batch"
            )
        cos, sin = self.rotary(t)
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits: Tensor = self.lm_head(self.norm(h))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss

    # --- seams for the trainer -----------------------------------------------------------

    def moe_layers(self) -> dict[str, MoE]:
        """The MoE layers by module name (``layers.<i>.mlp``), in depth order."""
        return {name: m for name, m in self.named_modules() if isinstance(m, MoE)}

    def set_moe_stats(self, enabled: bool) -> None:
        """Turn routing-statistics collection on or off in every MoE layer."""
        for layer in self.moe_layers().values():
            layer.collect_stats = enabled

    def pop_moe_stats(self) -> dict[str, RoutingStats]:
        """Each MoE layer's statistics since the last call (layers with none are left out)."""
        found = {name: layer.pop_stats() for name, layer in self.moe_layers().items()}
        return {name: stats for name, stats in found.items() if stats is not None}

    def muon_per_head(self) -> dict[str, int]:
        """fnmatch pattern → row blocks, for ``build_parameter_groups(per_head=...)``.

        GQA: ``q_proj`` in ``n_heads`` blocks, ``k_proj``/``v_proj`` in ``n_kv_heads``.
        MLA: the query projection (``q_proj`` or ``q_up``) and ``kv_up`` in ``n_heads``.
        Patterns start with ``*`` so they also match under a wrapper's name prefix.
        """
        patterns: dict[str, int] = {}
        for layer in self.layers:
            assert isinstance(layer, Block)
            for name, heads in layer.attn.muon_heads().items():
                patterns[f"*.attn.{name}"] = heads
        return patterns
