"""Sharded checkpoints: a ``torch.distributed.checkpoint`` folder under the format-7 gate.

Under FSDP2 no rank holds the whole state, and gathering it onto one would cap the model
at one host's memory. Every rank writes its own shards of the weights and optimizer state
with ``torch.distributed.checkpoint`` (DCP), keyed by parameter name and global shape, so
any world size can read them back (DCP reshards). Beside the shards, rank 0 writes
``k3.ckpt``: an ordinary format-7 checkpoint of everything else (counters, loader cursors,
scaler, RNG, the metadata the compatibility policy compares, optimizer class and layout)
plus the XXH3-128 checksum of every shard file (``k3_checkpoint.file_checksum``). The folder::

    checkpoint.dcp -> checkpoint.dcp.step-00000100/   (a symlink, replaced atomically)
        .metadata  __0_0.distcp  __1_0.distcp  k3.ckpt

Publishing is atomic: the ranks write into ``.checkpoint.dcp.tmp``, files fsynced; rank 0
adds ``k3.ckpt``, renames the folder to its step name and swaps the ``checkpoint.dcp``
symlink to it with one ``rename`` (then drops the previous folder). A crash at any point
leaves the previous checkpoint readable under the same name.

Loading checks before it changes anything: ``k3.ckpt`` through ``k3_checkpoint`` (checksum,
metadata under the policy), then, as that file's ``shards`` component, every shard file's
checksum (each rank hashes its share) and every tensor's name, global shape and dtype
against the live model and optimizer. Only after every rank has accepted are the tensors
read, straight into the live (possibly sharded) model and optimizer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import k3_checkpoint

from ..distributed import Parallel
from .agreement import Snapshot, load_on_every_rank, raise_on_every_rank

META = "k3.ckpt"
"""The format-7 file inside a sharded checkpoint folder."""

_SHOWN = 5  # names listed in a message before "…"


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """True for a sharded checkpoint folder (or the symlink naming one)."""
    return Path(path).is_dir()


# --- save ---------------------------------------------------------------------------------

def reshard(model: nn.Module) -> None:
    """Put every FSDP2 module of ``model`` back in its sharded state. A forward without a
    backward (evaluation) leaves the root's parameters gathered, and then its registered
    parameters are not the ones the optimizer holds."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def write_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                  components: Mapping[str, Any], metadata: Mapping[str, Any], step: int,
                  parallel: Parallel | None) -> str:
    """Write the sharded checkpoint ``path`` (call on every rank); returns the digest of its
    ``k3.ckpt``, the checkpoint's identity. Raises ``OSError`` on every rank when any rank
    failed to write; the previous checkpoint at ``path`` is then untouched."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    main = parallel is None or parallel.is_main
    staging = path.with_name(f".{path.name}.tmp")
    failure: OSError | None = None
    if main:  # a killed save's leftovers
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        except OSError as error:
            failure = error
    _agree(parallel, failure)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:
        with _single_process_quiet():
            save({"model": model_state, "optimizer": optimizer_state},
                 storage_writer=FileSystemWriter(staging, sync_files=True),
                 no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as error:  # the latter on every rank
        raise _os_error(error, staging) from error
    index = _hash_share(staging, parallel)
    digest = ""
    if main:
        try:
            digest = k3_checkpoint.save_checkpoint(
                staging / META, {"shards": ShardIndex(staging, index), **components},
                metadata, modules=[model])
            k3_checkpoint.fsync_directory(staging)
            _publish(staging, path, step)
        except OSError as error:
            failure = error
        except k3_checkpoint.CheckpointError as error:
            failure = OSError(0, str(error))
    _agree(parallel, failure)
    return digest


def _hash_share(folder: Path, parallel: Parallel | None) -> dict[str, dict[str, Any]]:
    """``{file: {"bytes", "xxh3_128"}}`` for every file DCP wrote; each rank hashes its share
    of the files and the ranks pool the results."""
    rank, world = (parallel.rank, parallel.world_size) if parallel is not None else (0, 1)
    try:
        names = sorted(p.name for p in folder.iterdir() if p.is_file())
        mine: dict[str, Any] = {name: _file_entry(folder / name) for name in names[rank::world]}
    except OSError as error:
        if parallel is None:
            raise
        mine = {"": f"rank {rank}: {error}"}  # every rank must still join the gather
    if parallel is None:
        return mine
    pooled: list[Any] = [None] * world
    dist.all_gather_object(pooled, mine)
    failed = [part[""] for part in pooled if "" in part]
    if failed:
        raise OSError(0, f"cannot hash the written shards ({'; '.join(failed)})")
    return {name: entry for part in pooled for name, entry in sorted(part.items())}


def _file_entry(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "xxh3_128": k3_checkpoint.file_checksum(path)}


def _publish(staging: Path, path: Path, step: int) -> None:
    """Rename ``staging`` to its step folder and point ``path`` at it in one rename."""
    if path.exists() and not path.is_symlink():
        raise OSError(0, f"{path} exists and is not the symlink a sharded checkpoint keeps; "
                         "move it away")
    previous = owned_target(path)
    final = path.with_name(f"{path.name}.step-{step:08d}")
    if final == previous:  # the same step saved again: never touch the live checkpoint
        final = final.with_name(f"{final.name}.again")
    if final.exists():  # a killed session got this far before, never published
        shutil.rmtree(final)
    os.rename(staging, final)
    link = path.with_name(f".{path.name}.link")
    link.unlink(missing_ok=True)
    os.symlink(final.name, link)
    k3_checkpoint.fsync_directory(path.parent)
    os.replace(link, path)
    k3_checkpoint.fsync_directory(path.parent)
    if previous is not None and previous.exists():
        shutil.rmtree(previous)


def owned_target(path: Path) -> Path | None:
    """The step folder the symlink ``path`` names, if it is one this module wrote (a
    sibling called ``<name>.step-…``); None for anything else, which is never deleted."""
    if not path.is_symlink():
        return None
    target = Path(os.readlink(path))
    if target.parent != Path(".") or not target.name.startswith(f"{path.name}.step-"):
        return None
    return path.parent / target


# --- load ---------------------------------------------------------------------------------

def read_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 components: Mapping[str, Any], metadata: Mapping[str, Any],
                 policy: k3_checkpoint.CompatibilityPolicy,
                 parallel: Parallel | None) -> k3_checkpoint.LoadedCheckpoint:
    """Validate the sharded checkpoint ``path`` on every rank, then restore ``components``,
    the model and the optimizer (call on every rank, including with one process).
    ``optimizer=None`` reads the model's tensors alone (``eval``, ``sample``).

    Raises ``k3_checkpoint.CheckpointError`` on every rank, with nothing changed on any,
    when any rank refuses it. The RNG is restored after the tensors, as the loader's last
    act (``k3.ckpt``'s loader restores it first; reading tensors draws no random number,
    and it is set again at the end, so the order cannot matter).
    """
    index = ShardIndex(path, live=_live_tensors(model, optimizer), parallel=parallel)
    snapshot = Snapshot(components)  # the cheap state: no tensor is read before agreement
    loaded = load_on_every_rank(
        path, parallel,
        lambda: k3_checkpoint.load_checkpoint(
            path / META, {"shards": index, **components}, metadata, policy, modules=[model]),
        snapshot.restore)
    resumed_rng = k3_checkpoint.capture_rng()
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        _read_tensors(path, model, optimizer)
    except (Exception, CheckpointException) as exc:  # every check passed: I/O failed
        raise k3_checkpoint.CheckpointError(
            "restore failed after every check passed, so the model and optimizer may be "
            f"partly restored; rebuild them before trying again ({type(exc).__name__}: "
            f"{exc})", path=path) from exc
    k3_checkpoint.restore_rng(resumed_rng)
    return loaded


def _read_tensors(path: Path, model: nn.Module,
                  optimizer: torch.optim.Optimizer | None) -> None:
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

    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        with _single_process_quiet():
            load(state, storage_reader=FileSystemReader(path), no_dist=not dist.is_initialized())
        set_model_state_dict(model, state["model"])
        return
    # get_state_dict gives a never-stepped optimizer its state with one lr=0 step; the
    # checkpoint then overwrites all of it.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    with _single_process_quiet():
        load(state, storage_reader=FileSystemReader(path), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    optimizer.zero_grad(set_to_none=True)


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


class ShardIndex:
    """The shard files of a sharded checkpoint as a ``k3.ckpt`` component.

    Saving: ``state_dict()`` is ``{"files": {name: {"bytes", "xxh3_128"}}}``. Loading:
    ``load_state_dict`` verifies this rank's share of the files (all of them with one
    process) against those checksums, and the folder's tensor table against the live model
    and optimizer, raising on the first problem; it runs before anything is restored.
    """

    def __init__(self, folder: Path, files: dict[str, Any] | None = None, *,
                 live: dict[str, Any] | None = None, parallel: Parallel | None = None
                 ) -> None:
        self.folder, self.files, self.live, self.parallel = folder, files, live, parallel

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.files is None else {"files": self.files}

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
        if self.live is not None:
            check_tensor_table(self.folder, self.live)
        self.files = dict(files)


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
    """``k3-train inspect`` of a sharded checkpoint: ``k3.ckpt``'s summary plus the shards,
    every file's checksum verified."""
    summary = k3_checkpoint.inspect_checkpoint(path / META)
    shards = summary.entries.get("shards")
    files = shards.get("files") if isinstance(shards, Mapping) else None
    if not isinstance(files, Mapping):
        raise k3_checkpoint.CheckpointError("has no shard file index", path=path / META)
    try:
        ShardIndex(path).load_state_dict(shards)
    except ValueError as error:
        raise k3_checkpoint.CheckpointError(str(error), path=path) from error
    table = _tensor_bytes(path)
    lines = [f"sharded        {Path(path)} -> {Path(path).resolve().name} "
             f"(torch.distributed.checkpoint, {len(files)} files, "
             f"{_size(sum(int(e['bytes']) for e in files.values()))}, every checksum verified)"]
    for key in ("model", "optimizer"):
        lines.append(f"{key:<14} {_size(table.get(key, 0))} of tensors (sharded)")
    lines += _expert_layout(summary.entries)
    lines += [line for line in summary.lines()
              if not line.startswith(("shards ", "checkpoint "))]
    return [summary.lines()[0], *lines]


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


def _tensor_bytes(folder: Path) -> dict[str, int]:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    totals: dict[str, int] = {}
    for key, entry in FileSystemReader(folder).read_metadata().state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            size = torch.Size(entry.size).numel() * entry.properties.dtype.itemsize
            root = key.split(".", 1)[0]
            totals[root] = totals.get(root, 0) + size
    return totals


# --- helpers -------------------------------------------------------------------------------

def _agree(parallel: Parallel | None, failure: OSError | None) -> None:
    raise_on_every_rank(parallel, failure, "another rank failed to write its part of the "
                                           "checkpoint (see its error line)")


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
    described = "; ".join(f"{who}{type(cause).__name__}: {(str(cause).splitlines() or [''])[0]}"
                          for who, cause in causes)
    return OSError(0, f"writing the shards into {where} failed ({described})")


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: one process reading
    or writing a sharded checkpoint (``eval``, ``sample``, a resume on one device) is
    intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _listed(items: list[str]) -> str:
    if not items:
        return "none"
    return ", ".join(items[:_SHOWN]) + (" …" if len(items) > _SHOWN else "")


def _size(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"
