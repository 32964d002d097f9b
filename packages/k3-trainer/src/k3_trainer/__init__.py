"""k3-trainer: the one-device K3 training runner (loop, data, evaluation, checkpoints, CLI)."""

from importlib.metadata import PackageNotFoundError, version

from .checkpointing import (
    TRAINER_POLICY,
    CheckpointWriteError,
    load_checkpoint,
    save_checkpoint,
)
from .config import ConfigError, TrainConfig, TrainState
from .data import DataError, DataExhausted, TokenDataLoader, read_manifest
from .diagnostics import MoEDiagnostics
from .evaluate import EvalResult, evaluate, evaluate_split
from .loop import train
from .metrics import MetricsLog, read_events
from .optim import build_optimizer
from .precision import FP16SkipHarness, validate_precision
from .prepare import builtin_corpus, prepare_dataset
from .profiling import TrainingProfiler
from .schedule import learning_rate_at_step
from .window import TrainingWindow

try:
    __version__ = version("k3-trainer")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"

__all__ = [
    "TRAINER_POLICY",
    "CheckpointWriteError",
    "ConfigError",
    "DataError",
    "DataExhausted",
    "EvalResult",
    "FP16SkipHarness",
    "MetricsLog",
    "MoEDiagnostics",
    "TokenDataLoader",
    "TrainConfig",
    "TrainState",
    "TrainingProfiler",
    "TrainingWindow",
    "__version__",
    "build_optimizer",
    "builtin_corpus",
    "evaluate",
    "evaluate_split",
    "learning_rate_at_step",
    "load_checkpoint",
    "prepare_dataset",
    "read_events",
    "read_manifest",
    "save_checkpoint",
    "train",
    "validate_precision",
]
