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

from .checkpointing import (
    CHECKPOINT,
    SHARDED_CHECKPOINT,
    checkpoint_path,
    find_checkpoint,
    load_checkpoint,
    resume_checkpoint,
)
from .compiling import prepare_model
from .config import ConfigError, TrainConfig, TrainState
from .data import MANIFEST_FORMAT, TokenDataLoader, check_vocab_fits
from .distributed import Parallel, init_parallel, set_balancer_gather, shutdown
from .evaluate import evaluate_split
from .loop import train
from .metrics import MetricsLog
from .optim import build_optimizer
from .precision import validate_precision
from .prepare import (
    DEFAULT_SHARD_TOKENS,
    default_workers,
    describe_prepared,
    prepare_dataset,
)
from .profiling import TrainingProfiler
from .report import require_matplotlib, write_report
from .run import read_run_record, write_run_record
from .sample import sample_text
from .schedule import horizon_notes
from .sharded import describe_sharded, is_sharded
from .sinks import TensorBoardSink
from .tokenizer import load_codec

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
    return any((run_dir / name).exists()
               for name in (CHECKPOINT, SHARDED_CHECKPOINT, METRICS, "run.json"))


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


def run_prepare(inputs: list[str], out: Path, *, workers: int | None = None,
                shard_tokens: int | None = None, **options: Any) -> int:
    """``k3-train prepare``: ``options`` are :func:`prepare_dataset`'s keyword arguments."""
    manifest = prepare_dataset(inputs, out, workers=workers or default_workers(),
                               shard_tokens=shard_tokens or DEFAULT_SHARD_TOKENS,
                               progress=sys.stderr.isatty(), **options)
    print(describe_prepared(out, manifest))
    return 0


def run_inspect(checkpoint: Path) -> int:
    """Summarize a checkpoint file, a sharded checkpoint folder, or a run directory's
    checkpoint, verifying every digest and building nothing."""
    if checkpoint.is_dir() and not (checkpoint / "k3.ckpt").exists():
        found = find_checkpoint(checkpoint)
        if found is None:
            raise RunError(f"{checkpoint} holds no checkpoint ({CHECKPOINT} or "
                           f"{SHARDED_CHECKPOINT})")
        checkpoint = found
    lines = (describe_sharded(checkpoint) if is_sharded(checkpoint)
             else k3_checkpoint.inspect_checkpoint(checkpoint).lines())
    print("\n".join(lines))
    return 0


class _Session:
    """Model, optimizer and loaders built from resolved configs (nothing written yet).

    Data parallel: the loaders read this rank's rows, every rank initializes the same
    model from the seed, which is then sharded or replicated before the optimizer is
    built (FSDP2 parameters become DTensors; DDP asks Muon for one owner per matrix).
    """

    def __init__(self, config: TrainConfig, model_config: K3Config, data_dir: Path,
                 device: torch.device, parallel: Parallel | None = None) -> None:
        rank, world = (parallel.rank, parallel.world_size) if parallel is not None else (0, 1)
        self.train_loader = TokenDataLoader(data_dir, "train", config.batch_size, config.seq_len,
                                            rank=rank, world_size=world)
        self.val_loader = TokenDataLoader(data_dir, "val", config.batch_size, config.seq_len,
                                          rank=rank, world_size=world)
        check_vocab_fits(self.train_loader, model_config.vocab_size)
        if config.seq_len > model_config.max_seq_len:
            raise ConfigError(f"seq_len {config.seq_len} exceeds the model's max_seq_len "
                              f"{model_config.max_seq_len}")
        seed_everything(config.seed)
        self.model = K3Model(model_config).to(device)
        if parallel is None:
            self.optimizer = build_optimizer(self.model, config)
            return
        # Activation checkpointing and compile before sharding/wrapping (the order PyTorch
        # recommends); train() finds them applied and leaves them be.
        prepare_model(self.model, config)
        parallel.wrap(self.model)
        self.optimizer = build_optimizer(self.model, config,
                                         distributed=True if parallel.mode == "ddp" else None)


def run_train(*, run_dir: Path, data: Path | None, toml: dict[str, Any], resume: bool,
              preset: str | None, overrides: dict[str, Any], device: torch.device,
              report: bool = False, tensorboard: bool = False, profile_start: int | None = None,
              profile_steps: int = 3, allow_runtime_change: bool = False,
              parallel: str = "none") -> int:
    """``k3-train train``; ``parallel`` (ddp/fsdp) joins torchrun's process group first."""
    dp, device = init_parallel(parallel, device)
    clean = False
    try:
        status = _run_train(run_dir=run_dir, data=data, toml=toml, resume=resume, preset=preset,
                          overrides=overrides, device=device, report=report,
                          tensorboard=tensorboard, profile_start=profile_start,
                          profile_steps=profile_steps,
                          allow_runtime_change=allow_runtime_change, parallel=dp)
        clean = True
        return status
    finally:
        set_balancer_gather(None)
        shutdown(dp, clean=clean)


