"""A ``k3-train train`` session's configuration, resolved from the run directory's state
and the command line before anything is built or written.

Fresh: defaults ← preset ← config file ← flags (the model's vocabulary grows to the data's
tokenizer unless set); resumed: the run's recorded configs ← config file ← flags.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k3_model import K3Config
from k3_model import preset as model_preset
from k3_model.hub import HubFormatError, pretrained_config

from .checkpoint import CHECKPOINT, SHARDED_CHECKPOINT, find_checkpoint
from .config import ConfigError, TrainConfig
from .data import read_manifest
from .data.loader import MANIFEST_FORMAT
from .data.prepare import prepare_dataset
from .observe import read_events
from .observe.run import read_run_record

VOCAB_MULTIPLE = 128
METRICS = "metrics.jsonl"
DEFAULT_PRESET = "tiny"


class RunError(Exception):
    """The run directory is not in the state the command needs."""


def builtin_data_dir() -> Path:
    """Where the built-in corpus is prepared once (per Python version: its text differs)."""
    root = os.environ.get("K3_TRAIN_CACHE") or Path.home() / ".cache" / "k3-train"
    version = f"py{sys.version_info[0]}.{sys.version_info[1]}"
    return Path(root) / f"builtin-pydoc-{version}-{MANIFEST_FORMAT.replace('/', '')}"


def resolve_data(data: Path | None) -> Path:
    if data is not None:
        return data
    path = builtin_data_dir()
    if not (path / "manifest.json").is_file():
        print(f"k3-train: preparing the built-in corpus into {path}", file=sys.stderr)
        prepare_dataset([], path, overwrite=True)
    return path


def model_config_from(preset: str | None, overrides: dict[str, Any],
                      recorded: dict[str, Any] | None) -> K3Config:
    try:
        if recorded is not None and preset is None:
            return K3Config.from_dict({**recorded, **overrides})
        return model_preset(preset or DEFAULT_PRESET, **overrides)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"model config: {exc}") from None


def train_config_from(base: dict[str, Any], toml: dict[str, Any],
                      overrides: dict[str, Any]) -> TrainConfig:
    merged = {**base, **toml.get("train", {}), **overrides}
    try:
        return TrainConfig.from_dict(merged)
    except TypeError as exc:
        raise ConfigError(f"train config: {exc}") from None


def _has_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists()
               for name in (CHECKPOINT, SHARDED_CHECKPOINT, METRICS, "run.json"))


def _recorded_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the last checkpoint ``metrics.jsonl`` says was saved, or None."""
    metrics = run_dir / METRICS
    try:
        events = read_events(metrics) if metrics.is_file() else []
    except (OSError, UnicodeDecodeError):
        return None
    steps = [e.get("step") for e in events if e.get("event") == "checkpoint"]
    return steps[-1] if steps and isinstance(steps[-1], int) else None


def read_record(run_dir: Path) -> dict[str, Any]:
    """``run.json``, checked to hold what a resume or an evaluation reads from it."""
    try:
        record = read_run_record(run_dir)
    except FileNotFoundError as exc:
        raise RunError(str(exc)) from None
    except ValueError as exc:  # unreadable JSON or not a run record
        raise RunError(f"{exc}; the run directory is damaged") from None
    data = record.get("data")
    if not (isinstance(record.get("train_config"), dict)
            and isinstance(record.get("model_config"), dict)
            and isinstance(data, dict) and isinstance(data.get("dir"), str)):
        raise RunError(f"{run_dir / 'run.json'} lacks train_config, model_config or data.dir; "
                       "the run directory is damaged")
    return record


@dataclass(frozen=True)
class TrainCommand:
    """``k3-train train``'s arguments, as the command line resolved them."""

    run_dir: Path
    data: Path | None = None
    toml: dict[str, Any] = field(default_factory=dict)
    resume: bool = False
    preset: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    """TrainConfig fields the command line set."""
    model_overrides: dict[str, Any] = field(default_factory=dict)
    """K3Config fields the command line set."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    report: bool = False
    tensorboard: bool = False
    profile_start: int | None = None
    profile_steps: int = 3
    allow_runtime_change: bool = False
    parallel: str = "none"
    notes: tuple[str, ...] = ()
    """One-line notes to print once the session is sure to train."""
    init_from: Path | None = None
    """A hub folder whose weights a fresh run starts from (continued pretraining)."""


@dataclass(frozen=True)
class Resolved:
    """A session's configuration, resolved before anything is built or written."""

    config: TrainConfig
    model_config: K3Config
    data_dir: Path
    resume_from: Path | None
    horizon_unset: bool
    recorded_data: str | None = None
    """The data folder the run's record names (to say which dataset a checkpoint needs)."""
    notes: tuple[str, ...] = ()
    """What resolving chose on the user's behalf, to say once the session is sure to train."""
    init_from: Path | None = None
    """The hub folder a fresh run loads its weights from (None: initialized from the seed,
    or resumed from its checkpoint)."""


