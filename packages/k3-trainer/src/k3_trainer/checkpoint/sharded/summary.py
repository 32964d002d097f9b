"""``k3-train inspect`` of a sharded checkpoint folder.

``k3.ckpt``'s summary, then one line per component in the shards (its tensor bytes, or
the values of one that holds no tensor, read as a load reads them: plain data only), and
the expert-parallel layout the run saved with; every file's checksum is verified first.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import k3_checkpoint

from ..components import TENSOR_COMPONENTS
from .check import ShardIndex
from .dcp import single_process_quiet, weights_only_planner
from .folder import META
from .tree import get_at, no_tensor, put_at, template, tensor_paths


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
    total = k3_checkpoint.format_bytes(sum(int(e["bytes"]) for e in files.values()))
    lines = [f"sharded        {folder} -> {folder.resolve().name} "
             f"(torch.distributed.checkpoint, {len(files)} files, {total}, every checksum "
             "verified)"]
    if "components" in shards:
        lines += _describe_components(folder, shards)
    else:  # the previous layout: the small components are k3.ckpt's own lines
        table = _tensor_bytes(folder, [(key,) for key in TENSOR_COMPONENTS])
        lines += [f"{key:<14} {k3_checkpoint.format_bytes(table.get((key,), 0))} of tensors "
                  "(sharded)" for key in TENSOR_COMPONENTS]
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
    plain = [name for name in names if name not in TENSOR_COMPONENTS
             and not any(tensor_paths(structure[name], ()))]
    tree: dict[str, Any] = {}
    for name in plain:
        put_at(tree, name.split("."), template(structure[name], None, (), no_tensor))
    if tree:
        with single_process_quiet():
            load(tree, storage_reader=FileSystemReader(folder),
                 planner=weights_only_planner()(), no_dist=True)
    lines = []
    for name in names:
        size = table.get(tuple(name.split(".")), 0)
        text = k3_checkpoint.format_value(get_at(tree, name.split("."))) if name in plain else (
            f"{k3_checkpoint.format_bytes(size)} of tensors (sharded)")
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
