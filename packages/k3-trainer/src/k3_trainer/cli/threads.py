"""How many CPU threads a ``k3-train`` process computes with: one fewer than the cores it
may run on, unless ``OMP_NUM_THREADS`` names a number.

Why not torch's default (every core): an intra-op parallel region ends only when its
slowest thread does, and the KDA recurrence runs thousands of small regions per step. On a
machine where another process holds a core, each region then waits for a descheduled
thread, and training slows several-fold; one core left free absorbs that load, at the
cost of that core when the machine is idle (both measured in BENCHMARKS.md, "CPU
threads"). The count is part of a checkpoint's runtime signature (it changes CPU reduction
order), so it is a fixed function of the machine, never of its momentary load.
"""

from __future__ import annotations

import os

THREADS_ENV = "OMP_NUM_THREADS"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_threads(cores: int) -> int:
    """The thread count ``k3-train`` picks on ``cores`` usable cores."""
    return max(1, cores - 1)


def set_default_threads() -> str | None:
    """Apply the default unless ``OMP_NUM_THREADS`` is set (by the user, or by torchrun
    for several processes per machine); return a one-line note when it chose, else None."""
    if os.environ.get(THREADS_ENV, "").strip():
        return None
    import torch

    cores = min(usable_cores(), torch.get_num_threads())
    threads = default_threads(cores)
    if threads == torch.get_num_threads():
        return None
    torch.set_num_threads(threads)
    return (f"computing with {threads} CPU thread{'s' * (threads > 1)} of {cores} (one core "
            f"left for the rest of the machine; set {THREADS_ENV} to choose)")
