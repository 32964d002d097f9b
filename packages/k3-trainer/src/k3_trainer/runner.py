"""What each ``k3-train`` subcommand does, behind the argument parsing of ``cli.py``.

A training session resolves its configuration (:mod:`k3_trainer.resolve`), checks data,
model and checkpoint *before* writing anything into the run directory, then trains.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import k3_checkpoint
from k3_model import K3Config, K3Model
from k3_model.hub import HubFormatError, load_weights

from .callbacks import (
    LogLines,
    MetricsLog,
    ProfilerWindow,
    ProgressBar,
    Report,
    TensorBoard,
)
from .checkpoint import (
    CHECKPOINT,
    READ_ONLY,
    SHARDED_CHECKPOINT,
    Checkpointer,
    checkpoint_path,
    find_checkpoint,
    run_metadata,
)
from .checkpoint.sharded import describe_sharded, is_sharded
from .compiling import prepare_model
from .config import ConfigError, TrainConfig
from .contract import check_model
from .data import Codec, TokenDataLoader, check_vocab_fits, load_codec
from .data.loader import manifest_digest, read_manifest
from .data.options import PrepareOptions
from .data.prepare import describe_prepared, prepare_dataset
from .distributed import Parallel, init_parallel, shutdown
from .evaluation import evaluate_split
from .hub import check_tokenizer, export_model, folder_codec, load_folder
from .interrupt import StopOnSignal
from .observe.report import require_matplotlib, write_report
from .observe.run import Session, write_run_record
from .optim import build_optimizer
from .precision import validate_precision
from .resolve import (
    METRICS,
    Resolved,
    RunError,
    TrainCommand,
    model_config_from,
    read_record,
    resolve,
    train_config_from,
)
from .sample import Sampling, TextStream, context_room, sample_text
from .schedule import horizon_notes
from .state import TrainState
from .threads import THREADS_ENV
from .trainer import Trainer

__all__ = ["RunError", "SampleCommand", "TrainCommand", "build_trainer", "run_eval",
           "run_export", "run_inspect", "run_prepare", "run_report", "run_sample",
           "run_train"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_prepare(inputs: list[str], out: Path, options: PrepareOptions) -> int:
    """``k3-train prepare``."""
    manifest = prepare_dataset(inputs, out, options, progress=sys.stderr.isatty())
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


def _loaders(config: TrainConfig, model_config: K3Config, data_dir: Path,
             parallel: Parallel | None) -> tuple[TokenDataLoader, TokenDataLoader]:
    """Both loaders (this rank's rows), checked against the model's vocabulary and length."""
    rank, world = (parallel.rank, parallel.world_size) if parallel is not None else (0, 1)
    train = TokenDataLoader(data_dir, "train", config.batch_size, config.seq_len,
                            rank=rank, world_size=world)
    val = TokenDataLoader(data_dir, "val", config.batch_size, config.seq_len,
                          rank=rank, world_size=world)
    check_vocab_fits(train, model_config.vocab_size)
    if config.seq_len > model_config.max_seq_len:
        raise ConfigError(f"seq_len {config.seq_len} exceeds the model's max_seq_len "
                          f"{model_config.max_seq_len}")
    return train, val


def build_trainer(resolved: Resolved, device: torch.device, parallel: Parallel | None,
                  checkpoint: Path | None) -> Trainer:
    """Model, optimizer and loaders built from resolved configs, held by a ``Trainer``
    (nothing written yet).

    Data parallel: the loaders read this rank's rows, every rank initializes the same
    model from the seed, which is then sharded or replicated before the optimizer is
    built (FSDP2 parameters become DTensors; DDP asks Muon for one owner per matrix).
    Expert parallelism slices the routed experts first, so FSDP2 leaves them alone.
    """
    config = resolved.config
    loaders = _loaders(config, resolved.model_config, resolved.data_dir, parallel)
    seed_everything(config.seed)
    model = K3Model(resolved.model_config).to(device)
    if resolved.init_from is not None:  # continued pretraining: the folder's weights
        try:
            load_weights(model, resolved.init_from)
        except HubFormatError as exc:
            raise ConfigError(f"--init-from {exc}") from None
    distributed: bool | None = None
    if config.expert_parallel > 1 and parallel is None:
        raise ConfigError(f"--expert-parallel {config.expert_parallel} needs a torchrun launch "
                          "with --parallel fsdp (e.g. k3-train train --nproc 2 --parallel fsdp)")
    if parallel is not None:
        parallel.shard_experts(model, config.expert_parallel)
        # Activation checkpointing and compile before sharding/wrapping (the order PyTorch
        # recommends); fit() finds them applied and leaves them be.
        prepare_model(model, config)
        model.set_balancer_gather(parallel.gather_rows)
        parallel.wrap(model)
        distributed = True if parallel.mode == "ddp" else None
    optimizer = build_optimizer(model, config, distributed=distributed)
    return Trainer(model, optimizer, loaders, config, parallel=parallel,
                   checkpoint_path=checkpoint)


def run_train(command: TrainCommand) -> int:
    """``k3-train train``; ``--parallel`` ddp/fsdp joins torchrun's process group first."""
    dp, device = init_parallel(command.parallel, command.device)
    clean = False
    try:
        status = _run_train(command, device, dp)
        clean = True
        return status
    finally:
        shutdown(dp, clean=clean)


def _observers(command: TrainCommand, metrics: MetricsLog) -> list[Any]:
    """The callbacks of a CLI session (rank 0): metrics.jsonl, then what was asked for."""
    callbacks: list[Any] = [metrics]
    if command.tensorboard:
        callbacks.append(TensorBoard(command.run_dir / "tensorboard"))
    if command.profile_start is not None:
        callbacks.append(ProfilerWindow(command.run_dir / "profile", command.profile_start,
                                        command.profile_steps))
    # A bar on a terminal; in a log file (nohup, a job log, CI) plain lines instead.
    callbacks.append(ProgressBar() if sys.stderr.isatty() else LogLines())
    if command.report:
        callbacks.append(Report(command.run_dir))
    return callbacks


def _run_train(command: TrainCommand, device: torch.device, parallel: Parallel | None) -> int:
    main = parallel is None or parallel.is_main  # rank 0 alone writes the run directory
    run_dir = command.run_dir
    resolved = resolve(command)
    config = resolved.config
    validate_precision(config.precision, device)
    if command.profile_start is not None:
        try:
            ProfilerWindow(run_dir / "profile", command.profile_start, command.profile_steps)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if command.report:
        require_matplotlib()
    if command.tensorboard:
        TensorBoard.require()
    trainer = build_trainer(resolved, device, parallel, checkpoint_path(run_dir, parallel))
    runtime_changes: dict[str, Any] = {}
    if resolved.resume_from is not None:
        try:
            resumed = trainer.resume(resolved.resume_from,
                                     allow_runtime_change=command.allow_runtime_change)
        except k3_checkpoint.CheckpointError as error:
            raise _with_data_hint(_with_runtime_hint(error, command),
                                  resolved) from error
        runtime_changes = resumed.runtime_changes
        if trainer.state.step >= config.max_steps:
            # Success for a supervisor that restarts until the run is done.
            print(f"k3-train: run already complete at step {trainer.state.step}; nothing to "
                  "do (raise --max-steps to extend it)")
            return 0
    if parallel is not None:
        parallel.barrier()  # every rank has checked the run directory before rank 0 writes
    if not main:
        with StopOnSignal(trainer):
            trainer.fit()  # the same training, writing nothing but its share of checkpoints
        return 0
    try:  # the session's first writes: a run directory it cannot write is the user's to fix
        if resolved.resume_from is None:
            (run_dir / METRICS).unlink(missing_ok=True)  # a restart's stale events, if any
        run_dir.mkdir(parents=True, exist_ok=True)
        write_run_record(run_dir, Session(
            config.to_dict(), resolved.model_config.to_dict(),
            preset=command.preset or command.toml.get("preset"),
            data_dir=str(resolved.data_dir.resolve()),
            manifest_digest=manifest_digest(read_manifest(resolved.data_dir)),
            device=str(device),
            resumed_from_step=trainer.state.step if resolved.resume_from is not None else None,
            data_parallel=parallel.describe() if parallel is not None else None,
            init_from=None if resolved.init_from is None else str(resolved.init_from.resolve())))
        metrics = MetricsLog(run_dir / METRICS)
    except PermissionError as error:
        raise RunError(f"--run-dir {run_dir} is not writable ({error.strerror}: "
                       f"{error.filename}); fix its permissions or choose another --run-dir"
                       ) from None
    # Said once every check has passed and the session is really going to train.
    for note in (*command.notes, *resolved.notes,
                 *horizon_notes(config, horizon_unset=resolved.horizon_unset)):
        print(f"k3-train: note: {note}", file=sys.stderr)
    with metrics:
        observers = _observers(command, metrics)
        trainer.callbacks.extend(observers)
        if runtime_changes:
            _report_runtime_changes(metrics, trainer.state, runtime_changes)
        with StopOnSignal(trainer):
            trainer.fit()
        _summary(metrics, run_dir)
    report = next((c for c in observers if isinstance(c, Report)), None)
    if report is not None and report.written is not None:
        print(f"k3-train: report in {report.written}")
    return 0


def _with_runtime_hint(error: k3_checkpoint.CheckpointError,
                       command: TrainCommand) -> k3_checkpoint.CheckpointError:
    """``error``, saying in command-line terms how to continue when what it refused is only
    the runtime or the data-parallel layout: relaunch as the run last ran (its thread
    count, its torchrun layout, from run.json), or opt in to the change."""
    refused = error.reason.split(" — ", 1)[0]
    if command.allow_runtime_change or refused not in ("incompatible runtime",
                                                       "incompatible data_parallel"):
        return error
    relaunch = _relaunch_advice(command.run_dir, layout=refused.endswith("data_parallel"))
    return k3_checkpoint.CheckpointError(
        f"{error.reason}; {relaunch}pass --allow-runtime-change to continue anyway (no bitwise "
        "promise)", path=error.path)


def _relaunch_advice(run_dir: Path, *, layout: bool) -> str:
    """``relaunch … or `` naming how the run's last session was launched, or ``""`` when
    its record does not say (or says nothing this session could change)."""
    try:
        sessions = read_record(run_dir).get("sessions")
    except RunError:
        return ""
    last = sessions[-1] if isinstance(sessions, list) and sessions else {}
    if not isinstance(last, dict):
        return ""
    if layout:
        recorded = last.get("data_parallel")
        if not isinstance(recorded, dict):
            return "relaunch in one process as the run was (no --parallel), or "
        degree = recorded.get("expert_parallel")
        experts = f" --expert-parallel {degree}" if isinstance(degree, int) else ""
        return (f"relaunch as the run was launched (--parallel {recorded.get('mode')} "
                f"--nproc {recorded.get('world_size')}{experts}), or ")
    threads = (last.get("host") or {}).get("torch_threads")
    if isinstance(threads, int) and threads != torch.get_num_threads():
        return f"relaunch with {THREADS_ENV}={threads} as the run's last session ran, or "
    return ""


def _with_data_hint(error: k3_checkpoint.CheckpointError,
                    resolved: Resolved) -> k3_checkpoint.CheckpointError:
    """``error``, naming the dataset folders when the checkpoint belongs to other data."""
    if "belongs to different data" not in error.reason or resolved.recorded_data is None:
        return error
    return k3_checkpoint.CheckpointError(
        f"{error.reason}; the run was trained on {resolved.recorded_data}, this session "
        f"reads {resolved.data_dir} (pass --data with the run's dataset, unchanged)",
        path=error.path)


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


def run_report(run_dir: Path) -> int:
    print(f"k3-train: report in {write_report(run_dir)}")
    return 0


@dataclass(frozen=True)
class _Restored:
    """A run's model (and what it was trained on) read from its checkpoint."""

    model: K3Model
    config: TrainConfig
    state: TrainState
    loaders: tuple[TokenDataLoader, TokenDataLoader]
    data_dir: Path


def _restored(run_dir: Path, data: Path | None, device: torch.device) -> _Restored:
    """The run's model rebuilt from its run.json with its weights, counters and loader
    cursors read from the checkpoint, for commands that continue no training (eval,
    sample): no optimizer is built, a sharded checkpoint is read into this one process,
    another runtime (threads, torch version, device) is accepted, and everything else is
    validated as strictly as for a resume. The loaders read the run's global batch (every
    rank's rows), so validation measures the same tokens as the run's logged one."""
    record = read_record(run_dir)
    found = find_checkpoint(run_dir)
    if found is None:
        raise RunError(f"{run_dir / CHECKPOINT} not found: {run_dir} has no checkpoint")
    config = train_config_from(record["train_config"], {}, {})
    world = _recorded_world_size(record)
    model_config = model_config_from(None, {}, record["model_config"])
    data_dir = data or Path(record["data"]["dir"])
    loaders = _loaders(config.replace(batch_size=config.batch_size * world), model_config,
                       data_dir, None)
    seed_everything(config.seed)
    model = K3Model(model_config).to(device)
    state = TrainState()
    states = {"model": model, "counters": state,
              "loaders": {"train": loaders[0], "val": loaders[1]}}
    Checkpointer(states, run_metadata(check_model(model), config), READ_ONLY).load(found)
    return _Restored(model, config, state, loaders, data_dir)


def _recorded_world_size(record: dict[str, Any]) -> int:
    """The data-parallel world size of the run's last session (1 when it recorded none)."""
    sessions = record.get("sessions")
    last = sessions[-1] if isinstance(sessions, list) and sessions else {}
    layout = last.get("data_parallel") if isinstance(last, dict) else None
    size = layout.get("world_size") if isinstance(layout, dict) else 1
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 1


def _pretrained(model_dir: Path, data: Path | None, device: torch.device,
                flag: str = "--model") -> _Restored:
    """A hub folder's model with the validation data it is evaluated on (``--data``,
    prepared with the folder's tokenizer), read with the default recipe's batch shape."""
    if data is None:
        raise ConfigError(f"{flag} needs --data: a dataset prepared with the model's "
                          "tokenizer (k3-train prepare ... --tokenizer MODEL/tokenizer.json)")
    model = load_folder(model_dir, device)
    config = TrainConfig(seq_len=min(TrainConfig().seq_len, model.config.max_seq_len))
    loaders = _loaders(config, model.config, data, None)
    note = check_tokenizer(model_dir, load_codec(data, loaders[0].manifest), data, flag)
    if note is not None:
        print(f"k3-train: note: {note}", file=sys.stderr)
    return _Restored(model, config, TrainState(), loaders, data)


def run_eval(run_dir: Path | None, data: Path | None, batches: int | str | None,
             device: torch.device, model_dir: Path | None = None) -> int:
    """``k3-train eval``: the validation loss of the run's checkpoint (or of the hub folder
    ``model_dir``) over ``batches`` full batches from the start of the split (default: the
    run's ``eval_batches``; ``"all"``: the whole split), with the number of tokens it
    measured."""
    if model_dir is not None:
        run = _pretrained(model_dir, data, device)
    else:
        assert run_dir is not None
        run = _restored(run_dir, data, device)
    val = run.loaders[1]
    available = (val.num_tokens - 1) // val.tokens_per_batch
    wanted = available if batches == "all" else int(batches or run.config.eval_batches)
    if wanted > available:
        print(f"k3-train: note: --batches {wanted} is more than the validation split holds "
              f"({available} full batches); evaluating all {available}", file=sys.stderr)
        wanted = available
    result = evaluate_split(run.model, val, device, wanted, run.config.precision)
    bpb = "" if result.bpb is None else f", val_bpb {result.bpb:.4f}"
    where = f"step {run.state.step}" if model_dir is None else str(model_dir)
    print(f"{where}: val_loss {result.loss:.4f}{bpb} "
          f"({result.tokens:,} tokens in {wanted} of {available} batches)")
    return 0


@dataclass(frozen=True)
class SampleCommand:
    """``k3-train sample``'s arguments: a run (``run_dir``) or a hub folder
    (``model_dir``)."""

    run_dir: Path | None
    sampling: Sampling
    prompt: str = ""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    model_dir: Path | None = None


def run_sample(command: SampleCommand) -> int:
    """Print the prompt and a continuation from the run's checkpoint (strictly loaded) or
    from a hub folder with its own tokenizer."""
    if command.model_dir is not None:
        codec = folder_codec(command.model_dir)
        model = load_folder(command.model_dir, command.device)
    else:
        assert command.run_dir is not None
        if find_checkpoint(command.run_dir) is None:
            raise RunError(f"{command.run_dir / CHECKPOINT} not found: {command.run_dir} has "
                           "no checkpoint to sample from; train it first")
        run = _restored(command.run_dir, None, command.device)
        model, codec = run.model, load_codec(run.data_dir, run.loaders[0].manifest)
    if callable(getattr(model, "generate", None)):
        _note_room(codec, command.prompt, command.sampling.max_new_tokens,
                   model.config.max_seq_len)
    many = command.sampling.num_samples > 1
    stream = TextStream(codec) if sys.stdout.isatty() and not many else None
    if stream is not None:  # a terminal: the text as it is produced
        print(command.prompt, end="", flush=True)
    texts = sample_text(model, codec, command.prompt, command.sampling,
                        max_seq_len=model.config.max_seq_len, device=command.device,
                        stream=stream)
    for number, text in enumerate(texts, 1):
        if stream is not None:
            print(text[len(command.prompt) + stream.shown:])  # what was held back, if any
            continue
        if many:
            print(f"--- sample {number} of {len(texts)} ---")
        print(text)
    return 0


def _note_room(codec: Codec, prompt: str, max_new_tokens: int, max_seq_len: int) -> None:
    """Say what decoding with the cache leaves out (:func:`context_room`): the new tokens
    and the prompt's last tokens must fit in ``max_seq_len``."""
    length = 1 + (len(codec.encode_batch([prompt])[0]) if prompt else 0)
    kept, new_tokens = context_room(length, max_new_tokens, max_seq_len)
    if new_tokens < max_new_tokens:
        print(f"k3-train: note: --max-new-tokens {max_new_tokens} does not fit in the "
              f"model's max_seq_len {max_seq_len}; generating at most {new_tokens}",
              file=sys.stderr)
    if kept < length:
        print(f"k3-train: note: the prompt is {length} tokens; its last {kept} are read, "
              f"leaving room for {new_tokens} new ones in max_seq_len {max_seq_len}",
              file=sys.stderr)


def run_export(run_dir: Path, out: Path, *, data: Path | None, dtype: str,
               device: torch.device, overwrite: bool = False) -> int:
    """``k3-train export``: the run's latest checkpoint as a hub folder with its tokenizer."""
    from k3_model.hub import hub_form

    run = _restored(run_dir, data, device)
    codec = load_codec(run.data_dir, run.loaders[0].manifest)
    written = export_model(run.model.cpu(), codec, out, dtype=dtype, overwrite=overwrite)
    size = sum(p.stat().st_size for p in written.iterdir())
    form = hub_form(run.model.config)
    loads = ("transformers (AutoModelForCausalLM), vLLM and SGLang load it"
             if form == "kimi_linear" else
             "Kimi K3's text-model names: SGLang's kimi_k3 loads them; transformers has no "
             "kimi_k3 model")
    print(f"k3-train: exported step {run.state.step} of {run_dir} to {written} "
          f"({form}, {dtype}, {size / 2**20:.1f} MiB); {loads}")
    return 0


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
