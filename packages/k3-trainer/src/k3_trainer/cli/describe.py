"""``k3-train inspect``: summarize a checkpoint without loading it."""

from __future__ import annotations

import k3_checkpoint

from ..checkpoint.files import checkpoint_file
from ..checkpoint.sharded import describe_sharded, is_sharded
from ..session import RunError, checkpoint_at
from .options import InspectCommand


def run(command: InspectCommand, notes: tuple[str, ...] = ()) -> int:
    """A checkpoint file or folder, or a run directory's latest checkpoint (``--step``: the
    one of that step), every digest verified and nothing built."""
    checkpoint = command.checkpoint
    is_run = checkpoint.is_dir() and not (checkpoint / "k3.ckpt").exists()
    if is_run:
        checkpoint = checkpoint_at(checkpoint, command.step)
    elif command.step is not None:
        raise RunError(f"--step picks a checkpoint of a run directory; {checkpoint} is a "
                       "checkpoint itself")
    lines = (describe_sharded(checkpoint) if is_sharded(checkpoint)
             else k3_checkpoint.inspect_checkpoint(checkpoint_file(checkpoint)).lines())
    print("\n".join(lines))
    return 0
