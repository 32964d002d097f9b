"""``k3-train train``: the flags parsed into a :class:`~k3_trainer.session.TrainRequest`,
the session run by the library (:func:`k3_trainer.session.train`), and a refused resume
explained in command-line terms (how to relaunch, which flag to pass)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import k3_checkpoint

from ..checkpoint import HISTORY, CheckpointHistory
from ..checkpoint.compatibility import PHASE_MAY_CHANGE
from ..config import ConfigError
from ..data import DataError
from ..data.loader import DataMismatch
from ..session import Plan, RunError, TrainRequest, check_before_launch, read_record
from ..session import train as train_session
from .launch import prog_name
from .options import TrainCommand
from .sources import command_line_data
from .threads import THREADS_ENV


def run(command: TrainCommand, notes: tuple[str, ...] = ()) -> int:
    """Train as the flags say; lines go to stderr (progress) and stdout (the outcome)."""
    who = prog_name()
    return train_session(
        request_of(command),
        notes,
        say=lambda line: print(f"{who}: {line}", file=sys.stderr),
        result=lambda line: print(f"{who}: {line}"),
        explain=explain,
    )


def refused_launch(command: TrainCommand, processes: int) -> str | None:
    """Why every rank of ``train --nproc processes`` would refuse to start (one line), or
    None: said by the launcher before torchrun starts any process."""
    try:
        check_before_launch(request_of(command), processes)
    except (ConfigError, DataError, k3_checkpoint.CheckpointError, RunError,
            FileNotFoundError) as exc:
        return str(exc)
    return None


def request_of(command: TrainCommand) -> TrainRequest:
    """The library's request for the parsed flags (``--data`` strings made sources)."""
    data = None
    if command.data:
        folder, sources = command_line_data(command.data)
        data = sources or folder
    return TrainRequest(
        command.run_dir,
        data,
        command.config,
        command.model,
        command.init_from,
        command.resume,
        command.resume_from,
        command.preset,
        command.device,
        command.report,
        command.tensorboard,
        command.profile_start,
        command.profile_steps,
        command.phase,
        command.allow_runtime_change,
        command.parallel,
        dict(command.train_fields),
        dict(command.model_fields),
    )


def explain(error: k3_checkpoint.CheckpointError, plan: Plan) -> k3_checkpoint.CheckpointError:
    """A refused resume's error with the way on: the run's own launch or data, a new phase,
    or the newest older checkpoint."""
    hinted = _with_data_hint(_with_runtime_hint(error, plan.request), plan)
    return _with_older_hint(hinted, plan)


def _with_runtime_hint(
    error: k3_checkpoint.CheckpointError, command: TrainRequest
) -> k3_checkpoint.CheckpointError:
    """``error``, saying in command-line terms how to continue when what it refused is only
    the runtime or the data-parallel layout: relaunch as the run last ran (its thread
    count, its torchrun layout, from run.json), or opt in to the change."""
    if command.allow_runtime_change or not isinstance(
            error, k3_checkpoint.IncompatibleCheckpoint) or error.sections[0] not in (
            "runtime", "data_parallel"):
        return error
    relaunch = _relaunch_advice(command.run_dir, layout=error.sections[0] == "data_parallel")
    return error.with_hint(f"{relaunch}pass --allow-runtime-change to continue anyway (no "
                           "bitwise promise)")


def _relaunch_advice(run_dir: Path, *, layout: bool) -> str:
    """``relaunch … or `` naming how the run's last session was launched, or ``""`` when
    its record does not say (or says nothing this session could change)."""
    try:
        last = read_record(run_dir).last_session
    except RunError:
        return ""
    if layout:
        recorded = last.data_parallel if last is not None else None
        if recorded is None:
            return "relaunch in one process as the run was (no --parallel), or "
        degree = recorded.expert_parallel
        experts = f" --expert-parallel {degree}" if degree is not None else ""
        if recorded.cp is not None:
            experts += f" --cp {recorded.cp}"
        return (f"relaunch as the run was launched (--parallel {recorded.mode} "
                f"--nproc {recorded.world_size}{experts}), or ")
    threads = last.host.torch_threads if last is not None else None
    if threads is not None and threads != torch.get_num_threads():
        return f"relaunch with {THREADS_ENV}={threads} as the run's last session ran, or "
    return ""


def _with_data_hint(error: k3_checkpoint.CheckpointError,
                    plan: Plan) -> k3_checkpoint.CheckpointError:
    """``error``, naming the dataset folders when the checkpoint belongs to other data, and
    ``--phase`` when a new phase could make the change it refused."""
    phase = "" if plan.phase is not None else (
        "; to change the data or the decay of a run, start a new phase of it (--phase NAME)")
    if _other_data(error) and plan.recorded_data is not None:
        return error.with_hint(
            f"the run was trained on {plan.recorded_data}, this session reads "
            f"{plan.data_dir} (pass --data with the run's dataset, unchanged){phase}")
    if phase and isinstance(error, k3_checkpoint.IncompatibleCheckpoint) and any(
            path in PHASE_MAY_CHANGE for path in error.paths):
        return error.with_hint(phase.removeprefix("; "))
    return error


def _other_data(error: k3_checkpoint.CheckpointError) -> bool:
    """Whether a loader refused its saved state as another dataset's or mixture's."""
    return isinstance(error, k3_checkpoint.ComponentRefused) \
        and isinstance(error.error, DataMismatch)


def _with_older_hint(error: k3_checkpoint.CheckpointError,
                     plan: Plan) -> k3_checkpoint.CheckpointError:
    """``error`` of a ``--resume`` from the latest checkpoint, naming the newest older one
    and the command that continues from it: a damaged latest checkpoint need not end the
    run. A refusal of the configuration is left alone (an older checkpoint has the same)."""
    if (
        plan.request.resume_from is not None
        or _other_data(error)
        or isinstance(error, k3_checkpoint.IncompatibleCheckpoint)
    ):
        return error
    run_dir = plan.request.run_dir
    history = CheckpointHistory(run_dir / HISTORY)
    latest = history.latest()
    older = [e for e in history.entries() if latest is None or e.path != latest]
    if latest is None or plan.resume_from is None \
            or latest.resolve() != Path(plan.resume_from).resolve():
        return error
    if not older:
        return error.with_hint("no older checkpoint is kept (--keep-last N keeps more)")
    newest = older[-1]
    return error.with_hint(
        f"the newest older checkpoint is {newest.path} (step {newest.step}): continue from "
        f"it with `k3-train train --run-dir {run_dir} --resume-from {newest.path}`"
    )
