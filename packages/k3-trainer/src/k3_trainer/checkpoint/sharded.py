"""Sharded checkpoints: a ``torch.distributed.checkpoint`` folder under the format-7 gate.

Under FSDP2 no rank holds the whole state, and gathering it onto one would cap the model
at one host's memory. Every rank writes its own part of every component with
``torch.distributed.checkpoint`` (DCP): the weights and optimizer state keyed by parameter
name and global shape, so any world size can read them back (DCP reshards), and every other
component's ``state_dict()`` under its own name (a group nested under the group's name),
plain values and tensors alike. A sharded tensor (a DTensor, e.g. a stateful callback's
moving average of FSDP2 weights) is written by the ranks that hold its shards and never
gathered onto one. Beside the shards, rank 0 writes ``k3.ckpt``: an ordinary format-7
checkpoint of the metadata the compatibility policy compares, the runtime signature and
the RNG, whose one component ``shards`` is the index of the folder: every shard file's size
and XXH3-128 checksum (``k3_checkpoint.file_checksum``), the names of the components in the
shards, each optimizer's class and layout (global shapes, so any world size compares equal)
and the shape of every other component's state (where its tensors are; DCP itself keeps no
trace of an empty mapping). The folder, named and published by the caller::

    <step folder>/
        .metadata  __0_0.distcp  __1_0.distcp  k3.ckpt

Writing: the caller creates the empty folder; every rank writes its shards, fsynced; each
rank hashes its share of the files; rank 0 writes ``k3.ckpt`` last and fsyncs the folder. A
failure on any rank is an ``OSError`` on every rank. :func:`start_sharded_write` does the
same off the training path: the update boundary is copied off the live state at once
(DCP's stager: host memory, pinned when the tensors are on a GPU; ``k3.ckpt``'s metadata and
RNG are taken then too), and DCP's ``async_save`` writes the copy on a background thread,
its collectives on a gloo process group of their own so that they never meet training's.

Loading checks before it changes anything: ``k3.ckpt`` through ``k3_checkpoint`` (checksum,
metadata under the policy, RNG), then, as its ``shards`` component, every shard file's
checksum (each rank hashes its share), that the components asked for were saved (and, for a
resume, that nothing saved is left out), each optimizer's class and layout, and every
tensor's name, global shape and dtype against the live model and optimizer. Only after every
rank has accepted are the components' saved states read (into copies of their live states,
so a DTensor keeps its sharding) and restored, all or none, then the weights and optimizer
state read straight into the live (possibly sharded) objects, and the RNG set last.
A read-only command (``eval``, ``sample``) asks for some components and ignores the rest.

Folders written before every component went through DCP (the small components inside
``k3.ckpt``, the optimizer's class and layout as its metadata) still load, the old way.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

import k3_checkpoint

from ..distributed import Parallel
from .agreement import Snapshot, leaves, load_on_every_rank, raise_on_every_rank

if TYPE_CHECKING:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata

META = "k3.ckpt"
"""The format-7 file inside a sharded checkpoint folder."""

_TENSORS = ("model", "optimizer")  # read and written through DCP's state-dict API
_LEGACY_METADATA = frozenset({"optimizer_type", "optimizer_layout"})
_SHOWN = 5  # names listed in a message before "…"
_VALUE_SHOWN = 160  # characters of a value on an inspect line


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """True for a sharded checkpoint folder (or a symlink naming one): it holds DCP's
    ``.metadata``. A folder holding ``k3.ckpt`` alone is a single-file checkpoint."""
    return (Path(path) / ".metadata").is_file()


# --- save ---------------------------------------------------------------------------------

def reshard(model: nn.Module) -> None:
    """Put every FSDP2 module of ``model`` back in its sharded state. A forward without a
    backward (evaluation) leaves the root's parameters gathered, and then its registered
    parameters are not the ones the optimizer holds."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@dataclass(frozen=True)
class _Prepared:
    """What one write puts in the folder, taken from the live states on the calling thread."""

    state: dict[str, Any]
    """The state DCP writes: ``model``, ``optimizer`` and every other component by name."""
    record: dict[str, Any]
    """The shard index without its files: components, optimizers, structure."""
    model: nn.Module


