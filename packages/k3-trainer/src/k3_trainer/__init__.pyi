"""Type stub of ``k3_trainer``'s lazily loaded public names: the one list of them
(``lazy_loader.attach_stub`` reads it at import; type checkers read it instead of
``__init__.py``)."""

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
from .evaluation import EvalResult, evaluate, evaluate_split
from .models import ModelSpec, get_model_spec, register_model
from .observe import MoEDiagnostics, TrainingProfiler, TrainingWindow, read_events
from .optim import build_optimizer
from .precision import FP16SkipHarness, validate_precision
from .schedule import learning_rate_at_step
from .state import TrainState
from .tasks import DownstreamTasks
from .trainer import Loaders, Trainer

__version__: str

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
