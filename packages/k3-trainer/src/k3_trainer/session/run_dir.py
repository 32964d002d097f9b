"""What a run directory holds, as the session reads it: whether a run is there, its record
(``run.json``), its checkpoints by step, the mixture it trained on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class RunState:
    """What a session finds in its run directory, and so what it does with it."""

    record: RunRecord | None
    """The run's record: read to continue it, or kept to start it again (None: no run)."""
    checkpoint: Path | None
    """The checkpoint this session resumes from (None: the run starts)."""
    branch: bool = False
    """``--resume-from`` an older checkpoint than the latest: a new branch of the run."""

    @property
    def resume(self) -> bool:
        return self.checkpoint is not None


def run_state(
    run_dir: Path,
    *,
    resume: bool,
    resume_from: Path | None = None,
    say: Callable[[str], object] = print,
) -> RunState:
    """The session's starting point in ``run_dir``: a fresh run, a resume (of the latest
    checkpoint, or of ``resume_from``: a branch when it is older), or a restart of a run
    killed before its first checkpoint; a ``RunError`` when the directory is in a state the
    request cannot use (a run there and no ``--resume``; a checkpoint on record but gone)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"--run-dir {run_dir} is a file, not a directory")
    found = find_checkpoint(run_dir)
    resume = resume or resume_from is not None
    branch = False
    if resume_from is not None:
        branch = branch_point(run_dir, resume_from) != found
        found = resume_from
    if resume and found is None:
        saved_at = recorded_checkpoint_step(run_dir)
        if saved_at is not None:  # moved or deleted: starting over would lose the run
            raise RunError(
                f"{run_dir / METRICS} records a checkpoint saved at step {saved_at}, but "
                f"{run_dir} holds none ({HISTORY}/, or {CHECKPOINT} from an earlier "
                "version): put it back, or choose another --run-dir"
            )
        # Nothing written yet, or killed before its first checkpoint: nothing to lose, so a
        # supervisor that restarts with --resume until success gets a run, not a loop.
        if has_run(run_dir):
            say(f"{run_dir} stopped before its first checkpoint; nothing to resume, so the "
                "run starts from scratch")
            return RunState(restart_record(run_dir), None)
        say(f"{run_dir} holds no run yet; nothing to resume, so the run starts")
        return RunState(None, None)
    if resume:
        return RunState(read_record(run_dir), found, branch)
    if has_run(run_dir):
        if found is None:
            raise RunError(
                f"{run_dir} already holds a run that stopped before its first checkpoint; "
                "pass --resume to start it again from scratch, or choose another --run-dir"
            )
        raise RunError(
            f"{run_dir} already holds a run; pass --resume to continue it or choose "
            "another --run-dir"
        )
    return RunState(None, None)


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
    """The data ranks of the run's last session (1 when it recorded none): the ranks that
    read different rows, whose rows together are the run's global batch."""
    last = record.last_session
    layout = last.data_parallel if last is not None else None
    return layout.data_ranks if layout is not None else 1
