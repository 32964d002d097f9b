"""k3-trainer: the K3 training runner — the ``Trainer`` and its callbacks, data, evaluation,
checkpoints, observation and the ``k3-train`` command, on one device or many (torchrun)."""

from importlib.metadata import PackageNotFoundError, version

from .callbacks import Callback
from .checkpoint import TRAINER_POLICY, Checkpointer, CheckpointWriteError, Resumed
from .config import ConfigError, TrainConfig
from .contract import K3TrainerModel, ModelContract, TrainableModel, check_model
from .data import (
    DataError,
    DataExhausted,
    PrepareOptions,
    TokenDataLoader,
    builtin_corpus,
    prepare_dataset,
    read_manifest,
)
from .evaluate import EvalResult, evaluate, evaluate_split
from .observe import (
    LogLines,
    MetricsLog,
    MoEDiagnostics,
    ProfilerWindow,
    ProgressBar,
    Report,
    TensorBoard,
    TrainingProfiler,
    TrainingWindow,
    read_events,
)
from .optim import build_optimizer
from .precision import FP16SkipHarness, validate_precision
from .schedule import learning_rate_at_step
from .state import TrainState
from .trainer import Loaders, Trainer

try:
    __version__ = version("k3-trainer")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"

__all__ = [
    "TRAINER_POLICY",
    "Callback",
    "CheckpointWriteError",
    "Checkpointer",
    "ConfigError",
    "DataError",
    "DataExhausted",
    "EvalResult",
    "FP16SkipHarness",
    "K3TrainerModel",
    "Loaders",
    "LogLines",
    "MetricsLog",
    "MoEDiagnostics",
    "ModelContract",
    "PrepareOptions",
    "ProfilerWindow",
    "ProgressBar",
    "Report",
    "Resumed",
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
    "learning_rate_at_step",
    "prepare_dataset",
    "read_events",
    "read_manifest",
    "validate_precision",
]
