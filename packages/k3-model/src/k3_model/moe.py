"""Mixture-of-experts MLP: fp32 sigmoid router, quantile-balanced top-k, SwiGLU experts.

A token's output is ``Σ_{e ∈ top-k} g_e · expert_e(x) + shared(x)``. The router runs in
fp32 with autocast disabled (its scores decide discrete choices, which bf16 rounding
would flip); the :class:`~k3_model.QuantileBalancer` picks the experts on biased scores;
the gates ``g`` are the *unbiased* scores of the chosen experts normalised to sum 1
(times ``routed_scaling``), as in DeepSeek-V3 / Kimi K2 with sigmoid routing.

Routing statistics for diagnostics are accumulated on device only while
``collect_stats`` is True and the layer is training; :meth:`MoE.pop_stats` reads and
clears them. With collection off they cost one attribute check per forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .balancer import QuantileBalancer
from .config import K3Config
from .mlp import SwiGLU


class Router(nn.Module):
    """Sigmoid affinity scores ``σ(x Wᵀ)``, ``(T, E)``, always fp32 (autocast disabled)."""

    def __init__(self, d_model: int, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_model).normal_(0.0, 0.02))

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return torch.sigmoid(F.linear(x.float(), self.weight.float()))

    def extra_repr(self) -> str:
        return f"d_model={self.weight.shape[1]}, n_experts={self.weight.shape[0]}, fp32"


class Experts(nn.Module):
    """``n_experts`` SwiGLU experts stored as 3-D stacks ``(E, out, in)``.

    Stacks (not a ModuleList) so an optimizer sees each weight kind as one batch of
    matrices (k3-optim orthogonalizes them together). Tokens are grouped by expert with
    one sort and a loop over experts; the per-expert counts cost one host sync. Outputs
    are gathered back by the inverse permutation, not a scatter-add, so the result is
    deterministic on GPUs too.
    """

    def __init__(self, n_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.n_experts = n_experts
        # N(0, 0.02) when used alone; K3Model.reset_parameters applies the config's init.
        self.w_gate = nn.Parameter(torch.empty(n_experts, hidden, d_model).normal_(0.0, 0.02))
        self.w_up = nn.Parameter(torch.empty(n_experts, hidden, d_model).normal_(0.0, 0.02))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_model, hidden).normal_(0.0, 0.02))

    def extra_repr(self) -> str:
        e, hidden, d = self.w_gate.shape
        return f"n_experts={e}, d_model={d}, hidden={hidden}"

    def forward(self, x: Tensor, experts: Tensor, gates: Tensor) -> Tensor:
        """``x`` ``(T, d)``; ``experts``/``gates`` ``(T, k)`` → ``Σ_k gate · expert(x)``."""
        k = experts.shape[1]
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # assignments grouped by expert
        token = order // k
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        parts = []
        for e, xe in enumerate(torch.split(x[token], counts)):
            h = F.silu(F.linear(xe, self.w_gate[e])) * F.linear(xe, self.w_up[e])
            parts.append(F.linear(h, self.w_down[e]))
        y = torch.cat(parts) * gates.reshape(-1)[order].unsqueeze(1).to(parts[0].dtype)
        # Undo the sort (a permutation: no scatter-add, so deterministic on every device)
        # and sum each token's k expert outputs.
        unsorted = torch.empty_like(y)
        unsorted[order] = y
        return unsorted.view(x.shape[0], k, -1).sum(dim=1)


@dataclass(frozen=True)
class RoutingStats:
    """Routing of one MoE layer over a window of training forwards (device tensors).

    ``tokens_per_expert``: ``(E,)`` routed (token, expert) assignments summed over the
    window; ``forwards``: training forwards in the window; ``bias``: the balancer's
    selection bias when read. :meth:`to_metrics` reads it all with one host sync.
    """

    tokens_per_expert: Tensor
    forwards: int
    bias: Tensor

    def to_metrics(self) -> dict[str, Any]:
        """``{load_per_step: [E floats], load_cv, max_load_ratio, dead_experts, bias_min,
        bias_max, forwards}``: mean tokens per expert per forward, their coefficient of
        variation (population std / mean; 0 = perfectly even), busiest expert over the
        mean, experts that got no token in the window, and the bias range."""
        e = self.tokens_per_expert.numel()
        on_device = self.bias.to(self.tokens_per_expert.device).double()
        numbers = torch.cat([self.tokens_per_expert.double(), on_device]).tolist()  # 1 sync
        tokens, bias = numbers[:e], numbers[e:]
        mean = sum(tokens) / e
        std = math.sqrt(sum((t - mean) ** 2 for t in tokens) / e)
        return {
            "load_per_step": [t / max(self.forwards, 1) for t in tokens],
            "load_cv": std / mean if mean > 0 else 0.0,
            "max_load_ratio": max(tokens) / mean if mean > 0 else 0.0,
            "dead_experts": sum(1 for t in tokens if t == 0),
            "bias_min": min(bias),
            "bias_max": max(bias),
            "forwards": self.forwards,
        }


class MoE(nn.Module):
    """A MoE MLP layer: ``router``, ``balancer``, ``experts`` and optional ``shared``.

    Set ``collect_stats = True`` to accumulate routing statistics over training forwards
    (no host sync); :meth:`pop_stats` returns them and starts a new window.
    """

    collect_stats: bool = False

    def __init__(self, config: K3Config):
        super().__init__()
        self.top_k = config.moe_top_k
        self.routed_scaling = config.routed_scaling
        self.router = Router(config.d_model, config.n_experts)
        self.balancer = QuantileBalancer(
            config.n_experts,
            config.moe_top_k,
            enabled=config.moe_balance,
            rate=config.moe_balance_rate,
        )
        self.experts = Experts(config.n_experts, config.d_model, config.moe_d_ff)
        shared = config.n_shared_experts * config.moe_d_ff
        self.shared = SwiGLU(config.d_model, shared) if shared else None
        self._stat_tokens: Tensor | None = None
        self._stat_forwards = 0

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Experts ``(T, k)`` and fp32 gates ``(T, k)`` for tokens ``x`` ``(T, d)``.

        A training call updates the balancer (the choice itself uses the old bias).
        """
        scores = self.router(x)
        experts = self.balancer(scores)
        gates = scores.gather(1, experts)
        gates = gates / gates.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return experts, gates * self.routed_scaling

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        experts, gates = self.route(x)
        if self.collect_stats and self.training:
            self._record(experts)
        out: Tensor = self.experts(x, experts, gates)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(shape)

    @torch.no_grad()
    def _record(self, experts: Tensor) -> None:
        counts = torch.bincount(experts.reshape(-1), minlength=self.experts.n_experts)
        self._stat_tokens = counts if self._stat_tokens is None else self._stat_tokens + counts
        self._stat_forwards += 1

    def pop_stats(self) -> RoutingStats | None:
        """Statistics since the last call (None if no training forward collected any)."""
        if self._stat_tokens is None:
            return None
        stats = RoutingStats(self._stat_tokens, self._stat_forwards, self.balancer.bias.clone())
        self._stat_tokens, self._stat_forwards = None, 0
        return stats
