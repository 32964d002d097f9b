"""The shard index, and what a load checks before it changes anything.

``k3.ckpt``'s ``shards`` component is the folder's index; loading it verifies every shard
file's checksum (each rank its share), that the components asked for were saved (and, for
a resume, that nothing saved is left out), each optimizer's class and layout, and every
tensor's name, global shape and dtype against the live model and optimizer. Every check
raises ``ValueError`` on the first problem; nothing is read or restored before all pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import k3_checkpoint
from k3_checkpoint.layout import parameter_shaped

from ...distributed import Parallel
from .folder import META, file_entry
from .tree import dotted, saved_fqns, tensor_paths

_SHOWN = 5  # names listed in a message before "…"


def live_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None
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
class Expected:
    """What the live run needs of a folder's index, checked before anything changes."""

    components: list[str]
    """Every live component, by dotted name (``loaders.train``)."""
    subset: bool
    optimizers: dict[str, dict[str, Any]]
    """``{name: {"type", "layout"}}`` of the live optimizer (none when it is not read)."""
    tensors: dict[str, Any]
    """:func:`live_tensors`."""
    others: list[str]
    """The components read through their own ``load_state_dict``."""
    stage: int | None = None
    """This rank's pipeline rank under pipeline stages (None: the whole model here): the
    folder holds every stage's tensors and layouts, this rank checks its own."""
    pipeline: int = 1
    """The live run's pipeline ranks (``--pp``)."""


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
                 expected: Expected | None = None, parallel: Parallel | None = None
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
            if not isinstance(entry, Mapping) or file_entry(self.folder / name) != dict(entry):
                raise ValueError(f"shard file {name} does not match its recorded size and "
                                 "checksum: the checkpoint is corrupt")
        if self.expected is not None:  # the model's own mismatches first: the clearest
            check_tensor_table(self.folder, self.expected.tensors,
                               partial=self.expected.stage is not None)
        if "components" in saved:
            _check_record(saved, self.folder, self.expected)
        self.saved = dict(saved)


def _check_record(saved: Mapping[str, Any], folder: Path, expected: Expected | None) -> None:
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
    where = saved_fqns(table)
    for name, skeleton in structure.items():
        for path in tensor_paths(skeleton, tuple(str(name).split("."))):
            entry = table.state_dict_metadata.get(where.get(path, dotted(path)))
            if not isinstance(entry, TensorStorageMetadata):
                raise ValueError(f"component {name}: its tensor {dotted(path)} is not in "
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
        saved_layout = record.get("layout")
        stages = record.get("stages")
        saved_pp = len(stages) if isinstance(stages, list) else 1
        if saved_pp != expected.pipeline:
            # Each stage numbers its own parameter groups: another cut has other groups.
            raise ValueError(
                f"{name}: saved at --pp {saved_pp}, resumed at --pp {expected.pipeline}; "
                f"its state continues only at --pp {saved_pp} (resume with --pp "
                f"{saved_pp}, or start a new run from its weights: k3-train export, then "
                "train --init-from)")
        if expected.stage is not None:
            assert isinstance(stages, list)
            saved_layout = stages[expected.stage]
        _check_layout(name, saved_layout, live["layout"])


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


def check_tensor_table(folder: Path, live: dict[str, Any], *, partial: bool = False) -> None:
    """Raise ``ValueError`` unless the folder's tensors fit the live model and optimizer:
    the same model entries with the same global shapes and dtypes, and optimizer state only
    for live parameters, parameter-shaped (or shaped like its leading dims: per-row
    statistics) wherever it is more than a scalar. ``partial`` (one pipeline stage): the
    live entries must be there; the other stages' are not this rank's to check."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    table = FileSystemReader(folder).read_metadata().state_dict_metadata
    tensors = {key: (tuple(entry.size), entry.properties.dtype)
               for key, entry in table.items() if isinstance(entry, TensorStorageMetadata)}
    saved_model = {key: value for key, value in tensors.items() if key.startswith("model.")}
    wanted: dict[str, Any] = live["model"]
    missing = sorted(set(wanted) - set(saved_model))
    extra = [] if partial else sorted(set(saved_model) - set(wanted))
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
            if partial:
                continue
            stray.append(key[len("optimizer.state."):])
        elif (len(shape) > 0 and torch.Size(shape).numel() > 1
              and not parameter_shaped(shape, parameters[name])):
            wrong.append(f"{name}.{field} {list(shape)} vs {list(parameters[name])}")
    if stray:
        raise ValueError(f"optimizer state for parameters the optimizer lacks: "
                         f"{_listed(sorted(stray))}")
    if wrong:
        raise ValueError(f"tensors do not match the live model: {_listed(wrong)}")


def _listed(items: list[str], separator: str = ", ") -> str:
    if not items:
        return "none"
    return separator.join(items[:_SHOWN]) + (" …" if len(items) > _SHOWN else "")
