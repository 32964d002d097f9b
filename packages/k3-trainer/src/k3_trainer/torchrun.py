"""What torchrun tells a process through its environment (rank, world size), and how a
worker process it launched leaves.

Torch-free, so the command line can read it before it parses (and answer ``--help``
without importing torch).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from typing import NoReturn

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


def leave_worker(status: int = 0) -> NoReturn:
    """End a torchrun worker process now, without the interpreter's teardown, once its
    session is over (the process group destroyed, every file it wrote closed).

    A gloo group can outlive ``destroy_process_group`` while something still holds it (a
    DDP session's reference cycles, until a garbage-collection pass; under FSDP2, DTensor's
    sharding results, which torch keeps in caches no public API clears); its threads then
    meet the interpreter's exit: std::terminate ("terminate called without an active
    exception", SIGABRT) after a complete run, seen about once in ten launches under load.
    ``os._exit`` skips that teardown (and ``atexit`` handlers), so call it only when
    nothing is left for them: ``k3-train``'s workers and the test workers end here.

    A rank that torchrun runs as a function in a process of its own (``--run-path``) is a
    ``multiprocessing`` child: the launcher waits for that function to return, so
    ``os._exit`` there would leave it waiting forever. Such a rank raises ``SystemExit``
    instead; torchrun reads the status, and a forked child (``--start-method fork``) then
    leaves by ``os._exit`` itself, skipping the teardown all the same."""
    sys.stdout.flush()
    sys.stderr.flush()
    if multiprocessing.parent_process() is not None:
        raise SystemExit(status)
    os._exit(status)
