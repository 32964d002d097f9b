"""k3-checkpoint: format-7 checkpoints with atomic writes and a validate-before-mutate loader.

A checkpoint is one complete update boundary of a training run: the state of every stateful
component (model, optimizer, loaders, counters...), the caller's metadata, every RNG and the
runtime it ran under, behind an XXH3-128 checksum. ``load_checkpoint`` checks all of it against the
live run before changing anything.
"""

from importlib.metadata import PackageNotFoundError, version

from .compatibility import Changes, CompatibilityPolicy
from .components import Components, Stateful
from .errors import CheckpointError, ComponentRefused, IncompatibleCheckpoint
from .integrity import file_checksum
from .layout import optimizer_identity, optimizer_layout
from .load import LoadedCheckpoint, load_checkpoint
from .payload import FORMAT_VERSION, HISTORICAL_FORMATS, fsync_directory, read_payload
from .plain import MISSING, to_plain
from .rng import ValidRng, capture_rng, restore_rng, validate_rng_state
from .runtime import runtime_signature
from .save import save_checkpoint
from .snapshot import CheckpointSnapshot, snapshot_checkpoint
from .summary import CheckpointSummary, format_bytes, format_value, inspect_checkpoint

try:
    __version__ = version("k3-checkpoint")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"

__all__ = [
    "FORMAT_VERSION",
    "HISTORICAL_FORMATS",
    "MISSING",
    "Changes",
    "CheckpointError",
    "CheckpointSnapshot",
    "CheckpointSummary",
    "CompatibilityPolicy",
    "ComponentRefused",
    "Components",
    "IncompatibleCheckpoint",
    "LoadedCheckpoint",
    "Stateful",
    "ValidRng",
    "__version__",
    "capture_rng",
    "file_checksum",
    "format_bytes",
    "format_value",
    "fsync_directory",
    "inspect_checkpoint",
    "load_checkpoint",
    "optimizer_identity",
    "optimizer_layout",
    "read_payload",
    "restore_rng",
    "runtime_signature",
    "save_checkpoint",
    "snapshot_checkpoint",
    "to_plain",
    "validate_rng_state",
]
