"""Layouts that fit a cluster, best first.

Every ``(pp, stages per rank, cp, ep, dp)`` with ``dp·cp·pp`` = the GPUs that
:func:`~.layout.validate_layout` accepts, at a fixed global batch (``global_batch``
sequences of ``base.seq_len`` per step, times ``base.grad_accum``). For each, the
fastest plan that fits is kept, over:

- the sharding: FSDP (parameters, gradients and optimizer state over ``dp·cp``; its
  gathers repeat every microbatch) or ZeRO-1 (only the optimizer state; one gather and
  one reduce-scatter per step, more memory), the trade :mod:`.comm` prices;
- activation checkpointing, none or block (which re-runs each block's forward: a third
  more FLOPs in the blocks);
- the batch split: with a pipeline, the microbatches the rank's batch divides into (at
  least ``pp``: more shrink the bubble and the activations in flight, and repeat FSDP's
  gathers); without, the gradient-accumulation splits (more hold fewer activations).

Stages per rank are 1 or 2 (interleaved 1F1B). Context parallelism is searched only up
to ``max_cp`` (``--cp``; default 1): its exchanges, and KDA's state handed from slice to
slice, are not timed, so at a fixed global batch it would look like a free way to trade
data parallelism for more pipeline microbatches. Ranking: fitting layouts first, by
tokens per second (bubble, recomputation and the communication :mod:`.comm` counts),
then fewer context-parallel ranks, then the lower peak memory; layouts that fit nowhere
follow, lowest peak first. What a smaller microbatch loses in kernel efficiency is not
modelled.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from .gpus import GPU
from .inventory import Inventory
from .layout import LayoutError, ParallelLayout
from .memory import SHARDINGS
from .plan import Options, Plan, make_plan

STAGES_PER_RANK = (1, 2)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidates(layout: ParallelLayout, per_rank: int) -> Iterator[ParallelLayout]:
    """Batch splits of one layout: with a pipeline, every microbatch count (at least
    ``pp``) the rank's batch divides into; without, every accumulation split."""
    for splits in _divisors(per_rank):
        if layout.pp > 1:
            if splits >= layout.pp:
                yield replace(layout, batch_size=per_rank, microbatches=splits)
        else:
            yield replace(layout, batch_size=per_rank // splits, microbatches=1,
                          grad_accum=layout.grad_accum * splits)


def _best(inv: Inventory, layout: ParallelLayout, per_rank: int, gpu: GPU,
          options: Options) -> Plan | None:
    """The fastest plan of ``layout`` that fits over the sharding, checkpointing and
    batch split; when none fits, the one with the smallest peak."""
    fastest: Plan | None = None
    smallest: Plan | None = None
    for sharding in SHARDINGS:
        for checkpointing in (False, True):
            for candidate in _candidates(layout, per_rank):
                try:
                    plan = make_plan(inv, candidate, gpu, replace(
                        options, sharding=sharding, checkpointing=checkpointing))
                except LayoutError:
                    continue
                if plan.fits and (fastest is None or plan.tokens_per_s > fastest.tokens_per_s):
                    fastest = plan
                if smallest is None or plan.peak_bytes < smallest.peak_bytes:
                    smallest = plan
    return fastest or smallest


def suggest(inv: Inventory, world_size: int, global_batch: int, base: ParallelLayout,
            gpu: GPU, options: Options | None = None, *, limit: int = 10,
            max_cp: int = 1) -> list[Plan]:
    """The ``limit`` best layouts of ``world_size`` GPUs for ``global_batch`` sequences
    per step (``seq_len`` and ``grad_accum`` from ``base``), each with the activation
    checkpointing and batch split it needs (see the module); context parallelism up to
    ``max_cp`` ranks."""
    options = options or Options()
    config = inv.config
    moe = config.mlp == "moe"
    plans: list[Plan] = []
    for pp in _divisors(world_size):
        for per_stage in STAGES_PER_RANK if pp > 1 else (1,):
            if pp * per_stage > config.n_layers:
                continue
            for cp in (d for d in _divisors(world_size // pp) if d <= max_cp):
                dp = world_size // pp // cp
                if global_batch % dp:
                    continue
                for ep in _divisors(dp * cp):
                    if ep > 1 and (not moe or config.n_experts % ep):
                        continue
                    layout = replace(base, dp=dp, pp=pp, cp=cp, ep=ep,
                                     stages_per_rank=per_stage)
                    plan = _best(inv, layout, global_batch // dp, gpu, options)
                    if plan is not None:
                        plans.append(plan)
    plans.sort(key=lambda p: (not p.fits, -p.tokens_per_s if p.fits else 0,
                              p.layout.cp, p.peak_bytes))
    return plans[:limit]
