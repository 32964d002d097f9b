"""Expert parallelism: each rank of a process group holds a contiguous slice of every MoE
layer's routed experts, and the tokens travel to the experts they were routed to.

Rank r of an ``N``-rank expert group holds experts ``[r·E/N, (r+1)·E/N)``. Per MoE layer
and forward, the (token, expert) assignments are sorted by expert, so the rows bound for
each rank are contiguous; one ``all_to_all_single`` sends them there, with split sizes
from the router's counts; the receiving rank runs its local experts on them (the same
:class:`~k3_model.moe.Experts` code, grouped GEMM included) and a second
``all_to_all_single`` sends the outputs back, where they are weighted by the gates and
summed per token exactly as in the one-process layer. Each exchange's backward is the
same exchange in reverse (:class:`_Exchange`, on ``torch.distributed``'s public
``all_to_all_single``), so each local expert's gradient sums every rank's tokens (no
further reduction over the expert group).

The split sizes are the only host reads dispatch adds: one read of the per-expert counts
each rank receives, per MoE layer per forward. The router, the balancer and the shared
experts stay replicated; the balancer must see the global batch
(:meth:`~k3_model.K3Model.set_balancer_gather`), so every rank routes alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .moe import Experts, MoE


class _Exchange(torch.autograd.Function):
    """``all_to_all_single`` of rows: ``send[r]`` rows to rank r, ``receive[r]`` from it;
    the backward sends the gradient rows back the way they came."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, send: list[int], receive: list[int],
                group: dist.ProcessGroup | None) -> Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = rows.new_empty(sum(receive), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return back, None, None, None


def _exchange(rows: Tensor, send: list[int], receive: list[int],
              group: dist.ProcessGroup | None) -> Tensor:
    out: Tensor = _Exchange.apply(rows, send, receive, group)  # type: ignore[no-untyped-call]
    return out


class ShardedExperts(nn.Module):
    """This rank's slice of an :class:`Experts` stack, and the two exchanges around it.

    ``forward(x, experts, gates)`` takes the same arguments as ``Experts.forward`` (global
    expert ids) and returns the same value; every rank of ``group`` must call it, in the
    same order, for each MoE layer. ``local`` holds experts ``first .. first + local − 1``
    (parameters ``local.w_gate``/``w_up``/``w_down``).
    """

    def __init__(self, experts: Experts, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self.size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        total = experts.n_experts
        if total % self.size:
            raise ValueError(f"expert parallelism over {self.size} ranks needs a number of "
                             f"experts divisible by {self.size}, got {total}")
        self.n_experts, self.per_rank = total, total // self.size
        self.first = rank * self.per_rank
        _, hidden, width = experts.w_gate.shape
        self.local = Experts(self.per_rank, width, hidden, experts.activation).to(
            dtype=experts.w_gate.dtype, device=experts.w_gate.device)
        self.local.use_grouped_mm = experts.use_grouped_mm
        rows = slice(self.first, self.first + self.per_rank)
        with torch.no_grad():
            for name in ("w_gate", "w_up", "w_down"):
                getattr(self.local, name).copy_(getattr(experts, name)[rows])

    def extra_repr(self) -> str:
        last = self.first + self.per_rank - 1
        return f"experts {self.first}..{last} of {self.n_experts}, ranks={self.size}"

    def forward(self, x: Tensor, experts: Tensor, gates: Tensor) -> Tensor:
        """``x`` ``(T, d)``; ``experts``/``gates`` ``(T, k)`` → ``Σ_k gate · expert(x)``."""
        k = experts.shape[1]
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # assignments grouped by expert, so by rank
        rows = x[order // k]
        counts = torch.bincount(flat, minlength=self.n_experts)
        # What each rank gets from every rank, per local expert: [source rank, local expert].
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=self.group)
        sent = counts.view(self.size, self.per_rank).sum(1)
        sizes = torch.cat([sent, incoming]).tolist()  # the dispatch's one host read
        send, per_source = sizes[: self.size], sizes[self.size :]
        receive = [sum(per_source[r * self.per_rank:(r + 1) * self.per_rank])
                   for r in range(self.size)]
        arrived = _exchange(rows, send, receive, self.group)
        ids = torch.arange(self.per_rank, device=x.device).repeat(self.size)
        local_ids = ids.repeat_interleave(incoming)  # each arrived row's local expert
        unit = torch.ones(local_ids.shape[0], 1, dtype=gates.dtype, device=x.device)
        done = self.local(arrived, local_ids.unsqueeze(1), unit)  # each row: its expert
        returned = _exchange(done, receive, send, self.group)
        weighted = returned * gates.reshape(-1)[order].unsqueeze(1).to(returned.dtype)
        unsorted = torch.empty_like(weighted)
        unsorted[order] = weighted
        return unsorted.view(x.shape[0], k, unsorted.shape[-1]).sum(dim=1)


def shard_experts(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Replace every MoE layer's routed experts in ``model`` by this rank's
    :class:`ShardedExperts` slice (in place; call it on identically initialized replicas,
    before wrapping the model for data parallelism). Returns the number of layers."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        layer.experts = ShardedExperts(layer.experts, group)  # type: ignore[assignment]
    return len(layers)


__all__ = ["ShardedExperts", "shard_experts"]
