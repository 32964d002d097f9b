"""What each ``k3-train`` subcommand does, behind the argument parsing of ``cli.py``.

A training session resolves its configuration (fresh: defaults ← config file ← flags;
resumed: the run's recorded config ← config file ← flags), checks data, model and
checkpoint *before* writing anything into the run directory, then trains.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import k3_checkpoint
from k3_model import K3Config, K3Model
from k3_model import preset as model_preset

from .checkpointing import load_checkpoint
from .config import ConfigError, TrainConfig, TrainState
from .data import TokenDataLoader, check_vocab_fits
from .evaluate import evaluate
from .loop import train
from .metrics import MetricsLog
from .optim import build_optimizer
from .precision import validate_precision
from .prepare import prepare_dataset
from .profiling import TrainingProfiler
from .report import require_matplotlib, write_report
from .run import read_run_record, write_run_record
from .sinks import TensorBoardSink

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
DEFAULT_PRESET = "tiny"


class RunError(Exception):
    """The run directory is not in the state the command needs."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def builtin_data_dir() -> Path:
    """Where the built-in corpus is prepared once (per Python version: its text differs)."""
    root = os.environ.get("K3_TRAIN_CACHE") or Path.home() / ".cache" / "k3-train"
    return Path(root) / f"builtin-pydoc-py{sys.version_info[0]}.{sys.version_info[1]}"


def resolve_data(data: Path | None) -> Path:
    if data is not None:
        return data
    path = builtin_data_dir()
    if not (path / "manifest.json").is_file():
        print(f"k3-train: preparing the built-in corpus into {path}", file=sys.stderr)
        prepare_dataset([], path, overwrite=True)
    return path


def _model_config(preset: str | None, overrides: dict[str, Any],
                  recorded: dict[str, Any] | None) -> K3Config:
    try:
        if recorded is not None and preset is None:
            return K3Config.from_dict({**recorded, **overrides})
        return model_preset(preset or DEFAULT_PRESET, **overrides)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"model config: {exc}") from None


def _train_config(base: dict[str, Any], toml: dict[str, Any],
                  overrides: dict[str, Any]) -> TrainConfig:
    merged = {**base, **toml.get("train", {}), **overrides}
    try:
        return TrainConfig.from_dict(merged)
    except TypeError as exc:
        raise ConfigError(f"train config: {exc}") from None


def _has_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in (CHECKPOINT, METRICS, "run.json"))


def _read_record(run_dir: Path) -> dict[str, Any]:
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


def run_prepare(inputs: list[str], out: Path, val_fraction: float) -> int:
    manifest = prepare_dataset(inputs, out, val_fraction=val_fraction)
    counts = {k: sum(s["tokens"] for s in v) for k, v in manifest["splits"].items()}
    print(f"prepared {out}: " + ", ".join(f"{k} {n:,} tokens" for k, n in counts.items()))
    return 0


def run_inspect(checkpoint: Path) -> int:
    print("\n".join(k3_checkpoint.inspect_checkpoint(checkpoint).lines()))
    return 0


class _Session:
    """Model, optimizer and loaders built from resolved configs (nothing written yet)."""

    def __init__(self, config: TrainConfig, model_config: K3Config, data_dir: Path,
                 device: torch.device) -> None:
        self.train_loader = TokenDataLoader(data_dir, "train", config.batch_size, config.seq_len)
        self.val_loader = TokenDataLoader(data_dir, "val", config.batch_size, config.seq_len)
        check_vocab_fits(self.train_loader, model_config.vocab_size)
        if config.seq_len > model_config.max_seq_len:
            raise ConfigError(f"seq_len {config.seq_len} exceeds the model's max_seq_len "
                              f"{model_config.max_seq_len}")
        seed_everything(config.seed)
        self.model = K3Model(model_config).to(device)
        self.optimizer = build_optimizer(self.model, config)


