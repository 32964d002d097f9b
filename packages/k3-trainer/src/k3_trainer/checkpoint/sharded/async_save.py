"""Writing a sharded checkpoint folder off the training path.

:func:`start_sharded_write` does what :func:`~.write.write_sharded` does, off the training
path: the update boundary is copied off the live state at once (DCP's stager: host memory,
pinned when the tensors are on a GPU; ``k3.ckpt``'s metadata and RNG are taken then too),
and DCP's ``async_save`` writes the copy on a background thread, its collectives on a gloo
process group of their own so that they never meet training's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import k3_checkpoint

from ...distributed import Parallel
from .check import ShardIndex
from .dcp import is_main, no_dist
from .folder import META
from .write import agree, as_os_error, prepare, seal


class ShardedWrite:
    """A sharded checkpoint being written in the background (:func:`start_sharded_write`).

    A failed write is kept and raised by :meth:`result`, never dropped."""

    def __init__(self, future: Future[str]) -> None:
        self._future = future

    def done(self) -> bool:
        """Whether the write has ended (written or failed); never blocks."""
        return self._future.done()

    def result(self) -> str:
        """Wait for the write; the digest of ``k3.ckpt`` on rank 0, "" elsewhere. Raises
        ``OSError`` (the original one where there is one) when this rank's part failed or,
        as DCP reports it and as the ranks agree at the end, any rank's part did."""
        return self._future.result()


def start_sharded_write(folder: Path, states: Mapping[str, Any], metadata: Mapping[str, Any],
                        parallel: Parallel | None) -> ShardedWrite:
    """Start writing what :func:`write_sharded` writes (call on every rank, at an update
    boundary); training may change the live states as soon as this returns.

    Here, on the calling thread: the states are copied off the live objects (DCP's
    ``DefaultStager``: every tensor to host memory, pinned when it comes from a GPU, every
    other value deep-copied), rank 0 takes ``k3.ckpt``'s payload (metadata, runtime, RNG
    of this boundary), and the ranks agree that all of that worked (``OSError`` on every
    rank otherwise, nothing started). In the background: DCP's ``async_save`` writes the
    copy, the files are hashed and rank 0 writes ``k3.ckpt``. A write waits for the previous
    one to end first, so that the background collectives of two writes never interleave."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

    folder = Path(folder)
    _BACKGROUND.settle()
    group = _BACKGROUND.side_group(parallel)
    staged, snapshot, failure = None, None, None
    try:
        prepared = prepare(states, parallel)
        staged = _stage(prepared.state)
        if is_main(parallel):
            snapshot = k3_checkpoint.snapshot_checkpoint(
                {"shards": ShardIndex(folder, {**prepared.record, "files": None})},
                metadata, modules=[prepared.model])
    except OSError as error:
        failure = error
    except (RuntimeError, k3_checkpoint.CheckpointError) as error:  # out of memory, a .grad
        failure = OSError(0, f"cannot take the checkpoint's snapshot ({error})")
    agree(parallel, failure)
    assert staged is not None
    upload = async_save(staged, storage_writer=FileSystemWriter(folder, sync_files=True),
                        process_group=group, async_stager=_AlreadyStaged(),
                        no_dist=no_dist(parallel))
    written = upload.upload_completion if isinstance(upload, AsyncSaveResponse) else upload
    write_meta = None if snapshot is None else _MetaWriter(folder, snapshot).write
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3-sharded-write")
    future = pool.submit(_finish, written, folder, write_meta, parallel, group)
    pool.shutdown(wait=False)  # the thread ends with the write; exit waits for it
    _BACKGROUND.in_flight = future
    return ShardedWrite(future)


def _stage(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` that later training steps cannot reach: DCP's own stager, which
    copies tensors to host memory (pinned under CUDA, for full-speed device-to-host copies;
    DTensors stay DTensors) and deep-copies everything else."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=cuda))
    try:
        staged = stager.stage(state)
    finally:
        stager.close()
    copied: dict[str, Any] = staged.result() if isinstance(staged, Future) else staged
    return copied


class _AlreadyStaged:
    """The ``AsyncStager`` handed to ``async_save``: :func:`_stage` has copied the state
    already (before the ranks agreed that every one could), so this passes it on as it is."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing to wait for: the copy was finished before ``async_save`` was called."""

    def close(self) -> None:
        """Nothing held."""


class _MetaWriter:
    """Writes ``k3.ckpt`` from the payload taken at the boundary, once the files are known."""

    def __init__(self, folder: Path, snapshot: k3_checkpoint.CheckpointSnapshot) -> None:
        self.folder, self.snapshot = folder, snapshot

    def write(self, files: dict[str, Any]) -> str:
        # The index's files are the one part of k3.ckpt known only after the shards exist;
        # the snapshot holds its own copy of the index, so this changes nothing else.
        self.snapshot.payload["shards"]["files"] = files
        return self.snapshot.write(self.folder / META)


def _finish(written: Future[Any], folder: Path, write_meta: Callable[[dict[str, Any]], str] | None,
            parallel: Parallel | None, group: Any) -> str:
    """The background part of :func:`start_sharded_write`, after DCP's upload."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        written.result()
    except (Exception, CheckpointException) as error:  # DCP reports it on every rank
        raise as_os_error(error, folder) from error
    try:
        return seal(folder, write_meta, parallel, group)
    except OSError:
        raise
    except Exception as error:  # reported as the write's failure, never dropped
        raise OSError(0, f"writing {folder} failed ({type(error).__name__}: {error})"
                      ) from error


class _Background:
    """The gloo group background writes use and the write in flight, per process.

    Training runs collectives on the default group while a write runs, and two threads
    must never share a group, so DCP and the end of the write get a group of their own,
    made once (on every rank, at the same call: the first background write)."""

    def __init__(self) -> None:
        self.world: Any = None
        self.group: Any = None
        self.in_flight: Future[str] | None = None

    def side_group(self, parallel: Parallel | None) -> Any:
        if parallel is None:
            return None
        if self.group is None or self.world is not dist.group.WORLD:  # a new default group
            self.group = dist.new_group(backend="gloo")
            self.world = dist.group.WORLD
        return self.group

    def settle(self) -> None:
        """Wait for the write in flight to end (its outcome stays with its ShardedWrite)."""
        if self.in_flight is not None:
            wait_for([self.in_flight])
            self.in_flight = None


_BACKGROUND = _Background()
