"""Distributed Muon: each full matrix is orthogonalized exactly once across the ranks.

Under FSDP2 (``fully_shard``) a Muon parameter is a DTensor sharded by rows
(``Shard(0)``), so no rank holds a whole matrix; under DDP every rank holds all of them
and would run every Newton–Schulz iteration N times. Here each matrix gets one owner
rank (greedy by Newton–Schulz cost, so the owners' work is balanced); one all-to-all
brings each owner its matrices' shards of the momentum update, each owner runs the
batched Newton–Schulz on what it owns, and a second all-to-all returns to every rank
its rows of every orthogonalized update (all of them for a replicated parameter).
Momentum, weight decay and the update add stay elementwise on the local shards.

A stack of matrices split only along its leading (batch) dimension, as expert
parallelism and FSDP2 split an MoE layer's ``(E, out, in)`` expert stacks, needs no
exchange: every rank already holds whole matrices, so it orthogonalizes its own
(:func:`batch_sharded`). Where such a stack is also replicated over one mesh dimension
(expert-parallel slices held by several replicas), the replicas share the work through
the same owner exchange, over that dimension's group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

try:  # torch builds without distributed support have no DTensor
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

from .muon import ns_cost


@dataclass(frozen=True)
class Layout:
    """Where a parameter's rows live: ``rows[r]`` is rank r's ``(start, end)`` of dim 0,
    or ``rows is None`` when every rank holds the whole tensor (DDP, ``Replicate()``)."""

    shape: tuple[int, ...]
    rows: tuple[tuple[int, int], ...] | None

    def local_shape(self, rank: int) -> tuple[int, ...]:
        if self.rows is None:
            return self.shape
        start, end = self.rows[rank]
        return (end - start, *self.shape[1:])


def is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard (same storage), else ``t``."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def rows_state_like(p: torch.Tensor, shape: tuple[int, ...], local_shape: tuple[int, ...], *,
                    dtype: torch.dtype) -> torch.Tensor:
    """Zeros of ``shape`` for per-row optimizer state of ``p`` (NorMuon's), placed like
    ``p``: a DTensor with ``p``'s mesh and placements (its dim 0 is ``p``'s dim 0, so
    ``Shard(0)`` splits it as it splits ``p``), whose local piece has ``local_shape``."""
    zeros = torch.zeros(local_shape if is_dtensor(p) else shape, dtype=dtype, device=p.device)
    if not is_dtensor(p):
        return zeros
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(zeros, p.device_mesh, p.placements,  # type: ignore[attr-defined]
                              run_check=False, shape=torch.Size(shape), stride=strides)


def chunk_rows(n: int, world: int) -> tuple[tuple[int, int], ...]:
    """Row ranges of ``Shard(0)`` over ``world`` ranks (torch.chunk: ⌈n/world⌉ rows each)."""
    size = -(-n // world)
    return tuple((min(r * size, n), min((r + 1) * size, n)) for r in range(world))


def dtensor_layout(p: torch.Tensor, name: str) -> tuple[Any, Layout]:
    """The process group and row layout of a DTensor parameter (1-D mesh, Shard(0) or
    Replicate, as ``fully_shard`` makes them); anything else raises ``ValueError``."""
    mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
    if mesh.ndim != 1:
        raise ValueError(
            f"distributed Muon supports DTensor parameters on a 1-D device mesh "
            f"(fully_shard over one data-parallel dimension); {name} has a {mesh.ndim}-D mesh"
        )
    placement = placements[0]
    shape = tuple(p.shape)
    if isinstance(placement, Replicate):
        return mesh.get_group(), Layout(shape, None)
    if isinstance(placement, Shard) and placement.dim == 0:
        return mesh.get_group(), Layout(shape, chunk_rows(shape[0], mesh.size()))
    raise ValueError(
        f"distributed Muon needs parameters sharded by rows (Shard(0), fully_shard's "
        f"default) or replicated; {name} has placement {placement}: drop the custom "
        "shard_placement_fn for Muon parameters"
    )


def batch_sharded(p: torch.Tensor, *, flatten: bool = False) -> bool:
    """Whether ``p`` is a DTensor stack of matrices (3-D or more, not ``flatten``ed) placed
    ``Shard(0)`` on some mesh dimension and ``Replicate()`` on the others: each rank's
    local piece is then whole matrices (its experts)."""
    if not is_dtensor(p) or p.ndim < 3 or flatten:
        return False
    placements = p.placements  # type: ignore[attr-defined]
    sharded = [isinstance(q, Shard) and q.dim == 0 for q in placements]
    return any(sharded) and all(s or isinstance(q, Replicate)
                                for s, q in zip(sharded, placements))


def resolve_batch_comm(params: Sequence[torch.Tensor], names: Sequence[str], *,
                       where: str) -> tuple[Any, list[Layout]] | None:
    """The replica group and (replicated) layouts of :func:`batch_sharded` parameters on
    one mesh, or None when no mesh dimension replicates them (each rank orthogonalizes
    its own matrices). Raises ``ValueError`` for meshes that replicate over more than one
    dimension."""
    mesh = params[0].device_mesh  # type: ignore[attr-defined]
    for p, name in zip(params, names):
        if p.device_mesh != mesh or p.placements != params[0].placements:  # type: ignore[attr-defined]
            raise ValueError(f"{where}: batch-sharded Muon parameters on different meshes or "
                             f"placements ({name}); put each layout in its own param group")
    replicated = [d for d, q in enumerate(params[0].placements)  # type: ignore[attr-defined]
                  if isinstance(q, Replicate) and mesh.size(d) > 1]
    if not replicated:
        return None
    if len(replicated) > 1:
        raise ValueError(f"{where}: {names[0]} is replicated over {len(replicated)} mesh "
                         "dimensions; distributed Muon supports one")
    return mesh.get_group(replicated[0]), [Layout(tuple(local(p).shape), None) for p in params]


def resolve_comm(
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    *,
    where: str,
    distributed: bool | None,
    process_group: Any,
) -> tuple[Any, list[Layout]] | None:
    """The process group and row layouts for distributed Muon over ``params``, or None
    when Newton–Schulz runs locally (one process, or plain tensors without
    ``distributed=True``). Raises ``ValueError`` for layouts it cannot handle."""
    sharded = [is_dtensor(p) for p in params]
    if any(sharded):
        if not all(sharded):
            raise ValueError(f"{where} mixes DTensor and plain Muon parameters: shard every "
                             "Muon parameter (fully_shard the root module too) or none of them")
        if distributed is False:
            raise ValueError(f"{where} holds DTensor (sharded) parameters, which need "
                             "distributed Muon: leave MuonAdamW(distributed=None)")
        comms = [dtensor_layout(p, name) for p, name in zip(params, names)]
        if len({id(group) for group, _ in comms}) != 1:
            raise ValueError(f"{where}: Muon parameters on different device meshes; put each "
                             "mesh's parameters in its own param group")
        for p, name in zip(params, names):
            placements = p.placements  # type: ignore[attr-defined]
            grad_placements = getattr(p.grad, "placements", None)
            if grad_placements != placements:
                raise ValueError(f"{where}: the gradient of {name} is placed as "
                                 f"{grad_placements}, the parameter as {placements}")
        group = comms[0][0]
        layouts = [layout for _, layout in comms]
    elif distributed and params:
        group = process_group if process_group is not None else dist.group.WORLD
        layouts = [Layout(tuple(p.shape), None) for p in params]
    else:
        return None
    return None if dist.get_world_size(group) == 1 else (group, layouts)


def assign_owners(costs: Sequence[int], loads: list[float]) -> list[int]:
    """Give each matrix to the least-loaded rank, largest first (deterministic, so every
    rank computes the same plan); ``loads`` carries over between calls of one step."""
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(len(loads)), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += costs[i]
    return owners


def distributed_orthogonalize(
    updates: list[torch.Tensor],
    views: Sequence[tuple[int, int, int]],
    layouts: Sequence[Layout],
    *,
    group: Any,
    loads: list[float],
    orthogonalize: Callable[[list[torch.Tensor], list[tuple[int, int, int]]], list[torch.Tensor]],
) -> list[torch.Tensor]:
    """Orthogonalize local ``updates`` (shards or replicas) with one owner per matrix.

    ``orthogonalize(full_updates, views)`` is the batched single-process Newton–Schulz;
    it runs on each owner for the matrices it owns. Returns this rank's part of every
    orthogonalized update, shaped like ``updates``. Every rank must call this with the
    same parameters, views and layouts (true under FSDP2 and DDP, where gradients are
    reduced before the step).
    """
    rank = dist.get_rank(group)
    for i, (u, layout) in enumerate(zip(updates, layouts)):
        if tuple(u.shape) != layout.local_shape(rank):
            raise RuntimeError(
                f"distributed Muon: rank {rank} holds a {tuple(u.shape)} piece of matrix {i} "
                f"{layout.shape}, expected {layout.local_shape(rank)} (torch.chunk rows)"
            )
    owners = assign_owners([ns_cost(v) for v in views], loads)
    result: list[torch.Tensor] = list(updates)
    # One exchange per dtype (usually one): all_to_all moves a single flat buffer.
    for dtype in sorted({u.dtype for u in updates}, key=str):
        plan = _Plan(updates, layouts, owners, [i for i, u in enumerate(updates)
                                                 if u.dtype == dtype], group, rank)
        mine = plan.owned_by(rank)
        full = plan.gather_to_owners()  # a collective: every rank takes part, owner or not
        ortho = orthogonalize(full, [views[i] for i in mine]) if mine else []
        for i, o in zip(plan.idx, plan.scatter_from_owners(dict(zip(mine, ortho)))):
            result[i] = o
    return result


@dataclass
class _Plan:
    """Who sends which rows where, for the matrices ``idx`` (one dtype)."""

    updates: Sequence[torch.Tensor]
    layouts: Sequence[Layout]
    owners: Sequence[int]
    idx: list[int]
    group: Any
    rank: int

    @property
    def world(self) -> int:
        return int(dist.get_world_size(self.group))

    def owned_by(self, rank: int, *, sharded_only: bool = False) -> list[int]:
        return [i for i in self.idx if self.owners[i] == rank
                and not (sharded_only and self.layouts[i].rows is None)]

    def gather_to_owners(self) -> list[torch.Tensor]:
        """The full update of each matrix this rank owns (shards of sharded ones gathered)."""
        mine = self.owned_by(self.rank)
        if all(self.layouts[i].rows is None for i in self.idx):
            return [self.updates[i] for i in mine]  # replicated: the owner has it all
        ranks = range(self.world)
        sends = [[self.updates[i] for i in self.owned_by(dest, sharded_only=True)]
                 for dest in ranks]
        mine_sharded = self.owned_by(self.rank, sharded_only=True)
        received = self._all_to_all(
            sends, [[self.layouts[i].local_shape(src) for i in mine_sharded] for src in ranks])
        full = {i: torch.cat([received[src][k] for src in ranks])
                for k, i in enumerate(mine_sharded)}
        return [full.get(i, self.updates[i]) for i in mine]

    def scatter_from_owners(self, ortho: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """This rank's rows of every orthogonalized update in ``idx``, from their owners."""

        def rows_for(i: int, dest: int) -> torch.Tensor:
            rows = self.layouts[i].rows
            return ortho[i] if rows is None else ortho[i][rows[dest][0]:rows[dest][1]]

        ranks = range(self.world)
        mine = self.owned_by(self.rank)
        received = self._all_to_all(
            [[rows_for(i, dest) for i in mine] for dest in ranks],
            [[self.layouts[i].local_shape(self.rank) for i in self.owned_by(src)]
             for src in ranks])
        by_src = {src: iter(received[src]) for src in ranks}
        return [next(by_src[self.owners[i]]) for i in self.idx]

    def _all_to_all(self, sends: list[list[torch.Tensor]],
                    recv_shapes: list[list[tuple[int, ...]]]) -> list[list[torch.Tensor]]:
        """Send ``sends[dest]`` to each rank in one flat all_to_all; return the received
        tensors per source rank, shaped by ``recv_shapes[src]``."""
        like = self.updates[self.idx[0]]
        flat = [t.reshape(-1) for dest in sends for t in dest]
        send = torch.cat(flat) if flat else like.new_empty(0)
        in_splits = [sum(t.numel() for t in dest) for dest in sends]
        numels = [[math.prod(s) for s in shapes] for shapes in recv_shapes]
        out_splits = [sum(n) for n in numels]
        out = like.new_empty(sum(out_splits))
        dist.all_to_all_single(out, send, out_splits, in_splits, group=self.group)
        return [[t.view(s) for t, s in zip(torch.split(chunk, sizes), shapes)]
                for chunk, shapes, sizes in zip(torch.split(out, out_splits), recv_shapes,
                                                numels)]
