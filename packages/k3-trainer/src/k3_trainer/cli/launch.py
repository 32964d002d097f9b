"""How ``k3-train train --nproc N`` reruns itself under torchrun, and how a rank names
itself in its error lines. Torch-free."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from ..torchrun import launched_world_size


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


def relaunch(nproc: int, argv: list[str]) -> int:
    """``k3-train train --nproc N``: rerun the same command under torchrun (without
    ``--nproc``); torchrun's status is this command's.

    Ctrl-C reaches torchrun and its ranks as well (one process group): the ranks stop at
    the next update boundary and save, so this process keeps waiting for them rather than
    dying of ``KeyboardInterrupt`` with a traceback while they still write, and exits 130
    as a one-process session does (torchrun itself reports the signal as a failure). The
    handler is installed even where SIGINT arrived ignored (a background job of a script):
    the ranks install theirs regardless, so they stop on it, and this status must say so."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            rest.append(arg)
    interrupted = False

    def note_interrupt(signum: int, frame: object) -> None:
        nonlocal interrupted
        interrupted = True  # returning (not raising) lets wait() go on waiting

    previous = signal.signal(signal.SIGINT, note_interrupt)
    try:
        with subprocess.Popen(torchrun_command(nproc, rest)) as torchrun:
            status = torchrun.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    return 128 + signal.SIGINT if interrupted and status else status