def write_sharded(folder: Path, states: Mapping[str, Any], metadata: Mapping[str, Any],
                  parallel: Parallel | None) -> str:
    """Write every component of ``states`` into the empty folder ``folder`` (call on every
    rank); returns the digest of its ``k3.ckpt`` (the checkpoint's identity) on rank 0, ""
    elsewhere. Raises ``OSError`` on every rank when any rank failed.

    ``states``: ``{name: Stateful or a group of them}`` with the (FSDP2-sharded) model under
    ``model`` and its optimizer under ``optimizer``."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    folder = Path(folder)
    prepared, failure = None, None
    try:
        prepared = _prepare(states)
    except OSError as error:
        failure = error
    _agree(parallel, failure)
    assert prepared is not None
    try:
        with _single_process_quiet():
            save(prepared.state, storage_writer=FileSystemWriter(folder, sync_files=True),
                 no_dist=_no_dist(parallel))
    except (Exception, CheckpointException) as error:  # the latter on every rank
        raise _os_error(error, folder) from error
    model, record = prepared.model, prepared.record

    def write_meta(files: dict[str, Any]) -> str:
        return k3_checkpoint.save_checkpoint(
            folder / META, {"shards": ShardIndex(folder, {**record, "files": files})},
            metadata, modules=[model])

    return _seal(folder, write_meta if _is_main(parallel) else None, parallel, None)


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
        prepared = _prepare(states)
        staged = _stage(prepared.state)
        if _is_main(parallel):
            snapshot = k3_checkpoint.snapshot_checkpoint(
                {"shards": ShardIndex(folder, {**prepared.record, "files": None})},
                metadata, modules=[prepared.model])
    except OSError as error:
        failure = error
    except (RuntimeError, k3_checkpoint.CheckpointError) as error:  # out of memory, a .grad
        failure = OSError(0, f"cannot take the checkpoint's snapshot ({error})")
    _agree(parallel, failure)
    assert staged is not None
    upload = async_save(staged, storage_writer=FileSystemWriter(folder, sync_files=True),
                        process_group=group, async_stager=_AlreadyStaged(),
                        no_dist=_no_dist(parallel))
    written = upload.upload_completion if isinstance(upload, AsyncSaveResponse) else upload
    write_meta = None if snapshot is None else _MetaWriter(folder, snapshot).write
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3-sharded-write")
    future = pool.submit(_finish, written, folder, write_meta, parallel, group)
    pool.shutdown(wait=False)  # the thread ends with the write; exit waits for it
    _BACKGROUND.in_flight = future
    return ShardedWrite(future)


def _prepare(states: Mapping[str, Any]) -> _Prepared:
    """The state DCP writes and the shard index's record; ``OSError`` (errno 0) for states
    a checkpoint cannot hold."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model, optimizer = _model_and_optimizer(states)
    if optimizer is not None:
        try:
            optimizers = {"optimizer": _optimizer_record(optimizer, model)}
        except k3_checkpoint.CheckpointError as error:
            raise OSError(0, str(error)) from error
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    else:
        state, optimizers = {"model": get_model_state_dict(model)}, {}
    structure: dict[str, Any] = {}
    for name, component in _others(states):
        if isinstance(component, torch.optim.Optimizer):
            raise OSError(0, f"component '{name}' is a second optimizer; a sharded checkpoint "
                             "keeps one, under 'optimizer'")
        try:
            value = k3_checkpoint.to_plain(component.state_dict(), name, tensors=True)
        except k3_checkpoint.CheckpointError as error:
            raise OSError(0, str(error)) from error
        _put(state, name.split("."), value)
        structure[name] = _skeleton(value)
    names = [name for name, _ in leaves(states)]
    return _Prepared(state, {"components": sorted(names), "optimizers": optimizers,
                             "structure": structure}, model)


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
        raise _os_error(error, folder) from error
    try:
        return _seal(folder, write_meta, parallel, group)
    except OSError:
        raise
    except Exception as error:  # reported as the write's failure, never dropped
        raise OSError(0, f"writing {folder} failed ({type(error).__name__}: {error})"
                      ) from error


