"""``save_checkpoint``: one complete update boundary, written atomically."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .components import Components, Tree
from .errors import CheckpointError
from .packing import pack
from .payload import FORMAT_VERSION, write_payload
from .plain import to_plain
from .rng import capture_rng
from .runtime import runtime_signature

__all__ = ["RESERVED", "save_checkpoint"]

RESERVED = frozenset({"format_version", "runtime", "rng", "components"})
"""Payload keys the library fills itself (``components``: the names of the saved
components, so that a loader can restore some of them and tell the others from metadata)."""


def save_checkpoint(
    path: str | os.PathLike[str],
    components: Components,
    metadata: Mapping[str, Any] | None = None,
    *,
    modules: Sequence[torch.nn.Module] = (),
) -> str:
    """Write a format-7 checkpoint of ``components`` and ``metadata``; return its checksum
    (XXH3-128, hex).

    ``components`` maps names to objects with ``state_dict()``/``load_state_dict()`` (or to
    mappings of them); ``metadata`` is plain data the loader compares under its policy. The
    payload holds each component's state under its name, each metadata key, every optimizer's
    ``<name>_type``/``<name>_layout``, the runtime signature of the modules and every RNG.
    Call it at an update boundary, after ``optimizer.zero_grad(set_to_none=True)``: a live
    ``.grad`` means a half-accumulated attempt, which a checkpoint never holds. Everything is
    checked before the file is opened, so a refused save writes nothing.

    ``modules``: models whose state is kept elsewhere (the tensors of a sharded checkpoint)
    but whose devices and dtypes still belong in the runtime signature.
    """
    try:
        return write_payload(path, build_payload(components, metadata or {}, modules))
    except CheckpointError as error:
        raise error.with_path(path) from error


def build_payload(
    components: Components,
    metadata: Mapping[str, Any],
    modules: Sequence[torch.nn.Module] = (),
    copy: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The payload ``save_checkpoint`` writes (checked, plain, but not yet on disk), the
    components' small tensors packed side by side (``packing``). ``copy``: applied to the
    components' states before packing (a snapshot copies them off the live objects)."""
    tree = Tree(components)
    tree.require_no_gradients()
    structure = tree.structure()
    plain = to_plain(metadata, "metadata")
    if not isinstance(plain, dict):
        raise CheckpointError(f"metadata must be a mapping, got {type(metadata).__name__}")
    check_names(tree, plain)
    return {
        "format_version": FORMAT_VERSION,
        "components": sorted(tree.roots),
        **pack(tree.states() if copy is None else copy(tree.states())),
        **structure,
        **plain,
        "runtime": runtime_signature(*tree.modules.values(), *modules),
        "rng": capture_rng(),
    }


def check_names(tree: Tree, metadata: Mapping[str, Any]) -> None:
    """Component names, metadata keys and the library's own keys share the payload: no
    name may be used twice."""
    owners: dict[str, str] = dict.fromkeys(RESERVED, "reserved by the library")
    for kind, names in (
        ("a component", tree.roots),
        ("an optimizer record", list(tree.structure_keys())),
        ("a metadata key", list(metadata)),
    ):
        for name in names:
            if name in owners:
                raise CheckpointError(
                    f"payload key '{name}' is both {owners[name]} and {kind}; rename one"
                )
            owners[name] = kind
