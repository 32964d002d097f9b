"""``k3-train inspect``: summarize a checkpoint without loading it."""

from __future__ import annotations

import k3_checkpoint

from ..checkpoint import CHECKPOINT, SHARDED_CHECKPOINT, find_checkpoint
from ..checkpoint.sharded import describe_sharded, is_sharded
from .options import InspectCommand
from .resolve import RunError


def run(command: InspectCommand, notes: tuple[str, ...] = ()) -> int:
    """A checkpoint file, a sharded checkpoint folder, or a run directory's checkpoint,
    every digest verified and nothing built."""
    checkpoint = command.checkpoint
    if checkpoint.is_dir() and not (checkpoint / "k3.ckpt").exists():
        found = find_checkpoint(checkpoint)
        if found is None:
            raise RunError(f"{checkpoint} holds no checkpoint ({CHECKPOINT} or "
                           f"{SHARDED_CHECKPOINT})")
        checkpoint = found
    lines = (describe_sharded(checkpoint) if is_sharded(checkpoint)
             else k3_checkpoint.inspect_checkpoint(checkpoint).lines())
    print("\n".join(lines))
    return 0
