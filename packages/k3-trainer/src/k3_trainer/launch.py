"""What torchrun tells a process, and how ``k3-train --nproc`` relaunches itself under it.

Torch-free, so the command line can read it before it parses (and answer ``--help``
without importing torch).
"""

from __future__ import annotations

import os
import sys

MODES = ("none", "ddp", "fsdp")


def launched_world_size() -> int:
    """The world size torchrun announced in the environment (1 when not launched by it)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def launched_rank() -> int:
    """This process's rank as torchrun announced it (0 when not launched by it)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def launched_by_torchrun() -> bool:
    """True in a process torchrun started (it sets RANK), even with one process."""
    return "RANK" in os.environ


def prog_name() -> str:
    """``k3-train``, or ``k3-train[rank R]`` in a multi-process launch: every rank's error
    line says which rank failed."""
    if launched_world_size() > 1:
        return f"k3-train[rank {os.environ.get('RANK', '?')}]"
    return "k3-train"


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The command line that reruns ``k3-train`` with ``argv`` under torchrun, one process
    per device (``python -m torch.distributed.run``, so no PATH lookup is needed)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "-m", "k3_trainer.cli", *argv]

