"""Reading a sharded checkpoint folder back into the live run.

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

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import k3_checkpoint

from ...distributed import Parallel
from ..agreement import Snapshot, leaves, load_on_every_rank
from ..components import MODEL, OPTIMIZER, TENSOR_COMPONENTS
from .check import Expected, ShardIndex, live_tensors
from .dcp import (
    first_line,
    model_and_optimizer,
    no_dist,
    optimizer_record,
    other_components,
    single_process_quiet,
    stage_options,
    weights_only_planner,
)
from .folder import META
from .tree import dotted, get_at, put_at, saved_fqns, template

_LEGACY_METADATA = frozenset({"optimizer_type", "optimizer_layout"})


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
    model, optimizer = model_and_optimizer(states)
    others = other_components(states)
    expected = Expected(
        components=[name for name, _ in leaves(states)], subset=subset,
        optimizers={} if optimizer is None else {
            OPTIMIZER: optimizer_record(optimizer, model)},
        tensors=live_tensors(model, optimizer), others=[name for name, _ in others],
        stage=parallel.pipeline_rank if parallel is not None and parallel.pipeline > 1
        else None, pipeline=1 if parallel is None else parallel.pipeline)
    index = ShardIndex(folder, expected=expected, parallel=parallel)
    # The one rollback: every component read through load_state_dict and the RNG, as now.
    snapshot = Snapshot({k: v for k, v in states.items() if k not in TENSOR_COMPONENTS})
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
    model, optimizer = model_and_optimizer(states)
    small = {name: value for name, value in states.items() if name not in TENSOR_COMPONENTS}
    current = dict(metadata)
    if optimizer is not None:
        record = optimizer_record(optimizer, model)
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
        put_at(tree, name.split("."), state)
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
            f"{first_line(error)}); nothing was restored", path=folder) from error
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
            raise k3_checkpoint.ComponentRefused(
                f"{name} refused its saved state ({type(error).__name__}: {error}); nothing "
                "was restored", component=name, error=error, path=folder) from error


def _read_components(folder: Path, others: list[tuple[str, Any]], record: Mapping[str, Any],
                     parallel: Parallel | None) -> dict[str, Any]:
    """``{name: saved state}`` of ``others``, read from the shards into templates shaped
    by the saved structure: a tensor into an empty copy of the live one where it fits
    (a DTensor keeps its sharding), else into a whole one of the saved shape."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    reader = FileSystemReader(folder)
    table = reader.read_metadata()
    where = saved_fqns(table)

    def tensor(path: tuple[str | int, ...], live: Any) -> torch.Tensor:
        entry = table.state_dict_metadata[where.get(path, dotted(path))]
        size, dtype = entry.size, entry.properties.dtype  # type: ignore[union-attr]
        if isinstance(live, torch.Tensor) and live.shape == size and live.dtype == dtype:
            return torch.empty_like(live)
        return torch.empty(size, dtype=dtype)

    tree: dict[str, Any] = {}
    for name, component in others:
        parts = tuple(name.split("."))
        put_at(tree, parts, template(record["structure"][name], component.state_dict(), parts,
                                    tensor))
    with single_process_quiet():
        load(tree, storage_reader=reader, planner=weights_only_planner()(),
             no_dist=no_dist(parallel))
    return {name: get_at(tree, name.split(".")) for name, _ in others}


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
        with single_process_quiet():
            load(state, storage_reader=FileSystemReader(folder),
                 planner=weights_only_planner()(), no_dist=no_dist(parallel))

    if optimizer is None:
        state: dict[str, Any] = {MODEL: get_model_state_dict(model)}
        read(state)
        set_model_state_dict(model, state[MODEL])
        return
    # get_state_dict gives a never-stepped optimizer its state with one lr=0 step; the
    # checkpoint then overwrites all of it.
    options = stage_options(parallel)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    state = {MODEL: model_state, OPTIMIZER: optimizer_state}
    read(state)
    set_state_dict(model, optimizer, model_state_dict=state[MODEL],
                   optim_state_dict=state[OPTIMIZER], options=options)
    optimizer.zero_grad(set_to_none=True)