def _run_train(*, run_dir: Path, data: Path | None, toml: dict[str, Any], resume: bool,
               preset: str | None, overrides: dict[str, Any], device: torch.device,
               report: bool, tensorboard: bool, profile_start: int | None,
               profile_steps: int, allow_runtime_change: bool,
               parallel: Parallel | None) -> int:
    main = parallel is None or parallel.is_main  # rank 0 alone writes the run directory
    preset = preset or toml.get("preset")
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"--run-dir {run_dir} is a file, not a directory")
    record: dict[str, Any] | None = None
    found = find_checkpoint(run_dir)
    if resume and found is None:
        if not _has_run(run_dir):
            raise RunError(f"--resume: no checkpoint to resume, {run_dir / CHECKPOINT} "
                           f"(or {SHARDED_CHECKPOINT}) not found")
        # Killed before its first checkpoint: nothing to lose, so a supervisor that
        # restarts with --resume until success gets a run instead of a loop of errors.
        record = _restart_record(run_dir)
        print(f"k3-train: {run_dir} stopped before its first checkpoint; nothing to resume, "
              "so the run starts from scratch", file=sys.stderr)
        resume = False
    elif resume:
        record = _read_record(run_dir)
    elif _has_run(run_dir):
        if found is None:
            raise RunError(f"{run_dir} already holds a run that stopped before its first "
                           "checkpoint; pass --resume to start it again from scratch, or "
                           "choose another --run-dir")
        raise RunError(f"{run_dir} already holds a run; pass --resume to continue it or "
                       "choose another --run-dir")
    if record is not None:
        config = _train_config(record["train_config"], toml, overrides)
        model_config = _model_config(preset, toml.get("model", {}), record["model_config"])
        data_dir = data or Path(record["data"]["dir"])
    else:
        config = _train_config({}, toml, overrides)
        model_config = _model_config(preset, toml.get("model", {}), None)
        data_dir = resolve_data(data)
    horizon_unset = record is None and "decay_steps" not in {**toml.get("train", {}),
                                                            **overrides}
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
    checkpoint = checkpoint_path(run_dir, parallel)
    if parallel is not None:
        set_balancer_gather(parallel.gather_rows)
    session = _Session(config, model_config, data_dir, device, parallel)
    state = TrainState()
    runtime_changes: dict[str, Any] = {}
    if resume:
        assert found is not None
        try:
            resumed = resume_checkpoint(found, session.model, session.optimizer,
                                        config, session.train_loader, session.val_loader,
                                        allow_runtime_change=allow_runtime_change,
                                        parallel=parallel)
        except k3_checkpoint.CheckpointError as error:
            raise _with_runtime_hint(error, allow_runtime_change) from error
        state, runtime_changes = resumed.state, resumed.runtime_changes
        if state.step >= config.max_steps:
            # Success for a supervisor that restarts until the run is done.
            print(f"k3-train: run already complete at step {state.step}; nothing to do "
                  "(raise --max-steps to extend it)")
            return 0
    if parallel is not None:
        parallel.barrier()  # every rank has checked the run directory before rank 0 writes
    if parallel is not None and not main:
        return _train_quietly(session, config, device, state, parallel, checkpoint)
    if not resume:
        (run_dir / METRICS).unlink(missing_ok=True)  # a restart's stale events, if any

    # Said once every check has passed and the session is really going to train.
    for note in horizon_notes(config, horizon_unset=horizon_unset):
        print(f"k3-train: note: {note}", file=sys.stderr)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_record(run_dir, train_config=config.to_dict(), model_config=model_config.to_dict(),
                     preset=preset, data_dir=str(data_dir.resolve()),
                     manifest_digest=session.train_loader.manifest_digest, device=str(device),
                     resumed_from_step=state.step if resume else None,
                     data_parallel=parallel.describe() if parallel is not None else None)
    sinks = [TensorBoardSink(run_dir / "tensorboard")] if tensorboard else []
    bar = _progress(config, state)
    with MetricsLog(run_dir / METRICS, sinks=sinks) as log:
        if runtime_changes:
            _report_runtime_changes(log, state, runtime_changes)
        state = train(session.model, session.optimizer, session.train_loader,
                      session.val_loader, config, device, state=state, log=log,
                      checkpoint_path=checkpoint, profiler=profiler,
                      on_update=bar.update if bar else None, parallel=parallel)
        if bar:
            bar.close()
        _summary(log, run_dir)
    if report:
        print(f"k3-train: report in {write_report(run_dir)}")
    return 0


