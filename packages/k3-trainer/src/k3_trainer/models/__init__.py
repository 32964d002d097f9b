"""Model families by name: :class:`ModelSpec` and its registry (``k3-train train --model``).

K3 is one registered spec (:mod:`k3_trainer.models.k3`, the one module of the trainer
that imports ``k3_model``); a program adds its own with :func:`register_model`, an
installed package through the ``k3_trainer.models`` entry-point group.
"""

from .registry import (
    DEFAULT_MODEL,
    ENTRY_POINT_GROUP,
    get_model_spec,
    model_names,
    register_model,
    spec_for_model_type,
    unregister_model,
)
from .spec import (
    ContextParallelHooks,
    ExpertParallel,
    HubFolderError,
    HubFormat,
    ModelSpec,
    PipelineHooks,
)

__all__ = ["DEFAULT_MODEL", "ENTRY_POINT_GROUP", "ContextParallelHooks", "ExpertParallel",
           "HubFolderError", "HubFormat", "ModelSpec", "PipelineHooks", "get_model_spec",
           "model_names", "register_model", "spec_for_model_type", "unregister_model"]
