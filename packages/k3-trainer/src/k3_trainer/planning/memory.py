"""Model-state bytes per rank: parameters, gradients and MuonAdamW's state, exactly as
the trainer allocates them.

Each non-expert parameter is FSDP2-sharded over ``dp·cp`` ranks along its first
dimension as ``torch.chunk`` splits it (rank 0 gets ``⌈rows/n⌉`` rows: the most loaded
rank); routed-expert stacks ``(E, out, in)`` are split ``ep`` ways by expert and kept
whole on each of their ``dp·cp/ep`` replicas (without expert parallelism they are
sharded like the rest). With ``sharding="zero1"`` parameters and
gradients stay replicated and only the optimizer state (and the fp32 master) is
sharded. Per parameter and element, by ``precision``:

| precision     | parameter | gradient | optimizer state                                  |
|---------------|-----------|----------|--------------------------------------------------|
| fp32, bf16    | 4         | 4        | Muon: 4 (momentum); AdamW: 8 (two moments)       |
| bf16-master   | 2         | 4        | the same + 4 (fp32 master)                       |

``bf16`` is K3 Train's mixed precision (fp32 parameters, bf16 autocast);
``bf16-master`` the large-scale recipe (bf16 weights, fp32 master in the optimizer).
Every AdamW tensor also has a 4-byte ``step`` counter, and NorMuon an fp32 EMA per row
(a parameter ``(…, rows, cols)`` keeps ``numel/cols`` values).
"""

from __future__ import annotations

from dataclasses import dataclass

from .inventory import Inventory, Parameter

PRECISIONS = ("fp32", "bf16", "bf16-master")
SHARDINGS = ("fsdp", "zero1")


@dataclass(frozen=True)
class StateBytes:
    params: int = 0
    grads: int = 0
    optimizer: int = 0

    def __add__(self, other: StateBytes) -> StateBytes:
        return StateBytes(self.params + other.params, self.grads + other.grads,
                          self.optimizer + other.optimizer)


def chunk_rows(rows: int, ranks: int, rank: int = 0) -> int:
    """Rows of ``rank``'s piece when ``torch.chunk`` splits ``rows`` over ``ranks``."""
    size = -(-rows // ranks)
    return max(0, min(rows, size * (rank + 1)) - min(rows, size * rank))


def local_numel(p: Parameter, *, shard: int, ep: int, rank: int = 0) -> int:
    """Elements of ``p`` on FSDP rank ``rank`` of ``shard`` (expert stacks: ``E/ep``)."""
    rows = p.shape[0] if p.shape else 1
    per_row = p.numel // rows if rows else 0
    if p.expert and ep > 1:
        return rows // ep * per_row
    return chunk_rows(rows, shard, rank) * per_row


def parameter_bytes(p: Parameter, *, shard: int, ep: int, precision: str, sharding: str,
                    normuon: bool, rank: int = 0) -> StateBytes:
    """One parameter's bytes on FSDP rank ``rank`` (see the module's table)."""
    sharded = local_numel(p, shard=shard, ep=ep, rank=rank)
    whole = local_numel(p, shard=1, ep=ep) if sharding == "zero1" else sharded
    weight = 2 if precision == "bf16-master" else 4
    states = sharded * (4 if p.muon else 8) + (0 if p.muon else 4)
    if p.muon and normuon:
        states += sharded // (p.shape[-1] if p.shape else 1) * 4
    if precision == "bf16-master":
        states += sharded * 4
    return StateBytes(whole * weight, whole * 4, states)


def state_bytes(inv: Inventory, blocks: set[int], *, shard: int, ep: int, precision: str,
                sharding: str = "fsdp", normuon: bool = False, rank: int = 0) -> StateBytes:
    """Parameters, gradients and optimizer state of the parameters in ``blocks`` (block
    indices, with :data:`~.inventory.FIRST`/:data:`~.inventory.LAST` for the ends)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
    total = StateBytes()
    for p in inv.of(blocks):
        total = total + parameter_bytes(p, shard=shard, ep=ep, precision=precision,
                                        sharding=sharding, normuon=normuon, rank=rank)
    return total


def matmul_weights(inv: Inventory, blocks: set[int], *, ep: int) -> int:
    """Elements of the ≥2-D weights in ``blocks`` as a forward multiplies by them
    (unsharded; expert stacks at their ``E/ep`` local experts): what autocast copies."""
    return sum(local_numel(p, shard=1, ep=ep) for p in inv.of(blocks)
               if len(p.shape) >= 2 and "embed" not in p.name)


def largest_block_bytes(inv: Inventory, blocks: set[int], *, precision: str) -> int:
    """The biggest block's unsharded non-expert parameters: what FSDP gathers at once."""
    weight = 2 if precision == "bf16-master" else 4
    sizes: dict[int, int] = {}
    for p in inv.of(blocks):
        if not p.expert:
            sizes[p.block] = sizes.get(p.block, 0) + p.numel * weight
    return max(sizes.values(), default=0)
