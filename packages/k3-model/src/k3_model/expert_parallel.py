"""Expert parallelism: each rank of an expert group holds a contiguous slice of every MoE
layer's routed experts, and the tokens travel to the experts they were routed to.

The experts live on a :class:`~torch.distributed.device_mesh.DeviceMesh` whose last
dimension is the expert group (``N`` ranks) and whose other dimension, if any, holds the
replicas of each slice (world = replicas × N, torchtitan's EP folded into data
parallelism; under pipeline stages the mesh spans one stage's ranks, world = stages ×
replicas × N). Rank r of an expert group holds experts ``[r·E/N, (r+1)·E/N)``: each
stack is a DTensor of the global shape ``(E, out, in)``, ``Shard(0)`` over the expert
group and ``Replicate()`` over the replicas, so a checkpoint keys every expert by its
global index and torch's distributed checkpoint reshards it to any other layout.

Per MoE layer and forward, the (token, expert) assignments are sorted by expert, so the
rows bound for each rank are contiguous; one ``all_to_all_single`` sends them there, with
split sizes from the router's counts; the receiving rank runs its local experts on them
(the same :class:`~k3_model.moe.Experts` code, grouped GEMM included) and a second
``all_to_all_single`` sends the outputs back, where they are weighted by the gates and
summed per token exactly as in the one-process layer. Each exchange's backward is the
same exchange in reverse (:class:`_Exchange`, on ``torch.distributed``'s public
``all_to_all_single``), so each local expert's gradient sums the expert group's tokens;
:func:`reduce_gradients` adds the replicas' and divides by the mesh's size (the world, or
the stage's ranks), which makes it the data-parallel mean the other parameters get. No
token is dropped: there is no capacity factor, every assignment is computed.

The split sizes are the only host reads dispatch adds: one read of the per-expert counts
each rank receives, per MoE layer per forward. The router, the balancer and the shared
experts stay data-parallel; the balancer must see the global batch
(:meth:`~k3_model.K3Model.set_balancer_gather`), so every rank routes alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .moe import Experts, MoE

_STACKS = ("w_gate", "w_up", "w_down")


class _Exchange(torch.autograd.Function):
    """``all_to_all_single`` of rows: ``send[r]`` rows to rank r, ``receive[r]`` from it;
    the backward sends the gradient rows back the way they came. Bytes sent to other
    ranks, both ways, are added to ``meter.moved_bytes``."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, send: list[int], receive: list[int],
                meter: ShardedExperts) -> Tensor:
        ctx.send, ctx.receive, ctx.meter = send, receive, meter
        out = rows.new_empty(sum(receive), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), receive, send, group=meter.group)
        meter.count(rows, send)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.receive,
                               group=ctx.meter.group)
        ctx.meter.count(grad, ctx.receive)
        return back, None, None, None


class ShardedExperts(Experts):
    """This rank's slice of an :class:`Experts` stack, and the two exchanges around it.

    ``forward(x, experts, gates)`` takes the same arguments as ``Experts.forward`` (global
    expert ids) and returns the same value; every rank of the expert group must call it,
    in the same order, for each MoE layer. ``w_gate``/``w_up``/``w_down`` are DTensors of
    the global shape; this rank computes with experts ``first .. first + per_rank − 1``.
    ``moved_bytes`` counts the bytes this rank sent to other ranks (forward and backward)
    since :func:`pop_moved_bytes` last read it.
    """

    def __init__(self, experts: Experts, mesh: DeviceMesh) -> None:
        nn.Module.__init__(self)  # the stacks are this rank's slices, not new full ones
        self.activation, self.use_grouped_mm = experts.activation, experts.use_grouped_mm
        self.mesh = mesh
        ep = mesh.ndim - 1
        self.group = mesh.get_group(ep)
        self.size, self.rank = mesh.size(ep), mesh.get_local_rank(ep)
        total = experts.n_experts
        if total % self.size:
            raise ValueError(f"expert parallelism over {self.size} ranks needs a number of "
                             f"experts divisible by {self.size}, got {total}")
        self.n_experts, self.per_rank = total, total // self.size
        self.first = self.rank * self.per_rank
        placements = [Replicate()] * ep + [Shard(0)]
        rows = slice(self.first, self.first + self.per_rank)
        for name in _STACKS:
            part = getattr(experts, name).detach()[rows].clone()
            setattr(self, name, nn.Parameter(
                DTensor.from_local(part, mesh, placements, run_check=False)))
        self.moved_bytes = 0

    def extra_repr(self) -> str:
        last = self.first + self.per_rank - 1
        return (f"experts {self.first}..{last} of {self.n_experts}, "
                f"expert group of {self.size}, {self.mesh.size() // self.size} replica(s)")

    def weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's local expert slices (autograd flows back into the DTensors)."""
        w_gate, w_up, w_down = (getattr(self, name).to_local() for name in _STACKS)
        return w_gate, w_up, w_down

    def count(self, rows: Tensor, splits: list[int]) -> None:
        """Add the bytes of ``rows`` that went to other ranks (``splits`` per rank), in
        training (evaluation's exchanges are not a training step's traffic)."""
        if not self.training:
            return
        others = sum(splits) - splits[self.rank]
        self.moved_bytes += others * rows.shape[1:].numel() * rows.element_size()

    # Eager between compiled graphs: the split sizes are host values by design.
    @torch.compiler.disable  # type: ignore[untyped-decorator]
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
        send, per_source = sizes[: self.size], sizes[self.size:]
        receive = [sum(per_source[r * self.per_rank:(r + 1) * self.per_rank])
                   for r in range(self.size)]
        arrived = _exchange(rows, send, receive, self)
        ids = torch.arange(self.per_rank, device=x.device).repeat(self.size)
        local_ids = ids.repeat_interleave(incoming)  # each arrived row's local expert
        unit = torch.ones(local_ids.shape[0], 1, dtype=gates.dtype, device=x.device)
        done = self.mix(arrived, local_ids.unsqueeze(1), unit, self.weights())
        returned = _exchange(done, receive, send, self)
        weighted = returned * gates.reshape(-1)[order].unsqueeze(1).to(returned.dtype)
        unsorted = torch.empty_like(weighted)
        unsorted[order] = weighted
        return unsorted.view(x.shape[0], k, unsorted.shape[-1]).sum(dim=1)


