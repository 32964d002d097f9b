"""Layouts that fit a cluster, best first.

Every ``(pp, stages per rank, cp, ep, dp)`` with ``dp·cp·pp`` = the GPUs that
:func:`~.layout.validate_layout` accepts, at a fixed global batch (``global_batch``
sequences of ``base.seq_len`` per step, times ``base.grad_accum``). For each, what the
plan's formulas favour is tried first and the first that fits is kept:

- without activation checkpointing before block checkpointing (which re-runs each
  block's forward: a third more FLOPs in the blocks);
- with a pipeline, the most microbatches the rank's batch splits into (one sequence
  each): in these formulas more microbatches shrink both the bubble and the activations
  in flight; what a smaller matmul loses in kernel efficiency is not modelled;
- without a pipeline, the fewest gradient-accumulation splits of the rank's batch that
  fit (the step's tokens are the same; fewer splits keep the matmuls large).

Stages per rank are 1 or 2 (interleaved 1F1B). Context parallelism is searched only up
to ``max_cp`` (``--cp``; default 1): its exchanges, and KDA's state handed from slice to
slice, are not timed, so at a fixed global batch it would look like a free way to trade
data parallelism for more pipeline microbatches. Ranking: fitting layouts first, by
tokens per second (bubble and recomputation are what separate them at one MFU), then
fewer context-parallel ranks, then the lower peak memory; layouts that fit nowhere
follow, lowest peak first. Communication time is not modelled (it is inside the MFU).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from .gpus import GPU
from .inventory import Inventory
from .layout import LayoutError, ParallelLayout
from .plan import Options, Plan, make_plan

STAGES_PER_RANK = (1, 2)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidates(layout: ParallelLayout, per_rank: int) -> Iterator[ParallelLayout]:
    """Batch splits of one layout, the plan's preferred first."""
    if layout.pp > 1:
        yield replace(layout, batch_size=per_rank, microbatches=per_rank)
        return
    for splits in _divisors(per_rank):
        yield replace(layout, batch_size=per_rank // splits, microbatches=1,
                      grad_accum=layout.grad_accum * splits)


def _best(inv: Inventory, layout: ParallelLayout, per_rank: int, gpu: GPU,
          options: Options) -> Plan | None:
    """The first plan that fits, without checkpointing before with; else the smallest."""
    smallest: Plan | None = None
    for checkpointing in (False, True):
        for candidate in _candidates(layout, per_rank):
            try:
                plan = make_plan(inv, candidate, gpu,
                                 replace(options, checkpointing=checkpointing))
            except LayoutError:
                continue
            if plan.fits:
                return plan
            if smallest is None or plan.peak_bytes < smallest.peak_bytes:
                smallest = plan
    return smallest


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
