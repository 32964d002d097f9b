"""What torchrun tells a process through its environment (rank, world size).

Torch-free, so the command line can read it before it parses (and answer ``--help``
without importing torch).
"""

from __future__ import annotations

import os

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
