"""Writing a sharded checkpoint folder on the calling thread.

Writing: the caller creates the empty folder; every rank writes its shards, fsynced; each
rank hashes its share of the files; rank 0 writes ``k3.ckpt`` last and fsyncs the folder. A
failure on any rank is an ``OSError`` on every rank. What a write puts in the folder
(:func:`prepare`) and how it ends (:func:`seal`) are shared with a background write
(:mod:`.background`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import k3_checkpoint

from ...distributed import Parallel
from ..agreement import leaves, raise_on_every_rank
from ..components import MODEL, OPTIMIZER
from .check import ShardIndex
from .dcp import (
    first_line,
    is_main,
    model_and_optimizer,
    no_dist,
    optimizer_record,
    other_components,
    single_process_quiet,
    stage_options,
)
from .folder import META, hash_files
from .tree import put_at, skeleton

_ELSEWHERE = "another rank failed to write its part of the checkpoint (see its error line)"


def reshard(model: nn.Module) -> None:
    """Put every FSDP2 module of ``model`` back in its sharded state. A forward without a
    backward (evaluation) leaves the root's parameters gathered, and then its registered
    parameters are not the ones the optimizer holds."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@dataclass(frozen=True)
class Prepared:
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
        prepared = prepare(states, parallel)
    except OSError as error:
        failure = error
    agree(parallel, failure)
    assert prepared is not None
    try:
        with single_process_quiet():
            save(prepared.state, storage_writer=FileSystemWriter(folder, sync_files=True),
                 no_dist=no_dist(parallel))
    except (Exception, CheckpointException) as error:  # the latter on every rank
        raise as_os_error(error, folder) from error
    model, record = prepared.model, prepared.record

    def write_meta(files: dict[str, Any]) -> str:
        return k3_checkpoint.save_checkpoint(
            folder / META, {"shards": ShardIndex(folder, {**record, "files": files})},
            metadata, modules=[model])

    return seal(folder, write_meta if is_main(parallel) else None, parallel, None)


def prepare(states: Mapping[str, Any], parallel: Parallel | None = None) -> Prepared:
    """The state DCP writes and the shard index's record; ``OSError`` (errno 0) for states
    a checkpoint cannot hold. Under pipeline stages (call on every rank) the optimizer's
    record adds every stage's layout (``stages``), so each stage checks its own on load."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model, optimizer = model_and_optimizer(states)
    if optimizer is not None:
        failure: OSError | None = None
        try:
            optimizers = {OPTIMIZER: optimizer_record(optimizer, model)}
        except k3_checkpoint.CheckpointError as error:
            failure, optimizers = OSError(0, str(error)), {}
        _add_stage_layouts(optimizers, parallel)  # a collective: before raising
        if failure is not None:
            raise failure
        model_state, optimizer_state = get_state_dict(model, optimizer,
                                                      options=stage_options(parallel))
        state: dict[str, Any] = {MODEL: model_state, OPTIMIZER: optimizer_state}
    else:
        state, optimizers = {MODEL: get_model_state_dict(model)}, {}
    structure: dict[str, Any] = {}
    for name, component in other_components(states):
        if isinstance(component, torch.optim.Optimizer):
            raise OSError(0, f"component '{name}' is a second optimizer; a sharded checkpoint "
                             "keeps one, under 'optimizer'")
        try:
            value = k3_checkpoint.to_plain(component.state_dict(), name, tensors=True)
        except k3_checkpoint.CheckpointError as error:
            raise OSError(0, str(error)) from error
        put_at(state, name.split("."), value)
        structure[name] = skeleton(value)
    names = [name for name, _ in leaves(states)]
    return Prepared(state, {"components": sorted(names), "optimizers": optimizers,
                             "structure": structure}, model)


def _add_stage_layouts(optimizers: dict[str, Any], parallel: Parallel | None) -> None:
    """Every pipeline stage's optimizer layout, in stage order, into the record (rank 0
    writes it, holding only the first stage); nothing without stages."""
    if parallel is None or parallel.pipeline == 1:
        return
    import torch.distributed as dist

    record = optimizers.get(OPTIMIZER)
    gathered: list[Any] = [None] * parallel.pipeline
    dist.all_gather_object(gathered, None if record is None else record["layout"],
                           group=parallel.pipeline_group)
    if record is not None:
        record["stages"] = gathered


def seal(folder: Path, write_meta: Callable[[dict[str, Any]], str] | None,
          parallel: Parallel | None, group: Any) -> str:
    """Hash the shards (each rank its share), then rank 0 (``write_meta``) writes
    ``k3.ckpt`` and fsyncs the folder; the ranks agree on the outcome through ``group``
    (None: the default group, on the training thread)."""
    files = hash_files(folder, parallel, group)
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
        agree(parallel, failure)
    elif parallel is not None:
        flag = torch.tensor([0.0 if failure is None else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item():
            raise failure if failure is not None else OSError(0, _ELSEWHERE)
    elif failure is not None:
        raise failure
    return digest


def agree(parallel: Parallel | None, failure: OSError | None) -> None:
    raise_on_every_rank(parallel, failure, _ELSEWHERE)


def as_os_error(error: BaseException, where: Path) -> OSError:
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
    described = "; ".join(f"{who}{type(cause).__name__}: {first_line(cause)}"
                          for who, cause in causes)
    return OSError(0, f"writing the shards into {where} failed ({described})")
