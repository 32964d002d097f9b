"""Mixture-of-experts MLP (LatentMoE): fp32 sigmoid router, quantile-balanced top-k.

A token's output is ``up(norm(Σ_{e ∈ top-k} g_e · expert_e(down(x)))) + shared(x)``: the
router reads the full-width ``x``, the routed experts run at ``moe_latent_dim`` between a
down-projection and an RMSNorm + up-projection (Kimi K3's LatentMoE; with
``moe_latent_dim = 0`` they run at full width with no projections), and the shared
experts are full-width GLU MLPs. The router runs in fp32 with autocast disabled (its
scores decide discrete choices, which bf16 rounding would flip); the
:class:`~k3_model.QuantileBalancer` picks the experts on biased scores; the gates ``g``
are the *unbiased* scores of the chosen experts normalised to sum 1 (times
``routed_scaling``), as in DeepSeek-V3 / Kimi K2 with sigmoid routing.

No host sync in the forward: group sizes, balancer load and statistics stay on the
device. Routing statistics for diagnostics are accumulated only while
``collect_stats`` is True and the layer is training; :meth:`MoE.pop_stats` reads and
clears them. With collection off they cost one attribute check per forward.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .activation_checkpointing import recomputing
from .balancer import QuantileBalancer, expert_counts
from .config import K3Config
from .mlp import GatedMLP, glu
from .norm import RMSNorm

_DECODING: contextvars.ContextVar[bool] = contextvars.ContextVar("k3_decoding", default=False)


@contextlib.contextmanager
def decoding() -> Iterator[None]:
    """Mark the forwards inside as decoding steps (``K3Model.forward_cached``): eager
    experts may then take the gathered path for a few tokens, which rounds differently
    from the grouped kernel; training and evaluation forwards never do, nor compiled ones."""
    token = _DECODING.set(True)
    try:
        yield
    finally:
        _DECODING.reset(token)


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


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: the grouped GEMM's
    backward rejects expanded gradients (e.g. from ``.sum()``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _grouped_linear(x: Tensor, weight: Tensor, ends: Tensor) -> Tensor:
    """Rows of ``x`` grouped by expert (group e ends at ``ends[e]``) times ``weight[e]ᵀ``."""
    out: Tensor = _ContiguousGrad.apply(  # type: ignore[no-untyped-call]
        F.grouped_mm(x, weight.transpose(1, 2), offs=ends)
    )
    return out


class Experts(nn.Module):
    """``n_experts`` GLU experts stored as 3-D stacks ``(E, out, in)``.

    Stacks (not a ModuleList) so an optimizer sees each weight kind as one batch of
    matrices (k3-optim orthogonalizes them together). Tokens are grouped by expert with
    one sort; the groups run as one grouped GEMM (``torch.nn.functional.grouped_mm``)
    with group ends found on the device, so no host sync (in fp32 under torch.compile,
    eagerly between two graphs: torch 2.13 traces the kernel in bf16 only). Where it does
    not apply (fp64, rows not a multiple of 16 bytes, CUDA without bf16 sm90, a torch
    without it, or ``use_grouped_mm = False``) a per-expert loop runs instead, which syncs
    once for the group sizes. Outputs are gathered back by the inverse permutation, not a
    scatter-add, so the result is deterministic on GPUs too.
    """

    use_grouped_mm: bool = True  # False forces the per-expert loop (tests, debugging)
    gather_below: int = 64
    """While decoding (:func:`decoding`), at most this many (token, expert) assignments
    gather their experts' matrices instead of grouping by expert (a step's few tokens)."""

    def __init__(self, n_experts: int, d_model: int, hidden: int, activation: str = "swiglu"):
        super().__init__()
        self.n_experts, self.activation = n_experts, activation
        # N(0, 0.02) when used alone; K3Model.reset_parameters applies the config's init.
        self.w_gate = nn.Parameter(torch.empty(n_experts, hidden, d_model).normal_(0.0, 0.02))
        self.w_up = nn.Parameter(torch.empty(n_experts, hidden, d_model).normal_(0.0, 0.02))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_model, hidden).normal_(0.0, 0.02))

    def extra_repr(self) -> str:
        e, hidden, d = self.w_gate.shape
        return f"n_experts={e}, d_model={d}, hidden={hidden}, activation={self.activation!r}"

    def grouped_mm_applies(self, x: Tensor) -> bool:
        """Whether the grouped GEMM kernel serves input ``x`` (dtype, device, row strides)."""
        if not self.use_grouped_mm or not hasattr(F, "grouped_mm"):  # public from torch 2.10
            return False
        dtype = _compute_dtype(x)
        if x.device.type == "cuda":
            if dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
                return False
        elif x.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return False
        _, hidden, d = self.w_gate.shape
        return all(n * dtype.itemsize % 16 == 0 for n in (hidden, d))

    def weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """The ``(E, out, in)`` stacks the experts compute with (an expert-parallel subclass
        returns its rank's local slices)."""
        return self.w_gate, self.w_up, self.w_down

    def forward(self, x: Tensor, experts: Tensor, gates: Tensor) -> Tensor:
        """``x`` ``(T, d)``; ``experts``/``gates`` ``(T, k)`` → ``Σ_k gate · expert(x)``."""
        return self.mix(x, experts, gates, self.weights())

    def mix(self, x: Tensor, experts: Tensor, gates: Tensor,
            stacks: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        """:meth:`forward` with the expert ids indexing ``stacks`` (``weights()`` or a
        slice of them)."""
        k = experts.shape[1]
        flat = experts.reshape(-1)
        # dynamo cannot read a ContextVar: the read would break every compiled MoE block's
        # graph here, in training too. So a compiled forward always groups (its decoding
        # steps round as the grouped kernel does); the gathered path is eager only.
        if not torch.compiler.is_compiling() and _DECODING.get() \
                and flat.numel() <= self.gather_below:
            return self._gathered(x, k, flat, gates, stacks)
        order = flat.argsort(stable=True)  # assignments grouped by expert
        xs = x[order // k]
        if self.grouped_mm_applies(x):
            y = self._grouped(xs, flat[order], stacks)
        else:
            counts = torch.bincount(flat, minlength=stacks[0].shape[0]).tolist()
            y = self._looped(xs, counts, stacks)
        y = y * gates.reshape(-1)[order].unsqueeze(1).to(y.dtype)
        # Undo the sort (a permutation: no scatter-add, so deterministic on every device)
        # and sum each token's k expert outputs.
        unsorted = torch.empty_like(y)
        unsorted[order] = y
        return unsorted.view(x.shape[0], k, unsorted.shape[-1]).sum(dim=1)  # 0 rows too

    def _gathered(self, x: Tensor, k: int, flat: Tensor, gates: Tensor,
                  stacks: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        """A few assignments (decoding): each one's expert matrices gathered and applied
        as one batched matmul, cheaper than grouping by expert for a handful of tokens."""
        w_gate, w_up, w_down = (w.index_select(0, flat) for w in stacks)  # [T·k, out, in]
        xs = x.repeat_interleave(k, dim=0).unsqueeze(-1).to(w_gate.dtype)  # [T·k, d, 1]
        h = glu(torch.bmm(w_gate, xs), torch.bmm(w_up, xs), self.activation)
        y = torch.bmm(w_down, h).squeeze(-1) * gates.reshape(-1, 1).to(w_down.dtype)
        return y.view(x.shape[0], k, -1).sum(dim=1).to(x.dtype)

    def _grouped(self, xs: Tensor, sorted_experts: Tensor,
                 stacks: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        if torch.compiler.is_compiling() and _compute_dtype(xs) != torch.bfloat16:
            # torch.compile's shape function for the grouped GEMM takes bf16 only (torch
            # 2.13): run it eagerly between two graphs rather than fall back to the
            # per-expert loop, whose data-dependent split sizes recompile every step.
            return _grouped_outside_graph(self, xs, sorted_experts, stacks)
        return self._grouped_kernel(xs, sorted_experts, stacks)

    def _grouped_kernel(self, xs: Tensor, sorted_experts: Tensor,
                        stacks: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        dtype = _compute_dtype(xs)
        w_gate, w_up, w_down = (w.to(dtype) for w in stacks)
        bounds = torch.arange(1, w_gate.shape[0] + 1, device=xs.device,
                              dtype=sorted_experts.dtype)
        ends = torch.searchsorted(sorted_experts, bounds).to(torch.int32)
        xs = xs.to(dtype)
        gate = _grouped_linear(xs, w_gate, ends)
        up = _grouped_linear(xs, w_up, ends)
        return _grouped_linear(glu(gate, up, self.activation), w_down, ends)

    def _looped(self, xs: Tensor, counts: list[int],
                stacks: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        w_gate, w_up, w_down = stacks
        parts = []
        for e, xe in enumerate(torch.split(xs, counts)):
            h = glu(F.linear(xe, w_gate[e]), F.linear(xe, w_up[e]), self.activation)
            parts.append(F.linear(h, w_down[e]))
        return torch.cat(parts)


Stacks = tuple[Tensor, Tensor, Tensor]


def _grouped_eagerly(experts: Experts, xs: Tensor, sorted_experts: Tensor,
                     stacks: Stacks) -> Tensor:
    return experts._grouped_kernel(xs, sorted_experts, stacks)


# A graph break: dynamo runs this between two compiled graphs, as plain eager code.
_grouped_outside_graph: Callable[[Experts, Tensor, Tensor, Stacks], Tensor] = (
    torch.compiler.disable(_grouped_eagerly))  # type: ignore[no-untyped-call]


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` runs in: autocast's when it is on, else ``x``'s."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


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
    """A (latent) MoE MLP layer: ``router``, ``balancer``, ``experts``, optional
    ``down_proj``/``latent_norm``/``up_proj`` (LatentMoE) and ``shared``.

    Set ``collect_stats = True`` to accumulate routing statistics over training forwards
    (no host sync); :meth:`pop_stats` returns them and starts a new window.
    """

    collect_stats: bool = False

    def __init__(self, config: K3Config):
        super().__init__()
        self.top_k = config.moe_top_k
        self.routed_scaling = config.routed_scaling
        d, latent = config.d_model, config.moe_latent_dim
        self.router = Router(d, config.n_experts)
        self.balancer = QuantileBalancer(
            config.n_experts,
            config.moe_top_k,
            enabled=config.moe_balance,
            rate=config.moe_balance_rate,
        )
        self.down_proj = nn.Linear(d, latent, bias=False) if latent else None
        self.experts = Experts(config.n_experts, config.moe_width, config.moe_d_ff,
                               config.activation)
        self.latent_norm = RMSNorm(latent, config.norm_eps) if latent else None
        self.up_proj = nn.Linear(latent, d, bias=False) if latent else None
        shared = config.n_shared_experts * config.moe_d_ff
        self.shared = GatedMLP(d, shared, config.activation) if shared else None
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
        if self.collect_stats and self.training and not recomputing():
            self._record(experts)
        if self.down_proj is not None:
            routed = self.experts(self.down_proj(x), experts, gates)
            out: Tensor = self.up_proj(self.latent_norm(routed))  # type: ignore[misc]
        else:
            out = self.experts(x, experts, gates)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(shape)

    @torch.no_grad()
    def _record(self, experts: Tensor) -> None:
        counts = expert_counts(experts.reshape(-1), self.experts.n_experts)
        self._stat_tokens = counts if self._stat_tokens is None else self._stat_tokens + counts
        self._stat_forwards += 1

    def pop_stats(self) -> RoutingStats | None:
        """Statistics since the last call (None if no training forward collected any)."""
        if self._stat_tokens is None:
            return None
        stats = RoutingStats(self._stat_tokens, self._stat_forwards, self.balancer.bias.clone())
        self._stat_tokens, self._stat_forwards = None, 0
        return stats
