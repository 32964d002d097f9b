"""Bytes a GPU sends per optimizer step, and what they add to the step time at an
assumed network bandwidth per GPU (``network_gbps``; 400 Gb/s, one NDR InfiniBand port
per GPU as in DGX H100/H200 nodes, by default; NVLink inside a node is faster and not
distinguished, so groups that fit in a node are charged too much).

For the most loaded pipeline rank (the first), over its stages' parameters:

- FSDP over ``n = dp·cp`` ranks: per forward/backward pass (each gradient-accumulation
  split, and with a pipeline each microbatch), an all-gather in the forward and again in
  the backward (``W`` bytes per weight element: 4, or 2 with a bf16 master) and a
  reduce-scatter of fp32 gradients, each moving ``(n − 1)/n`` of the stage's unsharded
  bytes: the memory plan holds one gathered block and its prefetch, not a whole stage
  kept gathered across microbatches, so the gathers repeat. With ``zero1``: one
  reduce-scatter and one all-gather per step. These overlap the compute: only what
  exceeds it adds to the step.
- Expert stacks under ``ep > 1`` are not FSDP-sharded: their gradients are all-reduced
  over the ``dp·cp/ep`` replicas once per step (``2·(r − 1)/r`` of their fp32 bytes).
- The expert all-to-alls: per MoE layer and microbatch, dispatch and combine in the
  forward and both again in the backward, ``4·tokens·k·width`` bf16 values, ``(ep −
  1)/ep`` of them leaving the GPU. They sit on the critical path: they add.

Context parallelism's key/value exchange (small against these at the sequence lengths
the planner sizes) and pipeline sends between stages are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from .inventory import FIRST, LAST, Inventory
from .layout import ParallelLayout, stage_blocks
from .memory import local_numel


@dataclass(frozen=True)
class Traffic:
    """Bytes one GPU sends per optimizer step: overlapped (FSDP, replica all-reduce) and
    on the critical path (expert all-to-all)."""

    overlapped_bytes: float
    exposed_bytes: float


def traffic(inv: Inventory, layout: ParallelLayout, *, precision: str,
            sharding: str) -> Traffic:
    """The first pipeline rank's traffic per step (see the module)."""
    config = inv.config
    groups = stage_blocks(config.n_layers, layout.stages)
    owned: set[int] = set()
    for s in range(0, layout.stages, layout.pp):  # pipeline rank 0's stages
        owned |= set(groups[s]) | ({FIRST} if s == 0 else set()) | (
            {LAST} if s == layout.stages - 1 else set())
    n = layout.shard_degree
    weight = 2 if precision == "bf16-master" else 4
    passes = layout.grad_accum * (layout.microbatches if layout.pp > 1 else 1)
    gathers = 1 if sharding == "zero1" else 2 * passes
    reduces = 1 if sharding == "zero1" else passes
    overlapped = 0.0
    for p in inv.of(owned):
        if p.expert and layout.ep > 1:
            replicas = n // layout.ep
            overlapped += 2 * (replicas - 1) / replicas * 4 * local_numel(
                p, shard=1, ep=layout.ep)
        elif n > 1:
            overlapped += (n - 1) / n * p.numel * (gathers * weight + reduces * 4)
    exposed = 0.0
    if layout.ep > 1 and config.mlp == "moe":
        moe_layers = sum(config.is_moe_layer(i) for i in owned if i >= 0)
        tokens = layout.batch_size * layout.seq_len // layout.cp * layout.grad_accum
        exposed = moe_layers * 4 * tokens * config.moe_top_k * config.moe_width * 2 * (
            layout.ep - 1) / layout.ep
    return Traffic(overlapped, exposed)