def resolve(command: TrainCommand) -> Resolved:
    """The session's configs from the run directory's state and the command line, or a
    ``RunError`` when the run directory is not in a state this command can use."""
    run_dir, toml = command.run_dir, command.toml
    preset = command.preset or toml.get("preset")
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"--run-dir {run_dir} is a file, not a directory")
    record: dict[str, Any] | None = None
    found = find_checkpoint(run_dir)
    resume = command.resume
    if resume and found is None:
        saved_at = _recorded_checkpoint_step(run_dir)
        if saved_at is not None:  # moved or deleted: starting over would lose the run
            raise RunError(f"{run_dir / METRICS} records a checkpoint saved at step "
                           f"{saved_at}, but {run_dir} holds none ({CHECKPOINT} or "
                           f"{SHARDED_CHECKPOINT}): put it back, or choose another --run-dir")
        # Nothing written yet, or killed before its first checkpoint: nothing to lose, so a
        # supervisor that restarts with --resume until success gets a run, not a loop.
        if _has_run(run_dir):
            record = _restart_record(run_dir)
            print(f"k3-train: {run_dir} stopped before its first checkpoint; nothing to "
                  "resume, so the run starts from scratch", file=sys.stderr)
        else:
            print(f"k3-train: {run_dir} holds no run yet; nothing to resume, so the run "
                  "starts", file=sys.stderr)
        resume = False
    elif resume:
        record = read_record(run_dir)
    elif _has_run(run_dir):
        if found is None:
            raise RunError(f"{run_dir} already holds a run that stopped before its first "
                           "checkpoint; pass --resume to start it again from scratch, or "
                           "choose another --run-dir")
        raise RunError(f"{run_dir} already holds a run; pass --resume to continue it or "
                       "choose another --run-dir")
    model_fields = {**toml.get("model", {}), **command.model_overrides}
    notes: tuple[str, ...] = ()
    init_from = command.init_from
    if init_from is not None and resume:
        notes = (f"--init-from {init_from} is not read: the run's checkpoint holds its "
                 "weights (it starts a run only)",)
        init_from = None
    if init_from is not None:
        if preset is not None:
            raise ConfigError(f"--init-from {init_from} and --preset {preset} both choose the "
                              "model; drop --preset (the folder's config.json is the model)")
        config = train_config_from({}, toml, command.overrides)
        model_config = _pretrained_model_config(init_from, model_fields)
        data_dir = resolve_data(command.data)
        notes = _tokenizer_notes(init_from, data_dir)
    elif record is not None:
        config = train_config_from(record["train_config"], toml, command.overrides)
        model_config = model_config_from(preset, model_fields, record["model_config"])
        data_dir = command.data or Path(record["data"]["dir"])
    else:
        config = train_config_from({}, toml, command.overrides)
        model_config = model_config_from(preset, model_fields, None)
        data_dir = resolve_data(command.data)
        if "vocab_size" not in model_fields:
            model_config, notes = _vocab_for_data(model_config, data_dir)
    horizon_unset = record is None and "decay_steps" not in {**toml.get("train", {}),
                                                            **command.overrides}
    recorded_data = record["data"]["dir"] if record is not None else None
    return Resolved(config, model_config, data_dir, found if resume else None, horizon_unset,
                    recorded_data, notes, init_from)


def _pretrained_model_config(folder: Path, model_fields: dict[str, Any]) -> K3Config:
    """The hub folder's model, with the model flags that do not contradict it (those that
    only change how it computes, e.g. ``--kda-chunk-size``); a contradicting one is named."""
    try:
        return pretrained_config(folder, **model_fields)
    except HubFormatError as exc:
        raise ConfigError(f"--init-from {exc}") from None


def _tokenizer_notes(folder: Path, data_dir: Path) -> tuple[str, ...]:
    """Refuse data prepared with another tokenizer than the folder's."""
    from .data import load_codec
    from .hub import check_tokenizer

    codec = load_codec(data_dir, read_manifest(data_dir))
    note = check_tokenizer(folder, codec, data_dir, "--init-from")
    return () if note is None else (note,)


def _restart_record(run_dir: Path) -> dict[str, Any] | None:
    """The configs a run that died before its first checkpoint was started with, or None
    when its run.json is missing or damaged (then the command line alone decides)."""
    try:
        return read_record(run_dir)
    except RunError:
        return None




def _vocab_for_data(model_config: K3Config, data_dir: Path) -> tuple[K3Config, tuple[str, ...]]:
    """The model with a vocabulary large enough for the data's tokenizer (rounded up to a
    multiple of 128, for the embedding's matrix shapes) and a note saying so; unchanged
    when the preset's covers it. A vocab_size the user set is never changed: the loaders
    refuse one that is too small."""
    needed = int(read_manifest(data_dir)["vocab_size"])
    if needed <= model_config.vocab_size:
        return model_config, ()
    rounded = -(-needed // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    note = (f"vocab_size {model_config.vocab_size} → {rounded} to cover the data's "
            f"{needed}-token tokenizer (--vocab-size sets it)")
    return model_config.replace(vocab_size=rounded), (note,)
