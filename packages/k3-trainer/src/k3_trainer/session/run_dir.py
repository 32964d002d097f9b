"""What a run directory holds, as the session reads it: whether a run is there, its record
(``run.json``), its checkpoints by step, the mixture it trained on."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import (
    CHECKPOINT,
    HISTORY,
    LATEST,
    SHARDED_CHECKPOINT,
    CheckpointHistory,
    find_checkpoint,
)
from ..data.mixture import Source
from ..observe import read_events
from ..observe.metrics import current
from ..record import METRICS, RUN_RECORD, RecordError, RunRecord


class RunError(Exception):
    """The run directory is not in the state the command needs."""


def read_record(run_dir: Path) -> RunRecord:
    """``run.json``, checked to hold what a resume or an evaluation reads from it."""
    try:
        return RunRecord.read(run_dir)
    except FileNotFoundError as exc:
        raise RunError(str(exc)) from None
    except RecordError as exc:  # unreadable JSON, not a run record, or lacking the configs
        raise RunError(f"{exc}; the run directory is damaged") from None


def has_run(run_dir: Path) -> bool:
    return any(
        (run_dir / name).exists()
        for name in (HISTORY, CHECKPOINT, SHARDED_CHECKPOINT, METRICS, RUN_RECORD)
    )


def recorded_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the last checkpoint ``metrics.jsonl`` says was saved, or None."""
    metrics = run_dir / METRICS
    try:
        events = current(read_events(metrics)) if metrics.is_file() else []
    except (OSError, UnicodeDecodeError):
        return None
    steps = [e.get("step") for e in events if e.get("event") == "checkpoint"]
    return steps[-1] if steps and isinstance(steps[-1], int) else None


def branch_point(run_dir: Path, path: Path) -> Path:
    """``--resume-from``'s checkpoint, which must be one of the run's history (resolved)."""
    history = CheckpointHistory(run_dir / HISTORY)
    if not path.exists():
        raise RunError(f"--resume-from {path}: no such checkpoint; {_kept(history)}")
    entry = next((e.path for e in history.entries() if e.path.resolve() == path.resolve()), None)
    if entry is None:
        where = (
            "was superseded by an earlier --resume-from; move it back into "
            f"{history.root} to continue from it"
            if path.resolve().parent.parent == history.root.resolve()
            else f"is not a checkpoint of {run_dir}"
        )
        raise RunError(f"--resume-from {path} {where}; {_kept(history)}")
    return entry


def _kept(history: CheckpointHistory) -> str:
    steps = history.steps()
    return (
        f"{history.root} keeps steps {', '.join(map(str, steps))}"
        if steps
        else f"{history.root} holds no checkpoint"
    )


def restart_record(run_dir: Path) -> RunRecord | None:
    """The configs a run that died before its first checkpoint was started with, or None
    when its run.json is missing or damaged (then the command line alone decides)."""
    try:
        return read_record(run_dir)
    except RunError:
        return None


def checkpoint_at(run_dir: Path, step: int | None) -> Path:
    """The run's latest checkpoint, or (``step``) the one its history kept for that step;
    ``RunError`` naming the steps it has when there is none."""
    own = (run_dir / LATEST).is_symlink()  # a history folder itself
    history = CheckpointHistory(run_dir if own else run_dir / HISTORY)
    if step is None:
        found = history.latest() if own else find_checkpoint(run_dir)
        if found is None:
            raise RunError(
                f"{run_dir} has no checkpoint ({run_dir / HISTORY} is empty or "
                "missing): train it first"
            )
        return found
    at = history.at_step(step)
    if at is None:
        kept = history.steps()
        listed = (
            f"it keeps steps {', '.join(map(str, kept))}"
            if kept
            else "it holds no checkpoint history"
        )
        raise RunError(
            f"--step {step}: {run_dir} has no checkpoint of step {step}; {listed} "
            "(train with --keep-last N or --keep-every K to keep more)"
        )
    return at


def recorded_sources(record: RunRecord) -> tuple[Source, ...]:
    """The mixture a run's record names (none for a run on one dataset)."""
    return tuple(Source(s.name, Path(s.dir), s.weight) for s in record.data.sources)


def recorded_world_size(record: RunRecord) -> int:
    """The data-parallel world size of the run's last session (1 when it recorded none)."""
    last = record.last_session
    layout = last.data_parallel if last is not None else None
    return layout.world_size if layout is not None and layout.world_size is not None else 1
