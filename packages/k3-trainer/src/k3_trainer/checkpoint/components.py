"""The names of a run's checkpoint components, declared once.

A checkpoint keeps each component's state under its name, so the names are part of the
format: every place that builds, writes or reads the components takes them from here.
:meth:`~k3_trainer.Trainer.states` builds the run's ``{name: component}`` from them (the
one list of what a checkpoint holds), a sharded checkpoint writes the
:data:`TENSOR_COMPONENTS` through DCP's state-dict API and every other one under its own
name, and the commands that continue no training read :func:`read_only_states` alone.
"""

from __future__ import annotations

from typing import Any

MODEL = "model"
OPTIMIZER = "optimizer"
COUNTERS = "counters"
"""The run's :class:`~k3_trainer.state.TrainState` (its ``step`` is a resume's step limit)."""
GRAD_SCALER = "grad_scaler"
LOADERS = "loaders"
"""A group: ``loaders.train`` and ``loaders.val``, each its cursor."""
CALLBACKS = "callbacks"
"""A group of the stateful callbacks, by name; present only when one is stateful."""

TENSOR_COMPONENTS = (MODEL, OPTIMIZER)
"""The components a sharded checkpoint reads and writes through DCP's state-dict API
(every rank its part, keyed by parameter name and global shape)."""

READ_ONLY_COMPONENTS = (MODEL, COUNTERS)
"""What a command that continues no training (``eval``, ``sample``, ``export``) reads: the
weights and the counters; the optimizer and the loaders' cursors, which only a resume
needs, are neither built nor read."""


def read_only_states(model: Any, counters: Any) -> dict[str, Any]:
    """The ``states`` of a read-only load (a ``subset``
    :class:`~k3_trainer.checkpoint.Checkpointer`): :data:`READ_ONLY_COMPONENTS`."""
    return dict(zip(READ_ONLY_COMPONENTS, (model, counters), strict=True))