def _train_quietly(session: _Session, config: TrainConfig, device: torch.device,
                   state: TrainState, parallel: Parallel, checkpoint: Path | None) -> int:
    """A rank other than 0: the same training, writing nothing (its collectives still run,
    and it passes the checkpoint path so the loop keeps in step at checkpoint updates)."""
    train(session.model, session.optimizer, session.train_loader, session.val_loader,
          config, device, state=state, checkpoint_path=checkpoint, parallel=parallel)
    return 0


def _with_runtime_hint(error: k3_checkpoint.CheckpointError,
                       allowed: bool) -> k3_checkpoint.CheckpointError:
    """``error``, naming the opt-in when what it refused is only the runtime or the
    data-parallel layout (another machine, thread count or world size)."""
    if allowed or not error.reason.startswith(("incompatible runtime —",
                                               "incompatible data_parallel —")):
        return error
    return k3_checkpoint.CheckpointError(
        f"{error.reason}; pass --allow-runtime-change to continue anyway (no bitwise "
        "promise)", path=error.path)


def _report_runtime_changes(log: MetricsLog, state: TrainState,
                            changes: dict[str, Any]) -> None:
    """``--allow-runtime-change`` accepted another runtime: say so, once, in both places."""
    named = {key.removeprefix("runtime."): {"saved": saved, "current": current}
             for key, (saved, current) in changes.items()}
    log.write("runtime_changed", step=state.step, changes=named)
    listed = ", ".join(f"{k} {v['saved']} → {v['current']}" for k, v in named.items())
    print(f"k3-train: warning: resuming under another runtime ({listed}); the run continues "
          "correctly but is no longer bitwise-identical to an uninterrupted one",
          file=sys.stderr)


def _restart_record(run_dir: Path) -> dict[str, Any] | None:
    """The configs a run that died before its first checkpoint was started with, or None
    when its run.json is missing or damaged (then the command line alone decides)."""
    try:
        return _read_record(run_dir)
    except RunError:
        return None


def run_report(run_dir: Path) -> int:
    print(f"k3-train: report in {write_report(run_dir)}")
    return 0


def _restored(run_dir: Path, data: Path | None, device: torch.device
              ) -> tuple[_Session, TrainConfig, TrainState, Path]:
    """The run rebuilt from its run.json with its checkpoint loaded, for commands that
    continue no training (eval, sample): another runtime (threads, torch version, device)
    is accepted; everything else is validated as strictly as for a resume."""
    record = _read_record(run_dir)
    config = _train_config(record["train_config"], {}, {})
    data_dir = data or Path(record["data"]["dir"])
    session = _Session(config, _model_config(None, {}, record["model_config"]), data_dir,
                       device)
    found = find_checkpoint(run_dir)
    if found is None:
        raise RunError(f"{run_dir / CHECKPOINT} not found: {run_dir} has no checkpoint")
    state = load_checkpoint(found, session.model, session.optimizer, config,
                            session.train_loader, session.val_loader,
                            allow_runtime_change=True)
    return session, config, state, data_dir


def run_eval(run_dir: Path, data: Path | None, batches: int | None,
             device: torch.device) -> int:
    session, config, state, _ = _restored(run_dir, data, device)
    result = evaluate_split(session.model, session.val_loader, device,
                            batches or config.eval_batches, config.precision)
    bpb = "" if result.bpb is None else f", val_bpb {result.bpb:.4f}"
    print(f"step {state.step}: val_loss {result.loss:.4f}{bpb}")
    return 0


def run_sample(run_dir: Path, *, prompt: str, max_new_tokens: int, temperature: float,
               top_k: int | None, seed: int, device: torch.device) -> int:
    """Print ``prompt`` and a continuation from the run's checkpoint (strictly loaded)."""
    if find_checkpoint(run_dir) is None:
        raise RunError(f"{run_dir / CHECKPOINT} not found: {run_dir} has no checkpoint to "
                       "sample from; train it first")
    session, _, _, data_dir = _restored(run_dir, None, device)
    codec = load_codec(data_dir, session.train_loader.manifest)
    print(sample_text(session.model, codec, prompt, max_new_tokens=max_new_tokens,
                      max_seq_len=session.model.config.max_seq_len, device=device,
                      temperature=temperature, top_k=top_k, seed=seed))
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