def run_train(*, run_dir: Path, data: Path | None, toml: dict[str, Any], resume: bool,
              preset: str | None, overrides: dict[str, Any], device: torch.device,
              report: bool = False, tensorboard: bool = False, profile_start: int | None = None,
              profile_steps: int = 3) -> int:
    preset = preset or toml.get("preset")
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"--run-dir {run_dir} is a file, not a directory")
    if resume:
        if not (run_dir / CHECKPOINT).is_file():
            if _has_run(run_dir):
                raise RunError(f"--resume: {run_dir} has no checkpoint yet (the run stopped "
                               "before its first checkpoint), so there is nothing to resume; "
                               "remove the directory and start the run again")
            raise RunError(f"--resume: no checkpoint to resume, {run_dir / CHECKPOINT} "
                           "not found")
        record = _read_record(run_dir)
        config = _train_config(record["train_config"], toml, overrides)
        model_config = _model_config(preset, toml.get("model", {}), record["model_config"])
        data_dir = data or Path(record["data"]["dir"])
    else:
        if _has_run(run_dir):
            if not (run_dir / CHECKPOINT).is_file():
                raise RunError(f"{run_dir} already holds a run that stopped before its first "
                               "checkpoint (nothing to resume); remove it or choose another "
                               "--run-dir")
            raise RunError(f"{run_dir} already holds a run; pass --resume to continue it or "
                           "choose another --run-dir")
        config = _train_config({}, toml, overrides)
        model_config = _model_config(preset, toml.get("model", {}), None)
        data_dir = resolve_data(data)
    validate_precision(config.precision, device)
    try:
        profiler = TrainingProfiler(device, trace_dir=run_dir / "profile",
                                    trace_start=profile_start, trace_steps=profile_steps)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if report:
        require_matplotlib()
    if tensorboard:
        TensorBoardSink.require()
    session = _Session(config, model_config, data_dir, device)
    state = TrainState()
    if resume:
        state = load_checkpoint(run_dir / CHECKPOINT, session.model, session.optimizer, config,
                                session.train_loader, session.val_loader)
        if state.step >= config.max_steps:
            raise RunError(f"the run is complete at step {state.step}; raise --max-steps to "
                           "extend it")

    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_record(run_dir, train_config=config.to_dict(), model_config=model_config.to_dict(),
                     preset=preset, data_dir=str(data_dir.resolve()),
                     manifest_digest=session.train_loader.manifest_digest, device=str(device),
                     resumed_from_step=state.step if resume else None)
    sinks = [TensorBoardSink(run_dir / "tensorboard")] if tensorboard else []
    bar = _progress(config, state)
    with MetricsLog(run_dir / METRICS, sinks=sinks) as log:
        state = train(session.model, session.optimizer, session.train_loader,
                      session.val_loader, config, device, state=state, log=log,
                      checkpoint_path=run_dir / CHECKPOINT, profiler=profiler,
                      on_update=bar.update if bar else None)
        if bar:
            bar.close()
        _summary(log, run_dir)
    if report:
        print(f"k3-train: report in {write_report(run_dir)}")
    return 0


def run_report(run_dir: Path) -> int:
    print(f"k3-train: report in {write_report(run_dir)}")
    return 0


def run_eval(run_dir: Path, data: Path | None, batches: int | None,
             device: torch.device) -> int:
    record = _read_record(run_dir)
    config = _train_config(record["train_config"], {}, {})
    session = _Session(config, _model_config(None, {}, record["model_config"]),
                       data or Path(record["data"]["dir"]), device)
    state = load_checkpoint(run_dir / CHECKPOINT, session.model, session.optimizer, config,
                            session.train_loader, session.val_loader)
    loss = evaluate(session.model, session.val_loader, device, batches or config.eval_batches,
                    config.precision)
    print(f"step {state.step}: val_loss {loss:.4f}")
    return 0


class _Progress:
    """A tqdm bar on a terminal (step, loss, tokens/s, ETA); silent otherwise."""

    def __init__(self, config: TrainConfig, state: TrainState) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=config.max_steps, initial=state.step, unit="step",
                        dynamic_ncols=True, file=sys.stderr)

    def update(self, state: TrainState, stats: dict[str, Any]) -> None:
        self.bar.n = state.step
        self.bar.set_postfix(loss=f"{stats['loss']:.3f}", tok_s=f"{stats['tokens_per_s']:.0f}",
                             refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _progress(config: TrainConfig, state: TrainState) -> _Progress | None:
    return _Progress(config, state) if sys.stderr.isatty() else None


def _summary(log: MetricsLog, run_dir: Path) -> None:
    train_events = [e for e in log.events if e["event"] == "train"]
    evals = [e for e in log.events if e["event"] == "eval"]
    end: dict[str, Any] = next(
        (e for e in reversed(log.events) if e["event"] == "session_end"), {})
    parts = [f"step {end.get('step')}"]
    if train_events:
        parts.append(f"loss {train_events[0]['loss']:.3f} → {train_events[-1]['loss']:.3f}")
    if evals:
        parts.append(f"val_loss {evals[-1]['val_loss']:.3f}")
    rates = [e["tokens_per_s"] for e in train_events if e.get("tokens_per_s")]
    if rates:
        parts.append(f"{sum(rates) / len(rates):,.0f} tokens/s (active training)")
    print(f"k3-train: {', '.join(parts)}; run in {run_dir}")

