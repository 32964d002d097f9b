"""What a run's checkpoint records beside its components, and what a resume accepts.

The metadata (train config, vocabulary, model config, QK-Clip policy and geometry, the
data-parallel layout) is compared on resume under :data:`TRAINER_POLICY`; nothing of it is
restored. ``allow_runtime_change`` relaxes the policy by :func:`relaxed`; commands that
only read the weights (``eval``, ``sample``, ``export``) use :data:`READ_ONLY`.
"""

from __future__ import annotations

from typing import Any

import k3_checkpoint
from k3_qkclip import QKClip, QKClipPolicy

from ..config import ConfigError, TrainConfig
from ..contract import ModelContract
from ..distributed import Parallel
from .components import COUNTERS

# Fields that may change on resume without touching the training trajectory: intervals
# only decide when to log/evaluate/save, how a checkpoint is written and how many are kept
# change no state, evaluation restores every RNG it touches, and
# activation checkpointing recomputes bitwise what it drops (tested). max_steps may move
# either way as long as it stays at or above the saved step (the step limit): the schedule,
# including the cosine horizon, must be identical, and so must `compile` (its kernels round
# differently from eager ones). The expert-parallel degree is part of the data-parallel
# layout, which is compared (and relaxed by --allow-runtime-change) as ``data_parallel``.
TRAINER_POLICY = k3_checkpoint.CompatibilityPolicy(
    may_differ=frozenset(f"train_config.{name}" for name in (
        "max_steps", "log_interval", "eval_interval", "checkpoint_interval", "eval_batches",
        "eval_tokens", "async_checkpoint", "keep_last", "keep_every",
        "activation_checkpointing", "expert_parallel", "pipeline_parallel",
        "pp_schedule", "pp_microbatches", "pp_stages_per_rank", "downstream", "downstream_interval",
        "downstream_limit", "context_parallel")),
    step_limit=("train_config.max_steps", f"{COUNTERS}.step"),
)

PHASE_MAY_CHANGE = frozenset(f"train_config.{name}" for name in (
    "lr_schedule", "decay_steps", "decay_fraction", "decay_shape", "min_lr_ratio",
    "document_masking"))
"""What a new phase of a run (``Trainer.resume(new_phase=True)``, ``--phase``) may change
beside :data:`TRAINER_POLICY`'s fields: the decay and whether documents are kept apart.
Its loaders may read other data too (a mixture loader built with ``adopt``)."""


def phase_policy(policy: k3_checkpoint.CompatibilityPolicy
                 ) -> k3_checkpoint.CompatibilityPolicy:
    """``policy`` that also accepts a new phase's changes (:data:`PHASE_MAY_CHANGE`)."""
    return k3_checkpoint.CompatibilityPolicy(
        may_grow=policy.may_grow, may_differ=policy.may_differ | PHASE_MAY_CHANGE,
        step_limit=policy.step_limit, runtime_may_differ=policy.runtime_may_differ,
        check=policy.check)


PORTABLE_RUNTIME = frozenset({"torch_version", "cuda_version", "device_type", "num_threads"})
"""Runtime-signature keys that legitimately differ between machines; ``allow_runtime_change``
accepts a change in these (and gives up bitwise continuation). Dtypes and determinism
settings are the run's own choices and stay strict."""

RUNTIME_METADATA = ("runtime", "rng", "data_parallel")
"""What ``allow_runtime_change`` may accept as changed, and what a ``runtime_changed`` event
reports: the runtime signature, CUDA generator states, and the data-parallel layout
(another world size or mode; sharded checkpoints are resharded on load)."""

def relaxed(policy: k3_checkpoint.CompatibilityPolicy) -> k3_checkpoint.CompatibilityPolicy:
    """``policy`` that also accepts another portable runtime and data-parallel layout."""
    return k3_checkpoint.CompatibilityPolicy(
        may_grow=policy.may_grow, may_differ=policy.may_differ | {"data_parallel"},
        step_limit=policy.step_limit,
        runtime_may_differ=policy.runtime_may_differ | PORTABLE_RUNTIME, check=policy.check)


_RELAXED = relaxed(TRAINER_POLICY)
READ_ONLY = k3_checkpoint.CompatibilityPolicy(
    may_grow=_RELAXED.may_grow, may_differ=_RELAXED.may_differ | {"train_config"},
    runtime_may_differ=_RELAXED.runtime_may_differ, check=_RELAXED.check)
"""For ``eval``, ``sample``, ``export`` and ``inspect``: the model is compared as for a
resume (its config, the vocabulary, QK-Clip's geometry), under any portable runtime and
data-parallel layout, but not the recipe: a step kept from before a phase (another decay,
another mixture) is read with its own train config. Which components they read follows
from what they ask for (a ``subset`` :class:`~k3_trainer.checkpoint.Checkpointer`): the
model and the counters; the optimizer and the loaders' cursors, which only a resume
needs, are neither built nor read."""


def qk_clip_policy(config: TrainConfig) -> QKClipPolicy:
    return QKClipPolicy(enabled=config.qk_clip_enabled, tau=config.qk_clip_tau,
                        gqa=config.qk_clip_gqa)


def run_metadata(contract: ModelContract, config: TrainConfig,
                 parallel: Parallel | None = None,
                 geometry: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a resume compares (under :data:`TRAINER_POLICY`) but does not restore. A
    data-parallel run adds its layout (``data_parallel``: mode, world size), so a
    one-process checkpoint stays byte-for-byte what it was. ``geometry``: the whole
    model's QK-Clip geometry when ``contract.model`` is one pipeline stage's cut."""
    policy = qk_clip_policy(config)
    extra = {"data_parallel": parallel.describe()} if parallel is not None else {}
    if geometry is None:
        try:
            geometry = QKClip(contract.model, policy).geometry()
        except ValueError as error:  # QK-Clip on, and no attention declares its geometry
            raise ConfigError(str(error)) from None
    return {
        **extra,
        "train_config": config.to_dict(),
        "vocab_size": contract.vocab_size,  # before model_config: the clearer refusal
        "model_config": contract.model_config(),
        "qk_clip": {"policy": policy.to_dict(),
                    "geometry": geometry},
    }


LAYOUT_DEFAULTS = {"mode": "none", "world_size": 1, "expert_parallel": 1, "pp": 1, "cp": 1}
"""The data-parallel layout fields a checkpoint does not record: a one-process run records
no layout, a run without expert parallelism no degree."""


def runtime_changes(loaded: k3_checkpoint.LoadedCheckpoint) -> dict[str, tuple[Any, Any]]:
    """The accepted runtime differences, one per leaf: a layout field one side does not
    record reads as its default (:data:`LAYOUT_DEFAULTS`: one process, no expert
    parallelism)."""
    changes: dict[str, tuple[Any, Any]] = {}
    for key in RUNTIME_METADATA:
        for path, (saved, current) in loaded.changes_under(key).items():
            if path == "data_parallel":
                saved = {**LAYOUT_DEFAULTS, **(saved if isinstance(saved, dict) else {})}
                current = {**LAYOUT_DEFAULTS, **(current if isinstance(current, dict) else {})}
                changes.update({f"{path}.{field}": (saved[field], current[field])
                                for field in LAYOUT_DEFAULTS if saved[field] != current[field]})
            elif path.startswith("data_parallel."):
                fill = LAYOUT_DEFAULTS.get(path.removeprefix("data_parallel."))
                changes[path] = (fill if saved is k3_checkpoint.MISSING else saved,
                                 fill if current is k3_checkpoint.MISSING else current)
            else:
                changes[path] = (saved, current)
    return changes
