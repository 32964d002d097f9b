"""k3-trainer: the K3 training runner — the ``Trainer`` and its callbacks, data, evaluation,
checkpoints, observation and the ``k3-train`` command, on one device or many (torchrun).

The public names load on first use (PEP 562), so ``k3-train --help`` and argument errors
answer without importing torch.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .callbacks import (
        Callback,
        DownstreamEvaluator,
        LogLines,
        MetricsLog,
        ProfilerWindow,
        ProgressBar,
        Report,
        Run,
        TensorBoard,
    )
    from .checkpoint import (
        TRAINER_POLICY,
        Checkpointer,
        CheckpointWriteError,
        Resumed,
    )
    from .config import (
        ConfigError,
        TrainConfig,
    )
    from .contract import (
        K3TrainerModel,
        ModelContract,
        TrainableModel,
        check_model,
    )
    from .data import (
        DataError,
        DataExhausted,
        PrepareOptions,
        TokenDataLoader,
        builtin_corpus,
        prepare_dataset,
        read_manifest,
    )
    from .evaluation import (
        EvalResult,
        evaluate,
        evaluate_split,
    )
    from .models import (
        ModelSpec,
        get_model_spec,
        register_model,
    )
    from .observe import (
        MoEDiagnostics,
        TrainingProfiler,
        TrainingWindow,
        read_events,
    )
    from .optim import (
        build_optimizer,
    )
    from .precision import (
        FP16SkipHarness,
        validate_precision,
    )
    from .schedule import (
        learning_rate_at_step,
    )
    from .state import (
        TrainState,
    )
    from .tasks import DownstreamTasks
    from .trainer import (
        Loaders,
        Trainer,
    )

_EXPORTS = {
    "Callback": ".callbacks",
    "DownstreamEvaluator": ".callbacks",
    "DownstreamTasks": ".tasks",
    "Run": ".callbacks",
    "CheckpointWriteError": ".checkpoint",
    "Checkpointer": ".checkpoint",
    "Resumed": ".checkpoint",
    "TRAINER_POLICY": ".checkpoint",
    "ConfigError": ".config",
    "TrainConfig": ".config",
    "K3TrainerModel": ".contract",
    "ModelContract": ".contract",
    "TrainableModel": ".contract",
    "check_model": ".contract",
    "DataError": ".data",
    "DataExhausted": ".data",
    "PrepareOptions": ".data",
    "TokenDataLoader": ".data",
    "builtin_corpus": ".data",
    "prepare_dataset": ".data",
    "read_manifest": ".data",
    "EvalResult": ".evaluation",
    "evaluate": ".evaluation",
    "evaluate_split": ".evaluation",
    "LogLines": ".callbacks",
    "MetricsLog": ".callbacks",
    "MoEDiagnostics": ".observe",
    "ProfilerWindow": ".callbacks",
    "ProgressBar": ".callbacks",
    "Report": ".callbacks",
    "TensorBoard": ".callbacks",
    "TrainingProfiler": ".observe",
    "TrainingWindow": ".observe",
    "read_events": ".observe",
    "ModelSpec": ".models",
    "get_model_spec": ".models",
    "register_model": ".models",
    "build_optimizer": ".optim",
    "FP16SkipHarness": ".precision",
    "validate_precision": ".precision",
    "learning_rate_at_step": ".schedule",
    "TrainState": ".state",
    "Loaders": ".trainer",
    "Trainer": ".trainer",
}

try:
    __version__ = version("k3-trainer")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'k3_trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "TRAINER_POLICY",
    "Callback",
    "CheckpointWriteError",
    "Checkpointer",
    "ConfigError",
    "DataError",
    "DataExhausted",
    "DownstreamEvaluator",
    "DownstreamTasks",
    "EvalResult",
    "FP16SkipHarness",
    "K3TrainerModel",
    "Loaders",
    "LogLines",
    "MetricsLog",
    "MoEDiagnostics",
    "ModelContract",
    "ModelSpec",
    "PrepareOptions",
    "ProfilerWindow",
    "ProgressBar",
    "Report",
    "Resumed",
    "Run",
    "TensorBoard",
    "TokenDataLoader",
    "TrainConfig",
    "TrainState",
    "TrainableModel",
    "Trainer",
    "TrainingProfiler",
    "TrainingWindow",
    "__version__",
    "build_optimizer",
    "builtin_corpus",
    "check_model",
    "evaluate",
    "evaluate_split",
    "get_model_spec",
    "learning_rate_at_step",
    "prepare_dataset",
    "read_events",
    "read_manifest",
    "register_model",
    "validate_precision",
]
