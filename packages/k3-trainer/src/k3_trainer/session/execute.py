"""A training session carried out: the plan checked against the run directory, the
trainer built and resumed, the session and its phase recorded in ``run.json``, then
training with the plan's callbacks; ``train`` wraps it in torchrun's process group."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import k3_checkpoint

from ..callbacks import MetricsLog, Report
from ..callbacks.downstream import DownstreamEvaluator
from ..checkpoint import run_history
from ..config import ConfigError
from ..data import document_start, load_codec
from ..data.loader import manifest_digest, read_manifest
from ..distributed import Parallel, init_parallel, shutdown
from ..interrupt import StopOnSignal
from ..observe.metrics import mark_superseded
from ..planning.layout import check_launch
from ..precision import validate_precision
from ..record import (
    METRICS,
    Branch,
    DataParallel,
    Phase,
    RecordedData,
    RecordedSource,
    RunRecord,
    Session,
)
from ..schedule import horizon_notes, phase_lr_warning
from ..state import TrainState
from ..tasks import DownstreamTasks, parse_tasks
from ..torchrun import launched_world_size
from ..trainer import Trainer
from .build import build_trainer, max_seq_len_of, parse_device
from .messages import Say, to_stderr, to_stdout
from .plan import Plan, resolve
from .request import TrainRequest
from .run_dir import RunError

Explain = Callable[[k3_checkpoint.CheckpointError, Plan], k3_checkpoint.CheckpointError]
"""Turns a refused resume's error into one that says how to go on, in the caller's terms."""

ABANDONED = (
    "k3-train: interrupted again: stopping now, the save in progress is abandoned; "
    "the previous checkpoint is intact (continue with --resume)"
)


def train(
    request: TrainRequest,
    notes: tuple[str, ...] = (),
    *,
    say: Say = to_stderr,
    result: Say = to_stdout,
    explain: Explain | None = None,
) -> int:
    """The whole session: join the process group ``request.parallel`` names (torchrun's),
    resolve the plan on every rank, execute it, and leave the group cleanly; returns the
    exit status (0: trained, or already complete)."""
    plan = resolve(request, notes, say)
    _check_launch(plan, launched_world_size())  # before any group
    parallel, device = init_parallel(request.parallel, parse_device(request.device),
                                     plan.config.pipeline_parallel,
                                     plan.config.context_parallel)
    clean = False
    try:
        status = execute(plan, device, parallel, say=say, result=result, explain=explain)
        clean = True
        return status
    finally:
        shutdown(parallel, clean=clean)


def check_before_launch(request: TrainRequest, world_size: int) -> None:
    """Raise what :func:`train` on each of ``world_size`` processes would refuse before
    any process group, before they are launched (``k3-train train --nproc N``), so a
    layout that cannot run is one line from the launcher, not one per rank under
    torchrun's report. The plan is resolved as every rank will resolve it, saying
    nothing (the ranks say it); nothing is written but the built-in corpus, prepared
    once here instead of by every rank."""
    _check_launch(resolve(request, (), _silent), world_size)


def _check_launch(plan: Plan, world_size: int) -> None:
    n_layers = getattr(plan.model_config, "n_layers", None)
    check_launch(plan.config, plan.request.parallel, world_size,
                 n_blocks=n_layers if isinstance(n_layers, int) else None,
                 spec=plan.spec, model_config=plan.model_config)


def _silent(line: str) -> None:
    pass


def execute(
    plan: Plan,
    device: torch.device,
    parallel: Parallel | None,
    *,
    say: Say = to_stderr,
    result: Say = to_stdout,
    explain: Explain | None = None,
) -> int:
    """Carry out ``plan``: check data, model and checkpoint before writing anything into
    the run directory, then train with the plan's callbacks (rank 0 alone writes and
    says what happens: progress through ``say``, the outcome through ``result``). A
    refused resume's ``CheckpointError`` goes through ``explain`` (the caller's hint in
    its own terms) before it is raised."""
    main = parallel is None or parallel.is_main
    request, config = plan.request, plan.config
    run_dir = request.run_dir
    validate_precision(config.precision, device)
    history = run_history(run_dir, config.keep_last, config.keep_every)
    trainer = build_trainer(plan, device, parallel, history)
    runtime_changes: dict[str, Any] = {}
    resumed_from: Path | None = None
    if plan.resume_from is not None:
        try:
            resumed = trainer.resume(
                plan.resume_from,
                allow_runtime_change=request.allow_runtime_change,
                new_phase=plan.phase is not None,
            )
        except k3_checkpoint.CheckpointError as error:
            if explain is None:
                raise
            raise explain(error, plan) from error
        runtime_changes, resumed_from = resumed.runtime_changes, resumed.path
        if trainer.state.step >= config.max_steps and not plan.phase_new and not plan.branch:
            # Success for a supervisor that restarts until the run is done.
            result(
                f"run already complete at step {trainer.state.step}; nothing to do "
                "(raise --max-steps to extend it)"
            )
            return 0
    downstream = _downstream(plan, trainer)
    if downstream is not None:  # on every rank: each scores its share
        trainer.callbacks.extend((downstream,))
    if parallel is not None:
        parallel.barrier()  # every rank has checked the run directory before rank 0 writes
    if not main:
        with StopOnSignal(trainer):
            trainer.fit()  # the same training, writing nothing but its share of checkpoints
        return 0
    phase = (
        Phase(plan.phase, trainer.state.step, plan.phase_changes)
        if plan.phase_new and plan.phase is not None
        else None
    )
    branch: Branch | None = None
    try:  # the session's first writes: a run directory it cannot write is the user's to fix
        if plan.resume_from is None:
            (run_dir / METRICS).unlink(missing_ok=True)  # a restart's stale events, if any
        else:  # steps past the checkpoint are trained again (or, on a branch, otherwise)
            superseded = mark_superseded(run_dir / METRICS, trainer.state.step)
            if plan.branch and resumed_from is not None:
                branch = Branch(str(resumed_from), trainer.state.step, superseded)
        run_dir.mkdir(parents=True, exist_ok=True)
        RunRecord.extending(run_dir).with_session(
            Session.now(
                str(device),
                resumed_from_step=(trainer.state.step if plan.resume_from is not None else None),
                resumed_from=None if resumed_from is None else str(resumed_from),
                data_parallel=None
                if parallel is None
                else DataParallel.from_json(parallel.describe()),
                init_from=None if plan.init_from is None else str(plan.init_from.resolve()),
            ),
            train_config=config.to_dict(),
            model=plan.spec.name,
            model_config=plan.spec.config_dict(plan.model_config),
            preset=plan.preset,
            data=RecordedData(
                str(plan.data_dir.resolve()),
                manifest_digest(read_manifest(plan.data_dir)),
                _sources(plan),
            ),
            phase=phase,
            branch=branch,
        ).write(run_dir)
        metrics = MetricsLog(run_dir / METRICS)
    except PermissionError as error:
        raise RunError(
            f"--run-dir {run_dir} is not writable ({error.strerror}: "
            f"{error.filename}); fix its permissions or choose another --run-dir"
        ) from None
    # Said once every check has passed and the session is really going to train.
    if plan.resume_from is not None:  # --resume and --resume-from: where training goes on
        say(f"resumed from step {trainer.state.step} ({trainer.state.tokens_seen:,} tokens seen)")
    for note in (*plan.notes, *horizon_notes(config, horizon_unset=plan.horizon_unset)):
        say(f"note: {note}")
    planned = _planned_memory(plan, device, parallel)
    if planned is not None:
        say(planned)
    if phase is not None and plan.phase_before is not None:
        jump = phase_lr_warning(phase.name, plan.phase_before, config, trainer.state.step)
        if jump is not None:  # a warning, not a refusal: the phase starts all the same
            say(f"warning: {jump}")
    with metrics:
        trainer.callbacks.extend((metrics, *plan.callbacks))
        if runtime_changes:
            _report_runtime_changes(metrics, trainer.state, runtime_changes, say)
        if branch is not None:
            metrics.write("branch", **branch.to_json())
        if phase is not None:
            metrics.write("phase_start", **phase.to_json())
        with StopOnSignal(trainer, last_words=ABANDONED):
            trainer.fit()
        result(_summary(metrics, run_dir))
    report = next((c for c in plan.callbacks if isinstance(c, Report)), None)
    if report is not None and report.written is not None:
        result(f"report in {report.written}")
    return 0


def _planned_memory(plan: Plan, device: torch.device, parallel: Parallel | None) -> str | None:
    """``k3-train plan``'s memory line for this run's layout (K3 models; None for others),
    from the meta-device model: no allocation, a fraction of a second for the presets."""
    from ..planning.launch import memory_line
    from ..planning.model import plannable

    if not plannable(plan.model_config):
        return None

    memory = (torch.cuda.get_device_properties(device).total_memory
              if device.type == "cuda" else None)
    return memory_line(
        plan.model_config, plan.config,
        world_size=1 if parallel is None else parallel.world_size,
        mode="none" if parallel is None else parallel.mode, device_memory=memory)


def _downstream(plan: Plan, trainer: Trainer) -> DownstreamEvaluator | None:
    """The in-loop downstream evaluation the config asks for (its tasks read and checked
    against the model's vocabulary now, before anything is written)."""
    config = plan.config
    if config.downstream is None:
        return None
    if config.context_parallel > 1 and not hasattr(trainer.model, "score_continuations"):
        # Its plain forward takes this rank's slice of every row; each rank scores
        # whole documents of its own share, which only the decoding path does.
        raise ConfigError(
            "--downstream with --context-parallel > 1 needs a model that scores through "
            "its decoding path (score_continuations); score the checkpoints afterwards "
            "(k3-train eval --tasks)"
        )
    vocab = trainer.contract.vocab_size
    if vocab is None:
        raise ConfigError("--downstream: the model declares no vocab_size")
    data_dir = plan.sources[0].path if plan.sources else plan.data_dir
    codec = load_codec(data_dir, read_manifest(data_dir))
    tasks = DownstreamTasks(
        parse_tasks(config.downstream),
        codec,
        limit=config.downstream_limit,
        bos=document_start(codec),
    )
    return DownstreamEvaluator(
        tasks,
        config.downstream_interval or config.eval_interval,
        vocab_size=vocab,
        max_len=max_seq_len_of(plan.model_config, config),
    )


def _sources(plan: Plan) -> tuple[RecordedSource, ...]:
    """The record of a mixture: each source's name, folder, weight and data digest."""
    return tuple(
        RecordedSource(
            s.name, str(s.path.resolve()), s.weight, manifest_digest(read_manifest(s.path))
        )
        for s in plan.sources
    )


def _report_runtime_changes(
    log: MetricsLog, state: TrainState, changes: dict[str, Any], say: Say
) -> None:
    """``--allow-runtime-change`` accepted another runtime: say so, once, in both places."""
    named = {
        key.removeprefix("runtime."): {"saved": saved, "current": current}
        for key, (saved, current) in changes.items()
    }
    log.write("runtime_changed", step=state.step, changes=named)
    listed = ", ".join(f"{k} {v['saved']} → {v['current']}" for k, v in named.items())
    say(
        f"warning: resuming under another runtime ({listed}); the run continues correctly "
        "but is no longer bitwise-identical to an uninterrupted one"
    )


def _summary(log: MetricsLog, run_dir: Path) -> str:
    """The session's outcome in one line: steps, loss, validation, speed, where."""
    train_events = [e for e in log.events if e["event"] == "train"]
    evals = [e for e in log.events if e["event"] == "eval" and "val_loss" in e]
    end: dict[str, Any] = next((e for e in reversed(log.events) if e["event"] == "session_end"), {})
    parts = [f"step {end.get('step')}"]
    if train_events:
        parts.append(f"loss {train_events[0]['loss']:.3f} → {train_events[-1]['loss']:.3f}")
    if evals:
        bpb = evals[-1].get("val_bpb")
        parts.append(
            f"val_loss {evals[-1]['val_loss']:.3f}"
            + (f", val_bpb {bpb:.3f}" if isinstance(bpb, float) else "")
            + f" ({evals[-1].get('val_tokens', 0):,} validation tokens)"
        )
    rates = [e["tokens_per_s"] for e in train_events if e.get("tokens_per_s")]
    if rates:
        parts.append(f"{sum(rates) / len(rates):,.0f} tokens/s (active training)")
    return f"{', '.join(parts)}; run in {run_dir}"