def _exchange(rows: Tensor, send: list[int], receive: list[int],
              meter: ShardedExperts) -> Tensor:
    out: Tensor = _Exchange.apply(rows, send, receive, meter)  # type: ignore[no-untyped-call]
    return out


def expert_mesh(world_size: int, expert_parallel: int, device_type: str,
                stages: int = 1) -> DeviceMesh:
    """The ``(replicas, N)`` mesh (dims ``"ep_replicate"``, ``"ep"``) of this rank's experts:
    consecutive ranks form an expert group, so on a multi-GPU node the all-to-alls stay
    inside the node. With ``stages`` pipeline stages (``world = stages × ranks per stage``,
    each stage's ranks consecutive, the stage outermost) it spans this rank's stage only:
    each stage holds other layers, whose experts meet no other stage's."""
    from torch.distributed.device_mesh import init_device_mesh

    if stages < 1 or world_size % stages:
        raise ValueError(f"{stages} pipeline stages need a world size divisible by them, "
                         f"got {world_size}")
    per_stage = world_size // stages
    if expert_parallel < 1 or per_stage % expert_parallel:
        raise ValueError(f"expert parallelism of {expert_parallel} needs "
                         + (f"a world size divisible by it, got {world_size}" if stages == 1
                            else f"each stage's {per_stage} ranks divisible by it"))
    names = ("ep_replicate", "ep")
    if stages == 1:
        return init_device_mesh(device_type, (per_stage // expert_parallel, expert_parallel),
                                mesh_dim_names=names)
    mesh = init_device_mesh(device_type, (stages, per_stage // expert_parallel,
                                          expert_parallel),
                            mesh_dim_names=("pp", *names))
    return mesh[names]


def shard_experts(model: nn.Module, mesh: DeviceMesh) -> int:
    """Replace every MoE layer's routed experts in ``model`` by this rank's
    :class:`ShardedExperts` slice on ``mesh`` (in place; call it on identically
    initialized replicas, before wrapping the model for data parallelism, with
    :func:`expert_parameters` kept out of that wrapping). Returns the number of layers."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        layer.experts = ShardedExperts(layer.experts, mesh)
    return len(layers)


def sharded_experts(model: nn.Module) -> list[ShardedExperts]:
    return [m for m in model.modules() if isinstance(m, ShardedExperts)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel parameters of ``model`` (to keep out of FSDP2 or DDP)."""
    return [p for m in sharded_experts(model) for p in m.parameters(recurse=False)]


@torch.no_grad()
def reduce_gradients(model: nn.Module) -> None:
    """Turn every expert gradient into the data-parallel mean: sum over the replicas of
    its slice (one all-reduce of all of them) and divide by the mesh's size (every rank
    holding these layers), as FSDP2 and DDP average the other parameters. Call once per
    update, after the last backward and before unscaling, clipping or stepping."""
    layers = sharded_experts(model)
    grads: list[Tensor] = [p.grad.to_local()  # type: ignore[attr-defined]
                           for m in layers for p in m.parameters(recurse=False)
                           if p.grad is not None]
    if not grads:
        return
    mesh = layers[0].mesh
    if mesh.ndim > 1 and mesh.size(0) > 1:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=mesh.get_group(0))
        for g, part in zip(grads, torch.split(flat, [g.numel() for g in grads])):
            g.copy_(part.view_as(g))
    for g in grads:
        g.div_(mesh.size())


def pop_moved_bytes(model: nn.Module) -> int:
    """Bytes this rank's expert exchanges sent to other ranks since the last call."""
    total = 0
    for m in sharded_experts(model):
        total, m.moved_bytes = total + m.moved_bytes, 0
    return total


__all__ = ["ShardedExperts", "expert_mesh", "expert_parameters", "pop_moved_bytes",
           "reduce_gradients", "shard_experts", "sharded_experts"]