def _seal(folder: Path, write_meta: Callable[[dict[str, Any]], str] | None,
          parallel: Parallel | None, group: Any) -> str:
    """Hash the shards (each rank its share), then rank 0 (``write_meta``) writes
    ``k3.ckpt`` and fsyncs the folder; the ranks agree on the outcome through ``group``
    (None: the default group, on the training thread)."""
    files = _hash_share(folder, parallel, group)
    digest, failure = "", None
    if write_meta is not None:
        try:
            digest = write_meta(files)
            k3_checkpoint.fsync_directory(folder)
        except OSError as error:
            failure = error
        except k3_checkpoint.CheckpointError as error:
            failure = OSError(0, str(error))
    if group is None:
        _agree(parallel, failure)
    elif parallel is not None:
        flag = torch.tensor([0.0 if failure is None else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item():
            raise failure if failure is not None else OSError(0, _ELSEWHERE)
    elif failure is not None:
        raise failure
    return digest


def _hash_share(folder: Path, parallel: Parallel | None, group: Any = None
                ) -> dict[str, dict[str, Any]]:
    """``{file: {"bytes", "xxh3_128"}}`` for every file DCP wrote; each rank hashes its share
    of the files and the ranks pool the results (through ``group``; None: the default)."""
    rank, world = (parallel.rank, parallel.world_size) if parallel is not None else (0, 1)
    own: OSError | None = None
    try:
        names = sorted(p.name for p in folder.iterdir() if p.is_file())
        mine: dict[str, Any] = {name: _file_entry(folder / name) for name in names[rank::world]}
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


def _file_entry(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "xxh3_128": k3_checkpoint.file_checksum(path)}


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


# --- load ---------------------------------------------------------------------------------

def read_sharded(folder: Path, states: Mapping[str, Any], metadata: Mapping[str, Any],
                 policy: k3_checkpoint.CompatibilityPolicy, parallel: Parallel | None, *,
                 subset: bool = False) -> k3_checkpoint.LoadedCheckpoint:
    """Validate the sharded checkpoint ``folder`` on every rank, then restore ``states``
    (call on every rank, including with one process).

    ``subset=False`` (a resume): every saved component needs a live one and the other way
    round. ``subset=True`` (``eval``, ``sample``, ``export``): the components of ``states``
    are read and the others saved beside them neither compared nor read; without
    ``optimizer`` the model's tensors are read alone.

    Raises ``k3_checkpoint.CheckpointError`` on every rank, with nothing changed on any,
    when any rank refuses it. The RNG is set last.
    """
    folder = Path(folder)
    model, optimizer = _model_and_optimizer(states)
    others = _others(states)
    expected = _Expected(
        components=[name for name, _ in leaves(states)], subset=subset,
        optimizers={} if optimizer is None else {
            "optimizer": _optimizer_record(optimizer, model)},
        tensors=_live_tensors(model, optimizer), others=[name for name, _ in others])
    index = ShardIndex(folder, expected=expected, parallel=parallel)
    # The one rollback: every component read through load_state_dict and the RNG, as now.
    snapshot = Snapshot({k: v for k, v in states.items() if k not in _TENSORS})
    layout: list[str] = []

    def gate() -> k3_checkpoint.LoadedCheckpoint:
        if _is_legacy(k3_checkpoint.read_payload(folder / META)):
            layout.append("legacy")
            return _load_legacy(folder, states, metadata, policy, index, subset)
        layout.append("current")
        # The step limit reads a component's saved state, which is in the shards, not in
        # k3.ckpt: it is checked once that state is read, before anything is restored.
        return k3_checkpoint.load_checkpoint(folder / META, {"shards": index}, metadata,
                                             replace(policy, step_limit=None), modules=[model])

    loaded = load_on_every_rank(folder, parallel, gate, snapshot.restore)
    resumed_rng = k3_checkpoint.capture_rng()
    if layout == ["current"] and others:
        record = index.saved
        assert record is not None

        def restore() -> k3_checkpoint.LoadedCheckpoint:
            _restore_components(folder, others, record, snapshot, parallel,
                                check=_step_limit_check(policy, metadata, others))
            return loaded

        load_on_every_rank(folder, parallel, restore, snapshot.restore)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        _read_tensors(folder, model, optimizer, parallel)
    except (Exception, CheckpointException) as exc:  # every check passed: I/O failed
        raise k3_checkpoint.CheckpointError(
            "restore failed after every check passed, so the model and optimizer may be "
            f"partly restored; rebuild them before trying again ({type(exc).__name__}: "
            f"{exc})", path=folder) from exc
    k3_checkpoint.restore_rng(resumed_rng)
    return loaded


def _is_legacy(payload: Mapping[str, Any]) -> bool:
    """A folder from before every component went through DCP: its index lists no
    components (they are inside ``k3.ckpt``)."""
    shards = payload.get("shards")
    return not (isinstance(shards, Mapping) and "components" in shards)


def _load_legacy(folder: Path, states: Mapping[str, Any], metadata: Mapping[str, Any],
                 policy: k3_checkpoint.CompatibilityPolicy, index: ShardIndex,
                 subset: bool) -> k3_checkpoint.LoadedCheckpoint:
    """The previous layout's load: the small components from ``k3.ckpt`` by
    ``k3_checkpoint`` itself, the optimizer's class and layout compared as metadata."""
    model, optimizer = _model_and_optimizer(states)
    small = {name: value for name, value in states.items() if name not in _TENSORS}
    current = dict(metadata)
    if optimizer is not None:
        record = _optimizer_record(optimizer, model)
        current.update(optimizer_type=record["type"], optimizer_layout=record["layout"])
    elif subset:  # the optimizer is not read, so neither is its record
        policy = replace(policy, may_differ=policy.may_differ | _LEGACY_METADATA)
    return k3_checkpoint.load_checkpoint(folder / META, {"shards": index, **small}, current,
                                         policy, modules=[model], subset=subset)


def _step_limit_check(policy: k3_checkpoint.CompatibilityPolicy, metadata: Mapping[str, Any],
                      others: list[tuple[str, Any]]
                      ) -> Callable[[Mapping[str, Any]], object] | None:
    """The policy's step limit as a check of the components' saved states, or None when
    it has none or reads a component this load does not."""
    limit = policy.step_limit
    if limit is None or not any(limit[1] == name or limit[1].startswith(name + ".")
                                for name, _ in others):
        return None
    alone = k3_checkpoint.CompatibilityPolicy(step_limit=limit)
    return lambda saved: alone.compare(metadata, metadata, _nested(saved))


def _nested(saved: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b": state}`` as ``{"a": {"b": state}}``, the shape a policy path reads."""
    tree: dict[str, Any] = {}
    for name, state in saved.items():
        _put(tree, name.split("."), state)
    return tree


def _restore_components(folder: Path, others: list[tuple[str, Any]], record: Mapping[str, Any],
                        snapshot: Snapshot, parallel: Parallel | None, *,
                        check: Callable[[Mapping[str, Any]], object] | None = None) -> None:
    """Read the saved states of ``others`` from the shards, ``check`` them (it raises
    ``CheckpointError``), and restore them, all or none: on any failure or refusal
    everything (RNG included) is put back as ``snapshot`` holds it and ``CheckpointError``
    raised. Every rank reaches the read (a collective)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        saved = _read_components(folder, others, record, parallel)
    except (Exception, CheckpointException) as error:
        snapshot.restore()
        raise k3_checkpoint.CheckpointError(
            f"cannot read the components' saved states ({type(error).__name__}: "
            f"{_first_line(error)}); nothing was restored", path=folder) from error
    if check is not None:
        try:
            check(saved)
        except k3_checkpoint.CheckpointError as error:
            snapshot.restore()
            raise error.with_path(folder) from None
    for name, component in others:
        try:
            component.load_state_dict(saved[name])
        except Exception as error:
            snapshot.restore()
            raise k3_checkpoint.CheckpointError(
                f"{name} refused its saved state ({type(error).__name__}: {error}); nothing "
                "was restored", path=folder) from error


def _read_components(folder: Path, others: list[tuple[str, Any]], record: Mapping[str, Any],
                     parallel: Parallel | None) -> dict[str, Any]:
    """``{name: saved state}`` of ``others``, read from the shards into templates shaped
    by the saved structure: a tensor into an empty copy of the live one where it fits
    (a DTensor keeps its sharding), else into a whole one of the saved shape."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    reader = FileSystemReader(folder)
    table = reader.read_metadata()
    where = _fqns(table)

    def tensor(path: tuple[str | int, ...], live: Any) -> torch.Tensor:
        entry = table.state_dict_metadata[where.get(path, _dotted(path))]
        size, dtype = entry.size, entry.properties.dtype  # type: ignore[union-attr]
        if isinstance(live, torch.Tensor) and live.shape == size and live.dtype == dtype:
            return torch.empty_like(live)
        return torch.empty(size, dtype=dtype)

    tree: dict[str, Any] = {}
    for name, component in others:
        parts = tuple(name.split("."))
        _put(tree, parts, _template(record["structure"][name], component.state_dict(), parts,
                                    tensor))
    with _single_process_quiet():
        load(tree, storage_reader=reader, planner=_weights_only_planner()(),
             no_dist=_no_dist(parallel))
    return {name: _get(tree, name.split(".")) for name, _ in others}


def _template(skeleton: Any, live: Any, path: tuple[str | int, ...],
              tensor: Callable[[tuple[str | int, ...], Any], torch.Tensor]) -> Any:
    """A state shaped as ``skeleton`` says, for DCP to read into: ``tensor(path, live
    value)`` where a tensor was saved (checked to be in the shards), None where a value
    was (DCP puts the saved one there)."""
    if isinstance(skeleton, dict):
        return {key: _template(node, _child(live, key), (*path, key), tensor)
                for key, node in skeleton.items()}
    if isinstance(skeleton, list):
        return [_template(node, _child(live, index), (*path, index), tensor)
                for index, node in enumerate(skeleton)]
    if isinstance(skeleton, str):
        return tensor(path, live)
    return None


def _read_tensors(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                  parallel: Parallel | None) -> None:
    """DCP reads each rank's part of every tensor in place (resharding when the world size
    changed); the optimizer takes the checkpoint's hyperparameters too."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load

    def read(state: dict[str, Any]) -> None:
        with _single_process_quiet():
            load(state, storage_reader=FileSystemReader(folder),
                 planner=_weights_only_planner()(), no_dist=_no_dist(parallel))

    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        read(state)
        set_model_state_dict(model, state["model"])
        return
    # get_state_dict gives a never-stepped optimizer its state with one lr=0 step; the
    # checkpoint then overwrites all of it.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    read(state)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    optimizer.zero_grad(set_to_none=True)


@functools.cache
def _weights_only_planner() -> type[DefaultLoadPlanner]:
    """DCP's default load planner, except that a saved value that is not a tensor (a
    counter, a cursor, an optimizer's hyperparameters) is read by
    ``torch.load(weights_only=True)``: plain data, never an arbitrary unpickle (DCP's own
    ``load_bytes`` unpickles anything). Made on first use: importing DCP takes most of a
    second, which a command that never touches a sharded checkpoint should not pay."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                _place(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return WeightsOnlyLoadPlanner


def _live_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None
                  ) -> dict[str, Any]:
    """What the checkpoint's tensors must match: every model state entry's global shape and
    dtype, and every optimized parameter's name and global shape (read without touching the
    optimizer, whose state may not exist yet); None for the optimizer when it is not read."""
    model_entries = {f"model.{name}": (tuple(value.shape), value.dtype)
                     for name, value in model.state_dict().items()}
    parameters = None if optimizer is None else {
        entry["name"]: tuple(entry["shape"])
        for entry in k3_checkpoint.optimizer_layout(optimizer, model)}
    return {"model": model_entries, "parameters": parameters}


@dataclass(frozen=True)
class _Expected:
    """What the live run needs of a folder's index, checked before anything changes."""

    components: list[str]
    """Every live component, by dotted name (``loaders.train``)."""
    subset: bool
    optimizers: dict[str, dict[str, Any]]
    """``{name: {"type", "layout"}}`` of the live optimizer (none when it is not read)."""
    tensors: dict[str, Any]
    """:func:`_live_tensors`."""
    others: list[str]
    """The components read through their own ``load_state_dict``."""


class ShardIndex:
    """The index of a sharded checkpoint folder: ``k3.ckpt``'s ``shards`` component.

    Saving: ``state_dict()`` is the record given, ``{"files": {name: {"bytes",
    "xxh3_128"}}, "components": [...], "optimizers": {name: {"type", "layout"}},
    "structure": {name: shape of its state}}`` (a folder from before every component went
    through DCP has the files alone). Loading: ``load_state_dict`` verifies this rank's
    share of the files (all of them with one process) against those checksums, then what
    ``expected`` asks (the folder's tensor table against the live model and optimizer, the
    components, the optimizer's class and layout, the structure's tensors), raising on the
    first problem; it runs before anything is restored.
    """

    def __init__(self, folder: Path, saved: dict[str, Any] | None = None, *,
                 expected: _Expected | None = None, parallel: Parallel | None = None
                 ) -> None:
        self.folder, self.saved, self.expected, self.parallel = folder, saved, expected, parallel

    def state_dict(self) -> dict[str, Any] | None:
        return self.saved

    def load_state_dict(self, saved: Any, /) -> None:
        if saved is None:  # the roll-back of a refusal elsewhere: nothing was taken
            return
        files = saved.get("files") if isinstance(saved, Mapping) else None
        if not isinstance(files, Mapping) or ".metadata" not in files:
            raise ValueError("no file index with DCP's .metadata in it")
        present = {p.name for p in self.folder.iterdir() if p.is_file()} - {META}
        missing, extra = sorted(set(files) - present), sorted(present - set(files))
        if missing or extra:
            raise ValueError(f"shard files missing {_listed(missing)}, unexpected "
                             f"{_listed(extra)}")
        rank, world = ((self.parallel.rank, self.parallel.world_size)
                       if self.parallel is not None else (0, 1))
        for name in sorted(files)[rank::world]:
            entry = files[name]
            if not isinstance(entry, Mapping) or _file_entry(self.folder / name) != dict(entry):
                raise ValueError(f"shard file {name} does not match its recorded size and "
                                 "checksum: the checkpoint is corrupt")
        if self.expected is not None:  # the model's own mismatches first: the clearest
            check_tensor_table(self.folder, self.expected.tensors)
        if "components" in saved:
            _check_record(saved, self.folder, self.expected)
        self.saved = dict(saved)


def _check_record(saved: Mapping[str, Any], folder: Path, expected: _Expected | None) -> None:
    """Raise ``ValueError`` unless the index's record is well formed and, with
    ``expected``, serves the live run: its components saved (and nothing saved left out of
    a resume), its optimizer of the saved class and layout, its other components' tensors
    in the shards."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    names, optimizers, structure = (saved.get(key) for key in
                                    ("components", "optimizers", "structure"))
    if (not isinstance(names, list) or not all(isinstance(n, str) for n in names)
            or not isinstance(optimizers, Mapping) or not isinstance(structure, Mapping)):
        raise ValueError("the shard index's components, optimizers or structure are malformed")
    table = FileSystemReader(folder).read_metadata()
    where = _fqns(table)
    for name, skeleton in structure.items():
        for path in _tensor_paths(skeleton, tuple(str(name).split("."))):
            entry = table.state_dict_metadata.get(where.get(path, _dotted(path)))
            if not isinstance(entry, TensorStorageMetadata):
                raise ValueError(f"component {name}: its tensor {_dotted(path)} is not in "
                                 "the shards")
    if expected is None:
        return
    missing = sorted(set(expected.components) - set(names))
    if missing:
        raise ValueError(f"the checkpoint has no state for {_listed(missing)} (it holds "
                         f"{_listed(sorted(names))})")
    extra = sorted(set(names) - set(expected.components))
    if extra and not expected.subset:
        raise ValueError(f"the checkpoint holds components this load has none for: "
                         f"{_listed(extra)}; a resume restores every saved component")
    missing = sorted(name for name in expected.others if name not in structure)
    if missing:
        raise ValueError(f"the shard index records no structure for {_listed(missing)}")
    for name, live in expected.optimizers.items():
        record = optimizers.get(name)
        if not isinstance(record, Mapping):
            raise ValueError(f"the shard index records no class and layout for {name}")
        if record.get("type") != live["type"]:
            raise ValueError(f"{name} class: checkpoint {record.get('type')}, current "
                             f"{live['type']}")
        _check_layout(name, record.get("layout"), live["layout"])


def _check_layout(name: str, saved: Any, live: list[dict[str, Any]]) -> None:
    """Raise unless the saved optimizer layout is the live one, entry by entry (global
    shapes: the same at any world size)."""
    if not isinstance(saved, list):
        raise ValueError(f"{name} layout in the checkpoint is not a list")
    wrong = [f"[{i}] checkpoint {_entry(old)}, current {_entry(new)}"
             for i, (old, new) in enumerate(zip(saved, live)) if old != new]
    if len(saved) != len(live):
        wrong.append(f"checkpoint {len(saved)} parameters, current {len(live)}")
    if wrong:
        raise ValueError(f"incompatible {name} layout — {_listed(wrong, '; ')}")


def _entry(entry: Any) -> str:
    if not isinstance(entry, Mapping):
        return repr(entry)
    return " ".join(str(entry.get(key)) for key in ("group", "name", "shape", "dtype"))


def check_tensor_table(folder: Path, live: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless the folder's tensors fit the live model and optimizer:
    the same model entries with the same global shapes and dtypes, and optimizer state only
    for live parameters, parameter-shaped wherever it is more than a scalar."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    table = FileSystemReader(folder).read_metadata().state_dict_metadata
    tensors = {key: (tuple(entry.size), entry.properties.dtype)
               for key, entry in table.items() if isinstance(entry, TensorStorageMetadata)}
    saved_model = {key: value for key, value in tensors.items() if key.startswith("model.")}
    wanted: dict[str, Any] = live["model"]
    missing = sorted(set(wanted) - set(saved_model))
    extra = sorted(set(saved_model) - set(wanted))
    if missing or extra:
        raise ValueError(f"model tensors missing {_listed(missing)}, unexpected "
                         f"{_listed(extra)}")
    wrong = [f"{key[6:]} {list(saved_model[key][0])} {saved_model[key][1]} vs "
             f"{list(shape)} {dtype}"
             for key, (shape, dtype) in wanted.items() if saved_model[key] != (shape, dtype)]
    parameters: dict[str, tuple[int, ...]] | None = live["parameters"]
    stray = []
    for key, (shape, _) in tensors.items():
        if parameters is None or not key.startswith("optimizer.state."):
            continue
        name, _, field = key[len("optimizer.state."):].rpartition(".")
        if name not in parameters:
            stray.append(key[len("optimizer.state."):])
        elif len(shape) > 0 and shape != parameters[name] and torch.Size(shape).numel() > 1:
            wrong.append(f"{name}.{field} {list(shape)} vs {list(parameters[name])}")
    if stray:
        raise ValueError(f"optimizer state for parameters the optimizer lacks: "
                         f"{_listed(sorted(stray))}")
    if wrong:
        raise ValueError(f"tensors do not match the live model: {_listed(wrong)}")


# --- inspect --------------------------------------------------------------------------------

def describe_sharded(path: Path) -> list[str]:
    """``k3-train inspect`` of a sharded checkpoint: ``k3.ckpt``'s summary plus every
    component in the shards (its tensor bytes, or its values when it holds no tensor),
    every file's checksum verified."""
    folder = Path(path)
    summary = k3_checkpoint.inspect_checkpoint(folder / META)
    shards = summary.entries.get("shards")
    files = shards.get("files") if isinstance(shards, Mapping) else None
    if not isinstance(shards, Mapping) or not isinstance(files, Mapping):
        raise k3_checkpoint.CheckpointError("has no shard file index", path=folder / META)
    try:
        ShardIndex(folder).load_state_dict(shards)
    except ValueError as error:
        raise k3_checkpoint.CheckpointError(str(error), path=folder) from error
    lines = [f"sharded        {folder} -> {folder.resolve().name} "
             f"(torch.distributed.checkpoint, {len(files)} files, "
             f"{_size(sum(int(e['bytes']) for e in files.values()))}, every checksum verified)"]
    if "components" in shards:
        lines += _describe_components(folder, shards)
    else:  # the previous layout: the small components are k3.ckpt's own lines
        table = _tensor_bytes(folder, [(key,) for key in _TENSORS])
        lines += [f"{key:<14} {_size(table.get((key,), 0))} of tensors (sharded)"
                  for key in _TENSORS]
    lines += _expert_layout(summary.entries)
    lines += [line for line in summary.lines()
              if not line.startswith(("shards ", "checkpoint ", "components "))]
    return [summary.lines()[0], *lines]


def _describe_components(folder: Path, index: Mapping[str, Any]) -> list[str]:
    """One line per component in the shards: its tensor bytes, or the values of one that
    holds no tensor (read as a load reads them: plain data only)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    names = [str(name) for name in index["components"]]
    structure = index["structure"]
    table = _tensor_bytes(folder, [tuple(name.split(".")) for name in names])
    plain = [name for name in names if name not in _TENSORS
             and not any(_tensor_paths(structure[name], ()))]
    tree: dict[str, Any] = {}
    for name in plain:
        _put(tree, name.split("."), _template(structure[name], None, (), _no_tensor))
    if tree:
        with _single_process_quiet():
            load(tree, storage_reader=FileSystemReader(folder),
                 planner=_weights_only_planner()(), no_dist=True)
    lines = []
    for name in names:
        size = table.get(tuple(name.split(".")), 0)
        text = _flat(_get(tree, name.split("."))) if name in plain else (
            f"{_size(size)} of tensors (sharded)")
        lines.append(f"{name:<14} {text}")
    return lines


def _tensor_bytes(folder: Path, owners: list[tuple[str, ...]]) -> dict[tuple[str, ...], int]:
    """Bytes of tensor data in the shards under each of ``owners`` (a component's path)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(folder).read_metadata()
    paths = {fqn: tuple(map(str, path)) for fqn, path in (metadata.planner_data or {}).items()}
    totals: dict[tuple[str, ...], int] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        path = paths.get(key, tuple(key.split(".")))
        owner = next((o for o in owners if path[:len(o)] == o), None)
        if owner is not None:
            size = torch.Size(entry.size).numel() * entry.properties.dtype.itemsize
            totals[owner] = totals.get(owner, 0) + size
    return totals


def _expert_layout(entries: Mapping[str, Any]) -> list[str]:
    """The expert-parallel layout the run saved with, when it used one: which experts each
    rank of an expert group held (the shards are keyed by global expert index, so any
    layout reads them back)."""
    layout, model = entries.get("data_parallel"), entries.get("model_config")
    if not isinstance(layout, Mapping) or not isinstance(model, Mapping):
        return []
    degree, experts = layout.get("expert_parallel"), model.get("n_experts")
    if not isinstance(degree, int) or not isinstance(experts, int) or degree < 2:
        return []
    per_rank = experts // degree
    world = layout.get("world_size")
    groups = f"{world // degree} expert group(s) of {degree} ranks" if isinstance(
        world, int) else f"expert groups of {degree} ranks"
    return [f"expert layout  {groups}: rank r of a group held routed experts "
            f"[{per_rank}·r, {per_rank}·(r+1)) of {experts} per MoE layer; shards keyed by "
            "global expert index (any layout resumes with --allow-runtime-change)"]


# --- helpers -------------------------------------------------------------------------------

_ELSEWHERE = "another rank failed to write its part of the checkpoint (see its error line)"


def _agree(parallel: Parallel | None, failure: OSError | None) -> None:
    raise_on_every_rank(parallel, failure, _ELSEWHERE)


def _os_error(error: BaseException, where: Path) -> OSError:
    """The OSError behind a DCP failure (disk full...), or one that names the failure.

    DCP raises a ``CheckpointException`` (a ``BaseException``) on every rank, listing each
    failed rank's own exception; torch's file writer often reports a failed write as a
    ``RuntimeError`` about stream positions, with no OSError attached."""
    failures = getattr(error, "failures", None)
    causes: list[tuple[str, BaseException]] = [("", error)]
    if isinstance(failures, Mapping):
        causes = [(f"rank {rank}: ", failure[0] if isinstance(failure, tuple) else failure)
                  for rank, failure in sorted(failures.items())]
    for _, cause in causes:
        link: BaseException | None = cause
        seen: set[int] = set()
        while link is not None and id(link) not in seen:
            seen.add(id(link))
            if isinstance(link, OSError):
                return link
            link = link.__cause__ or link.__context__
    described = "; ".join(f"{who}{type(cause).__name__}: {_first_line(cause)}"
                          for who, cause in causes)
    return OSError(0, f"writing the shards into {where} failed ({described})")


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0]


def _is_main(parallel: Parallel | None) -> bool:
    return parallel is None or parallel.is_main


def _no_dist(parallel: Parallel | None) -> bool:
    """One process (``parallel=None``): DCP reads and writes everything here, no group."""
    return parallel is None or not dist.is_initialized()


def _model_and_optimizer(states: Mapping[str, Any]
                         ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    model, optimizer = states.get("model"), states.get("optimizer")
    if not isinstance(model, nn.Module):
        raise TypeError("a sharded checkpoint's states need the model under 'model'")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"states['optimizer'] is a {type(optimizer).__name__}, not an optimizer")
    return model, optimizer


def _others(states: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(dotted name, component)`` of every component but the model and optimizer."""
    return leaves({k: v for k, v in states.items() if k not in _TENSORS})


def _optimizer_record(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """The optimizer's class and layout (``CheckpointError`` for a parameter the model does
    not own)."""
    return {"type": k3_checkpoint.optimizer_identity(optimizer),
            "layout": k3_checkpoint.optimizer_layout(optimizer, model)}


def _skeleton(value: Any) -> Any:
    """The shape of a plain state, for the index: its mappings and lists as they are, a
    tensor as a note of its dtype and global shape, any other value as None. DCP writes no
    entry for an empty mapping, so the shards alone could not give the state back whole."""
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    if isinstance(value, dict):
        return {key: _skeleton(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_skeleton(item) for item in value]
    return None


def _tensor_paths(skeleton: Any, path: tuple[str | int, ...]) -> Iterator[tuple[str | int, ...]]:
    """Where a skeleton's tensors are; ``ValueError`` for a skeleton no save writes."""
    if isinstance(skeleton, Mapping):
        for key, node in skeleton.items():
            yield from _tensor_paths(node, (*path, str(key)))
    elif isinstance(skeleton, list):
        for index, node in enumerate(skeleton):
            yield from _tensor_paths(node, (*path, index))
    elif isinstance(skeleton, str):
        yield path
    elif skeleton is not None:
        raise ValueError(f"the shard index's structure holds a {type(skeleton).__name__} at "
                         f"{_dotted(path)}")


def _no_tensor(path: tuple[str | int, ...], live: Any) -> torch.Tensor:
    raise AssertionError(f"a template with no tensor met one at {_dotted(path)}")


def _fqns(table: Metadata) -> dict[tuple[str | int, ...], str]:
    """DCP's key of each saved path (its planner data), for names holding dots."""
    return {tuple(path): fqn for fqn, path in (table.planner_data or {}).items()}


def _dotted(path: Sequence[str | int]) -> str:
    return ".".join(map(str, path))


def _child(value: Any, key: str | int) -> Any:
    if isinstance(key, str) and isinstance(value, Mapping):
        return value.get(key)
    if isinstance(key, int) and isinstance(value, (list, tuple)) and key < len(value):
        return value[key]
    return None


def _put(tree: dict[str, Any], parts: Sequence[str], value: Any) -> None:
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _get(tree: Mapping[str, Any], parts: Sequence[str]) -> Any:
    node: Any = tree
    for part in parts:
        node = node[part]
    return node


def _place(root: Any, path: Sequence[str | int], value: Any) -> None:
    """Set ``value`` at ``path`` inside nested mappings and lists (all of it exists: DCP
    reads only what the state it was given holds)."""
    node = root
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: one process reading
    or writing a sharded checkpoint (``eval``, ``sample``, a resume on one device) is
    intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _flat(value: Any) -> str:
    """``a=1, b=2`` for a mapping of scalars (counters), else the value's repr, shortened."""
    if isinstance(value, Mapping) and all(
            not isinstance(item, (Mapping, list)) for item in value.values()):
        text = ", ".join(f"{key}={item}" for key, item in value.items())
    else:
        text = repr(value)
    return text if len(text) <= _VALUE_SHOWN else text[: _VALUE_SHOWN - 1] + "…"


def _listed(items: list[str], separator: str = ", ") -> str:
    if not items:
        return "none"
    return separator.join(items[:_SHOWN]) + (" …" if len(items) > _SHOWN else "")


def _size(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"
