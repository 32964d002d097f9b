"""QuantileBalancer: top-k expert selection with a per-expert bias solved by quantiles.

Aux-loss-free balancing (DeepSeek-V3 style) nudges a per-expert selection bias ``b`` by a
fixed step toward equal load. Quantile balancing solves for it instead. With sigmoid
scores ``s`` (fp32) and biased scores ``s + b``, each token's cutoff is its (k+1)-th
biased score, so token t would pick expert e iff ``b_e ≥ cutoff_t − s_te``: ``r_te =
cutoff_t − s_te`` is the bias expert e *requires* to win token t. Expert e receives its
fair share ``k·T/E`` of the T tokens exactly when ``b_e`` is the ``(k/E)``-quantile of
``r_e`` over tokens. The new bias is that quantile, mean-centred (adding a constant to
every bias changes no selection), then blended with the old one by ``rate``.

Only the selection uses the bias; gate weights come from the unbiased scores. The update
runs under ``no_grad`` on every training forward, never in eval: the buffers are model
state, saved in the state dict, and a skipped optimizer step does not roll them back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .activation_checkpointing import record_choice, replay_choice, tape_mode


def expert_counts(flat: Tensor, n_experts: int) -> Tensor:
    """Assignments per expert, ``(E,)`` int64, without a host sync (``bincount`` sizes its
    output from the data's max on CUDA, which syncs): a sort and a binary search."""
    ordered = flat.sort().values
    bounds = torch.arange(n_experts + 1, device=flat.device, dtype=ordered.dtype)
    return torch.searchsorted(ordered, bounds).diff()


def quantile_bias(scores: Tensor, cutoff: Tensor, top_k: int) -> Tensor:
    """The mean-centred per-expert bias that gives each expert ``k·T/E`` of the tokens.

    ``scores``: ``(T, E)`` unbiased router scores; ``cutoff``: ``(T,)`` each token's
    (k+1)-th biased score under the current bias. Returns ``(E,)`` in ``scores.dtype``.
    Between two order statistics the midpoint is taken, so the boundary token is not a
    tie. Computed with a sort over tokens (no ``torch.quantile`` size limit).
    """
    t, e = scores.shape
    if t == 0:  # no token, nothing to balance
        return torch.zeros(e, dtype=scores.dtype, device=scores.device)
    required = cutoff.unsqueeze(1) - scores  # (T, E): bias expert e needs to win token t
    ordered = required.sort(dim=0).values
    # #{t : r_te ≤ b_e} = k·T/E  ⇒  b_e sits between order statistics c-1 and c (0-based).
    position = min(max(top_k * t / e - 0.5, 0.0), t - 1.0)
    lo = int(position)
    hi = min(lo + 1, t - 1)
    frac = position - lo
    bias = ordered[lo] * (1.0 - frac) + ordered[hi] * frac
    return bias - bias.mean()


class QuantileBalancer(nn.Module):
    """Selects each token's top-k experts on ``scores + bias`` and balances the bias.

    Buffers (state dict): ``bias`` ``(E,)`` fp32 selection bias; ``load`` ``(E,)`` int64
    tokens routed to each expert by the last training forward; ``updates`` () int64
    training forwards seen. With ``enabled=False`` the bias stays zero (plain top-k) while
    ``load`` and ``updates`` still record. ``rate`` in (0, 1] blends the solved bias into
    the old one (``b ← b + rate·(b_new − b)``; 1 replaces it).

    ``token_gather`` (a plain attribute, not state; None by default): under data
    parallelism, ``token_gather(t)`` returns every rank's rows of ``t`` concatenated in
    rank order, and each update solves the bias from the whole global batch's tokens, so
    the biases stay identical on every rank and equal one process's with the same global
    batch. :meth:`k3_model.K3Model.set_balancer_gather` sets it on every balancer.
    """

    bias: Tensor
    load: Tensor
    updates: Tensor

    def __init__(self, n_experts: int, top_k: int, *, enabled: bool = True, rate: float = 1.0):
        super().__init__()
        if not 1 <= top_k < n_experts:
            raise ValueError(
                f"QuantileBalancer: top_k ({top_k}) must be in [1, n_experts) = [1, {n_experts})"
            )
        if not 0 < rate <= 1:
            raise ValueError(f"QuantileBalancer: rate must be in (0, 1], got {rate}")
        self.n_experts, self.top_k = n_experts, top_k
        self.enabled, self.rate = enabled, rate
        self.token_gather: Callable[[Tensor], Tensor] | None = None
        self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float32))
        self.register_buffer("load", torch.zeros(n_experts, dtype=torch.int64))
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))

    def forward(self, scores: Tensor) -> Tensor:
        """Indices ``(T, k)`` of each token's experts for ``scores`` ``(T, E)``.

        In training mode this also updates the buffers (after selecting: the new bias
        serves the next forward). Inside an activation-checkpointed block the choice is
        recorded, and its recomputation replays it without updating again
        (:mod:`k3_model.activation_checkpointing`).
        """
        mode = tape_mode()
        if mode == "replay":
            return replay_choice()
        biased = scores.detach() + self.bias.to(scores.dtype)
        top = biased.topk(self.top_k + 1, dim=-1)  # top-(k+1): the extra one is the cutoff
        chosen = top.indices[:, : self.top_k]
        if self.training:
            self._update(scores.detach(), top.values[:, self.top_k], chosen)
        if mode == "record":
            record_choice(chosen)
        return chosen

    @torch.no_grad()
    def _update(self, scores: Tensor, cutoff: Tensor, chosen: Tensor) -> None:
        gather = self.token_gather
        if gather is not None:  # data parallel: every rank's tokens, in rank order
            scores, cutoff, chosen = (gather(t) for t in (scores, cutoff, chosen))
        self.load.copy_(expert_counts(chosen.reshape(-1), self.n_experts))
        self.updates.add_(1)
        if self.enabled:
            solved = quantile_bias(scores.float(), cutoff.float(), self.top_k)
            self.bias.lerp_(solved.to(self.bias.dtype), self.rate)

    def extra_repr(self) -> str:
        return (
            f"n_experts={self.n_experts}, top_k={self.top_k}, enabled={self.enabled}, "
            f"rate={self.rate}"
        )
