"""``load_checkpoint``: read, validate everything, and only then restore, RNG last."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .compatibility import Changes, CompatibilityPolicy
from .components import Components, Tree
from .errors import CheckpointError
from .payload import read_verified
from .plain import to_plain
from .rng import cuda_device_count, validate_rng_state
from .runtime import runtime_signature
from .save import RESERVED, check_names

__all__ = ["LoadedCheckpoint", "load_checkpoint"]


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What ``load_checkpoint`` found; the components and the RNG are already restored."""

    path: Path
    digest: str
    """The file's XXH3-128 checksum in hex (sha256 for a 0.1.x file): the checkpoint's
    identity, for run provenance."""
    metadata: dict[str, Any]
    """The saved metadata, ``runtime`` and optimizer types included (the current one may
    differ where the policy allows)."""
    accepted_changes: Changes
    """Every difference the policy accepted: ``{path: (saved, current)}``, e.g.
    ``{"runtime.num_threads": (16, 8)}``; ``rng.torch_cuda`` when CUDA states were skipped."""

    def changes_under(self, prefix: str) -> Changes:
        """The accepted changes below one metadata key, e.g. ``changes_under("runtime")``."""
        return {
            path: change
            for path, change in self.accepted_changes.items()
            if path == prefix or path.startswith(prefix + ".")
        }


def load_checkpoint(
    path: str | os.PathLike[str],
    components: Components,
    metadata: Mapping[str, Any] | None = None,
    policy: CompatibilityPolicy | None = None,
    *,
    modules: Sequence[torch.nn.Module] = (),
    subset: bool = False,
) -> LoadedCheckpoint:
    """Resume ``components`` and the global RNG from ``path``.

    First every check, each raising ``CheckpointError`` and changing nothing: metadata (the
    caller's, the runtime signature, optimizer classes) under ``policy`` (default: exact
    equality), a saved state for each component, optimizer layouts and state structure,
    module state keys/shapes/dtypes, and RNG state. Then the restore: components judged by
    their own ``load_state_dict`` (loader cursors, counters...), all or none; modules and
    optimizers (with the checkpoint's hyperparameters), gradients cleared; the RNG last, so
    draws made while building or restoring cannot shift the resumed streams. ``modules``:
    as for ``save_checkpoint``, models in the runtime signature but not restored here.

    ``subset``: ``components`` are the ones wanted, some of those saved (an evaluation reads
    the model without the optimizer); the other saved components and their optimizer
    records are neither read nor compared. Without it, every saved component needs a live
    one: a resume restores everything or nothing.
    """
    policy = CompatibilityPolicy() if policy is None else policy
    payload, digest = read_verified(path)  # the file's own problems first
    try:
        tree = Tree(components)
        current = to_plain(metadata or {}, "metadata")
        check_names(tree, current)
        structure = tree.structure()
        current.update({f"{name}_type": structure[f"{name}_type"] for name in tree.optimizers})
        current["runtime"] = runtime_signature(*tree.modules.values(), *modules)
    except CheckpointError as error:  # the live objects' problems
        raise error.with_path(path) from error
    try:
        others = _unwanted_components(payload, tree, current, subset)
        saved_metadata = {
            key: value
            for key, value in payload.items()
            if key not in RESERVED | set(tree.roots) | {f"{n}_layout" for n in tree.optimizers}
            | others
        }
        saved_metadata["runtime"] = payload.get("runtime")
        accepted = policy.compare(saved_metadata, current, payload)
        saved = tree.check(payload, structure)
        cuda_may_differ = "device_type" in policy.runtime_may_differ
        saved_rng: Any = payload.get("rng")
        rng = validate_rng_state(saved_rng, cuda_may_differ=cuda_may_differ)
        skipped = len(saved_rng["torch_cuda"]), cuda_device_count()
        if saved_rng["torch_cuda"] and skipped[0] != skipped[1]:
            accepted["rng.torch_cuda"] = (f"{skipped[0]} devices", f"{skipped[1]} devices")
        tree.restore_others(saved)
    except CheckpointError as error:
        raise error.with_path(path) from error
    try:
        tree.restore_torch(saved)
        rng.restore()
    except Exception as error:  # validation should make this unreachable
        raise CheckpointError(
            "restore failed after every check passed, so the components may be partly "
            f"restored; rebuild them before trying again ({type(error).__name__}: {error})",
            path=path,
        ) from error
    return LoadedCheckpoint(Path(path), digest, saved_metadata, accepted)


def _unwanted_components(
    payload: Mapping[str, Any], tree: Tree, current: Mapping[str, Any], subset: bool
) -> set[str]:
    """The payload keys of saved components a ``subset`` load leaves unread (each one's
    state and optimizer records); raise when a full load has no live component for one.

    A file written before payloads named their components (0.1.0) has them
    inferred: every key that is neither the library's nor current metadata is one."""
    saved = payload.get("components")
    if isinstance(saved, list):
        names = {name for name in saved if isinstance(name, str)}
    elif subset:
        keys = set(payload) - RESERVED - set(current)
        names = {key for key in keys if not any(
            key == f"{owner}_{kind}" for owner in keys for kind in ("type", "layout"))}
    else:
        return set()  # an older file's extra components show as metadata differences
    unwanted = names - set(tree.roots)
    if unwanted and not subset:
        raise CheckpointError(
            f"the checkpoint holds components this load has none for: {sorted(unwanted)} "
            f"(live: {sorted(tree.roots)}); a resume restores every saved component"
        )
    return unwanted | {f"{name}_{kind}" for name in unwanted for kind in ("type", "layout")}
