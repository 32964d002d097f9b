"""One rank of ``k3-train train`` under torchrun with a background checkpoint write that
fails on one rank only (test_distributed_async_checkpoint.py).

Usage: ``torchrun ... async_fault_worker.py ARGS...`` (the arguments of ``k3-train``), with

- ``K3_TEST_ASYNC_FAULT=R:N``: in rank R only, the N-th checkpoint write fails with an
  ``OSError`` on the writer thread. Under DDP (rank 0 writes the one file) the write of
  ``k3.ckpt`` runs out of space (ENOSPC) after a partial ``.tmp``; under FSDP2 (every rank
  writes shards, then hashes its share of them) rank R cannot read back the shards of
  that write (EIO).
- ``K3_TEST_ASYNC_OUT=DIR``: each rank writes ``DIR/rank{R}.json`` when ``Trainer.fit``
  ends: the step it stopped at, the exception it raised (type and message) and the
  thread the failing write ran on.

Otherwise it is ``python -m k3_trainer.cli ARGS...``. Test code only.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
from pathlib import Path


def _inject(count: int, seen: dict) -> None:
    """Fail this rank's ``count``-th checkpoint write (on whichever thread writes it)."""
    import k3_checkpoint
    from k3_trainer.checkpoint.sharded import folder as sharded  # hash_files looks it up

    writes: list[Path] = []  # the checkpoint folders this rank has written into, in order

    def failing(folder: Path, where: str) -> bool:
        if folder not in writes:
            writes.append(folder)
        if len(writes) == count and folder == writes[-1]:
            seen.update(fault_thread=threading.current_thread().name, fault_in=where)
            return True
        return False

    real_write = k3_checkpoint.CheckpointSnapshot.write

    def write(self, path):  # type: ignore[no-untyped-def]
        folder = Path(path).parent
        # DDP: rank 0's one file (a sharded folder's k3.ckpt is left alone)
        if not sharded.is_sharded(folder) and failing(folder, "snapshot.write"):
            Path(f"{path}.tmp").write_bytes(b"\0" * 4096)  # a partial write, then full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_write(self, path)

    real_entry = sharded.file_entry

    def file_entry(path):  # type: ignore[no-untyped-def]
        # FSDP2: this rank's share of the shards, hashed once they are written
        if failing(Path(path).parent, "sharded.file_entry"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real_entry(path)

    k3_checkpoint.CheckpointSnapshot.write = write
    sharded.file_entry = file_entry


def _record_fit(out: Path, rank: int, seen: dict) -> None:
    from k3_trainer import trainer as trainer_module

    real_fit = trainer_module.Trainer.fit

    def fit(self):  # type: ignore[no-untyped-def]
        record: dict = {"rank": rank, "error": None}
        try:
            return real_fit(self)
        except BaseException as error:
            record["error"] = {"type": type(error).__name__, "message": str(error)}
            raise
        finally:
            record.update(step=self.state.step, **seen)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{rank}.json").write_text(json.dumps(record))

    trainer_module.Trainer.fit = fit


def main() -> int:
    rank = int(os.environ.get("RANK", "0"))
    seen: dict = {}
    fault = os.environ.get("K3_TEST_ASYNC_FAULT")
    if fault:
        faulty, count = map(int, fault.split(":"))
        if rank == faulty:
            _inject(count, seen)
    if os.environ.get("K3_TEST_ASYNC_OUT"):
        _record_fit(Path(os.environ["K3_TEST_ASYNC_OUT"]), rank, seen)
    from k3_trainer.cli import main as k3_train

    return k3_train(sys.argv[1:])


if __name__ == "__main__":
    status = main()
    from k3_trainer.torchrun import leave_worker

    leave_worker(status)
