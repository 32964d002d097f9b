"""What a sharded checkpoint folder holds on disk, and how its files are known.

A folder is sharded when it holds DCP's ``.metadata``; its ``k3.ckpt`` (:data:`META`) is the
format-7 file beside the shards. Every file DCP wrote is recorded by its size and XXH3-128
checksum, hashed by the ranks in shares: the same entry a write records and a load
verifies.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

import k3_checkpoint

from ...distributed import Parallel

META = "k3.ckpt"
"""The format-7 file inside a sharded checkpoint folder."""


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """True for a sharded checkpoint folder (or a symlink naming one): it holds DCP's
    ``.metadata``. A folder holding ``k3.ckpt`` alone is a single-file checkpoint."""
    return (Path(path) / ".metadata").is_file()


def hash_files(folder: Path, parallel: Parallel | None, group: Any = None
                ) -> dict[str, dict[str, Any]]:
    """``{file: {"bytes", "xxh3_128"}}`` for every file DCP wrote; each rank hashes its share
    of the files and the ranks pool the results (through ``group``; None: the default)."""
    rank, world = (parallel.rank, parallel.world_size) if parallel is not None else (0, 1)
    own: OSError | None = None
    try:
        names = sorted(p.name for p in folder.iterdir() if p.is_file())
        mine: dict[str, Any] = {name: file_entry(folder / name) for name in names[rank::world]}
    except (OSError, ValueError) as error:
        if parallel is None:
            raise
        own = error if isinstance(error, OSError) else OSError(0, str(error))
        mine = {"": f"rank {rank}: {error}"}  # every rank must still join the gather
    if parallel is None:
        return mine
    pooled: list[Any] = [None] * world
    dist.all_gather_object(pooled, mine, group=group)
    failed = [part[""] for part in pooled if "" in part]
    if own is not None:
        raise own
    if failed:
        raise OSError(0, f"cannot hash the written shards ({'; '.join(failed)})")
    return {name: entry for part in pooled for name, entry in sorted(part.items())}


def file_entry(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "xxh3_128": k3_checkpoint.file_checksum(path)}
