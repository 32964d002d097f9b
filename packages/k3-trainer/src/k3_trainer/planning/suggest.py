"""Layouts that fit a cluster, best first: every ``(pp, cp, ep, dp)`` with
``dp·cp·pp`` = the GPUs that :func:`~.layout.validate_layout` accepts, at a fixed global
batch, ranked by tokens per second (the pipeline bubble is what separates them at one
MFU), fitting ones first, then by the peak memory per GPU."""

from __future__ import annotations

from dataclasses import replace

from .gpus import GPU
from .inventory import Inventory
from .layout import LayoutError, ParallelLayout
from .plan import Options, Plan, make_plan


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def suggest(inv: Inventory, world_size: int, global_batch: int, base: ParallelLayout,
            gpu: GPU, options: Options | None = None, *, limit: int = 10) -> list[Plan]:
    """The ``limit`` best layouts of ``world_size`` GPUs for ``global_batch`` sequences
    per step (``grad_accum`` and ``seq_len`` from ``base``; microbatches: ``base``'s, at
    least ``pp``; stages per rank: ``base``'s)."""
    options = options or Options()
    config = inv.config
    plans: list[Plan] = []
    for pp in _divisors(world_size):
        if pp * base.stages_per_rank > config.n_layers:
            continue
        for cp in _divisors(world_size // pp):
            dp = world_size // pp // cp
            if global_batch % dp:
                continue
            per_rank = global_batch // dp
            micro = max(base.microbatches, pp) if pp > 1 else 1
            if per_rank % micro:
                micro = pp if per_rank % pp == 0 else per_rank
            for ep in _divisors(dp * cp):
                layout = replace(base, dp=dp, pp=pp, cp=cp, ep=ep, batch_size=per_rank,
                                 microbatches=micro)
                try:
                    plans.append(make_plan(inv, layout, gpu, options))
                except LayoutError:
                    continue
    plans.sort(key=lambda p: (not p.fits, -p.tokens_per_s if p.fits else 0, p.peak_bytes))
    return plans[:limit]
