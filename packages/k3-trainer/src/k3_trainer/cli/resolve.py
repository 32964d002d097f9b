"""A ``k3-train train`` session's plan, resolved from the run directory's state and the
command line before anything is built or written.

Fresh: defaults ← preset ← config file ← flags (the model's vocabulary grows to the data's
tokenizer unless set); resumed: the run's recorded configs ← config file ← flags. The
plan holds everything the session then does: the model spec and both configs, the data,
the checkpoint to resume, the notes to print and the callbacks that observe the run.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..callbacks import Callback, LogLines, ProfilerWindow, ProgressBar, Report, TensorBoard
from ..checkpoint import (
    CHECKPOINT,
    HISTORY,
    SHARDED_CHECKPOINT,
    TRAINER_POLICY,
    CheckpointHistory,
    find_checkpoint,
)
from ..config import ConfigError, TrainConfig
from ..data import read_manifest
from ..data.loader import MANIFEST_FORMAT, manifest_digest
from ..data.mixture import Source
from ..data.prepare import prepare_dataset
from ..models import DEFAULT_MODEL, HubFolderError, ModelSpec, get_model_spec
from ..observe import read_events
from ..observe.metrics import current
from ..observe.report import REPORT_DIR
from ..record import METRICS, RUN_RECORD, RecordError, RunRecord
from ..schedule import learning_rate_at_step
from .options import TrainCommand
from .sources import data_of, recorded_sources

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

VOCAB_MULTIPLE = 128


class RunError(Exception):
    """The run directory is not in the state the command needs."""


def builtin_data_dir() -> Path:
    """Where the built-in corpus is prepared once (per Python version: its text differs;
    ``topics``: one document per topic, not the one document of 0.1's cache)."""
    root = os.environ.get("K3_TRAIN_CACHE") or Path.home() / ".cache" / "k3-train"
    version = f"py{sys.version_info[0]}.{sys.version_info[1]}"
    return Path(root) / f"builtin-pydoc-topics-{version}-{MANIFEST_FORMAT.replace('/', '')}"


def resolve_data(data: Path | None) -> Path:
    if data is not None:
        return data
    path = builtin_data_dir()
    if not (path / "manifest.json").is_file():
        print(f"k3-train: preparing the built-in corpus into {path}", file=sys.stderr)
        prepare_dataset([], path, overwrite=True)
    return path


def model_config_from(spec: ModelSpec, preset: str | None, overrides: dict[str, Any],
                      recorded: dict[str, Any] | None) -> Any:
    try:
        return spec.config(preset, overrides, recorded)
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
               for name in (HISTORY, CHECKPOINT, SHARDED_CHECKPOINT, METRICS, RUN_RECORD))


def _recorded_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the last checkpoint ``metrics.jsonl`` says was saved, or None."""
    metrics = run_dir / METRICS
    try:
        events = current(read_events(metrics)) if metrics.is_file() else []
    except (OSError, UnicodeDecodeError):
        return None
    steps = [e.get("step") for e in events if e.get("event") == "checkpoint"]
    return steps[-1] if steps and isinstance(steps[-1], int) else None


def _branch_point(run_dir: Path, path: Path) -> Path:
    """``--resume-from``'s checkpoint, which must be one of the run's history (resolved)."""
    history = CheckpointHistory(run_dir / HISTORY)
    if not path.exists():
        raise RunError(f"--resume-from {path}: no such checkpoint; {_kept(history)}")
    entry = next((e.path for e in history.entries()
                  if e.path.resolve() == path.resolve()), None)
    if entry is None:
        where = ("was superseded by an earlier --resume-from; move it back into "
                 f"{history.root} to continue from it"
                 if path.resolve().parent.parent == history.root.resolve()
                 else f"is not a checkpoint of {run_dir}")
        raise RunError(f"--resume-from {path} {where}; {_kept(history)}")
    return entry


def _kept(history: CheckpointHistory) -> str:
    steps = history.steps()
    return (f"{history.root} keeps steps {', '.join(map(str, steps))}" if steps
            else f"{history.root} holds no checkpoint")


def read_record(run_dir: Path) -> RunRecord:
    """``run.json``, checked to hold what a resume or an evaluation reads from it."""
    try:
        return RunRecord.read(run_dir)
    except FileNotFoundError as exc:
        raise RunError(str(exc)) from None
    except RecordError as exc:  # unreadable JSON, not a run record, or lacking the configs
        raise RunError(f"{exc}; the run directory is damaged") from None


def read_toml(path: Path | None) -> dict[str, Any]:
    """``--config``: a TOML file with ``preset``, ``[train]`` and ``[model]``, checked."""
    if path is None:
        return {}
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"preset", "train", "model", "data"})
    if unknown:
        known = ["preset", "train", "model", "data"]
        raise ConfigError(f"config file {path}: unknown key {_suggest(unknown[0], known)}; "
                          "expected preset, [train], [model], [data.sources]")
    if not isinstance(data.get("preset", ""), str):
        raise ConfigError(f"config file {path}: preset must be a string, got "
                          f"{data['preset']!r}")
    for table in ("train", "model", "data"):
        if not isinstance(data.get(table, {}), dict):
            raise ConfigError(f"config file {path}: {table} must be a table ([{table}]), got "
                              f"{data[table]!r}")
    table = data.get("data", {})
    if set(table) - {"sources"} or not isinstance(table.get("sources", {}), dict):
        raise ConfigError(f"config file {path}: [data] holds one table, [data.sources], of "
                          "NAME = {{ path = \"DIR\", weight = W }}")
    return data


def _suggest(name: str, known: list[str]) -> str:
    """``'name'`` and, when a known name is close, ``(did you mean 'that'?)``."""
    close = difflib.get_close_matches(name, known, n=1)
    return f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def check_toml_fields(toml: dict[str, Any], spec: ModelSpec, path: Path | None) -> None:
    """Refuse a ``[train]`` or ``[model]`` key that names no field, with the closest one."""
    for table, names in (("train", [f.name for f in dataclasses.fields(TrainConfig)]),
                         ("model", list(spec.field_names))):
        for key in toml.get(table, {}):
            if key not in names:
                raise ConfigError(f"config file {path}: [{table}] has no field "
                                  f"{_suggest(key, names)}")


@dataclass(frozen=True)
class Plan:
    """A session's plan, resolved before anything is built or written."""

    command: TrainCommand
    spec: ModelSpec
    config: TrainConfig
    model_config: Any
    data_dir: Path
    resume_from: Path | None
    horizon_unset: bool
    preset: str | None = None
    """The preset the run was started from (recorded in run.json)."""
    recorded_data: str | None = None
    """The data folder the run's record names (to say which dataset a checkpoint needs)."""
    notes: tuple[str, ...] = ()
    """What resolving chose on the user's behalf, to say once the session is sure to train."""
    init_from: Path | None = None
    """The hub folder a fresh run loads its weights from (None: initialized from the seed,
    or resumed from its checkpoint)."""
    callbacks: tuple[Callback, ...] = ()
    """What observes the run besides metrics.jsonl (rank 0's; built, nothing written)."""
    sources: tuple[Source, ...] = ()
    """A weighted mixture's sources (none: the one dataset ``data_dir``, which is otherwise
    the first source, whose tokenizer every source shares)."""
    phase: str | None = None
    """A new phase this session starts (``--phase``): the data and the decay may change."""
    phase_changes: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What the phase changes, ``{what: [before, after]}`` (for run.json and the event)."""
    phase_new: bool = False
    """The phase starts in this session (False: a repeated command continues it)."""
    phase_before: TrainConfig | None = None
    """A new phase's run before it (the record's train config), whose learning rate at the
    checkpoint's step the phase's is compared with (:func:`phase_lr_warning`)."""
    branch: bool = False
    """``--resume-from`` an older checkpoint than the latest: a new branch of the run."""


def resolve(command: TrainCommand, notes: tuple[str, ...] = ()) -> Plan:
    """The session's plan from the run directory's state and the command line, or a
    ``RunError`` when the run directory is not in a state this command can use (``notes``:
    the caller's own, said with the plan's)."""
    run_dir, toml = command.run_dir, read_toml(command.config)
    preset = command.preset or toml.get("preset")
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"--run-dir {run_dir} is a file, not a directory")
    record: RunRecord | None = None
    found = find_checkpoint(run_dir)
    resume = command.resume or command.resume_from is not None
    branch = False
    if command.resume_from is not None:
        branch = _branch_point(run_dir, command.resume_from) != found
        found = command.resume_from
    if resume and found is None:
        saved_at = _recorded_checkpoint_step(run_dir)
        if saved_at is not None:  # moved or deleted: starting over would lose the run
            raise RunError(f"{run_dir / METRICS} records a checkpoint saved at step "
                           f"{saved_at}, but {run_dir} holds none ({HISTORY}/, or "
                           f"{CHECKPOINT} from an earlier version): put it back, or choose "
                           "another --run-dir")
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
    if command.phase is not None and not resume:
        raise ConfigError(f"--phase {command.phase} needs --resume: a phase continues a run "
                          "from its checkpoint")
    spec = _model_spec(command, record)
    check_toml_fields(toml, spec, command.config)
    model_fields = {**toml.get("model", {}), **command.model_fields}
    given_dir, sources = data_of(command.data, toml)
    said: tuple[str, ...] = ()
    init_from = command.init_from
    if init_from is not None and resume:
        said = (f"--init-from {init_from} is not read: the run's checkpoint holds its "
                "weights (it starts a run only)",)
        init_from = None
    if init_from is not None:
        if preset is not None:
            raise ConfigError(f"--init-from {init_from} and --preset {preset} both choose the "
                              "model; drop --preset (the folder's config.json is the model)")
        config = train_config_from({}, toml, command.train_fields)
        model_config = _pretrained_model_config(spec, init_from, model_fields)
        data_dir = resolve_data(given_dir)
        said = _tokenizer_notes(init_from, data_dir)
    elif record is not None:
        config = train_config_from(record.train_config, toml, command.train_fields)
        model_config = model_config_from(spec, preset, model_fields, record.model_config)
        if given_dir is None:
            data_dir, sources = Path(record.data.dir), recorded_sources(record)
        else:
            data_dir = given_dir
            if resume and command.phase is None:
                _check_same_data(record, given_dir, sources)
    else:
        config = train_config_from({}, toml, command.train_fields)
        model_config = model_config_from(spec, preset, model_fields, None)
        data_dir = resolve_data(given_dir)
        if "vocab_size" in spec.field_names and "vocab_size" not in model_fields:
            model_config, said = _vocab_for_data(model_config, data_dir)
    horizon_unset = record is None and "decay_steps" not in {**toml.get("train", {}),
                                                            **command.train_fields}
    recorded_data = record.data.dir if record is not None else None
    phase, changes, new, before = None, {}, False, None
    if command.phase is not None and record is not None:
        phase = command.phase
        # A phase reads through a mixture loader, which takes over any saved cursor of the
        # same data: one dataset becomes a mixture of one.
        sources = sources or (Source("data", data_dir, 1.0),)
        changes = _phase_changes(record, config, data_dir, sources)
        started = None if changes else _started_at(record, phase)
        new = started is None
        before = train_config_from(record.train_config, {}, {}) if new else None
        listed = ", ".join(name.removeprefix("train_config.") for name in changes) or "nothing"
        said = (*said, f"phase {phase} starts at the checkpoint's step: it changes {listed}"
                if new else f"phase {phase} already started at step {started}; it continues")
    if preset is None and init_from is None:  # what the model was built from, on record
        preset = record.preset if record is not None else spec.default_preset
    return Plan(command, spec, config, model_config, data_dir, found if resume else None,
                horizon_unset, branch=branch, preset=preset, recorded_data=recorded_data,
                notes=(*notes, *said), init_from=init_from, callbacks=_callbacks(command),
                sources=sources, phase=phase, phase_changes=changes, phase_new=new,
                phase_before=before)


def _data_identity(data_dir: Path, sources: tuple[Source, ...]) -> list[str]:
    return [manifest_digest(read_manifest(path))
            for path in ([s.path for s in sources] or [data_dir])]


def _check_same_data(record: RunRecord, data_dir: Path,
                     sources: tuple[Source, ...]) -> None:
    """A resume's ``--data`` must be the run's own (checked first: any later refusal, a
    vocabulary that does not fit say, would blame something else)."""
    data = record.data
    recorded = [str(s.manifest_digest) for s in data.sources] or [str(data.manifest_digest)]
    if _data_identity(data_dir, sources) != recorded:
        given = ", ".join(f"{s.name}={s.path}" for s in sources) or str(data_dir)
        raise ConfigError(
            f"--data {given} belongs to different data than the run: the run was trained on "
            f"{data.dir}, this session reads {given}; pass --data with the run's dataset, "
            f"unchanged, or leave it out ({RUN_RECORD} names it); to change the data of a run, "
            "start a new phase of it (--phase NAME)")


def describe_data(data_dir: Path, sources: tuple[Source, ...]) -> Any:
    """The data as run.json and a phase's changes name it: a folder, or the mixture."""
    if not sources:
        return str(data_dir.resolve())
    return [{"name": s.name, "dir": str(s.path.resolve()), "weight": s.weight}
            for s in sources]


def _phase_changes(record: RunRecord, config: TrainConfig, data_dir: Path,
                   sources: tuple[Source, ...]) -> dict[str, Any]:
    """What a phase changes against the run's record: config fields and the data (not the
    fields any resume may change, such as max_steps)."""
    before = train_config_from(record.train_config, {}, {})
    changes: dict[str, Any] = {
        f"train_config.{name}": [getattr(before, name), getattr(config, name)]
        for name in (f.name for f in dataclasses.fields(TrainConfig))
        if getattr(before, name) != getattr(config, name)
        and f"train_config.{name}" not in TRAINER_POLICY.may_differ}
    before_dir, before_sources = Path(record.data.dir), recorded_sources(record)
    if _weighted_identity(before_dir, before_sources) != _weighted_identity(data_dir, sources):
        changes["data"] = [describe_data(before_dir, before_sources),
                           describe_data(data_dir, sources)]
    return changes


LR_TOLERANCE = 1e-6
"""The relative difference below which two learning rates are the same (a phase that keeps
its run's LR within it continues smoothly and is not warned about)."""

SCHEDULE_FIELDS = ("lr_schedule", "decay_steps", "decay_fraction", "decay_shape",
                   "min_lr_ratio", "peak_lr", "warmup_steps")
"""The train config's fields that :func:`learning_rate_at_step` reads."""


def phase_lr_warning(phase: str, before: TrainConfig, after: TrainConfig,
                     step: int) -> str | None:
    """One line when phase ``phase``, starting from the checkpoint at ``step``, jumps the
    learning rate: the run's schedule (``before``) and the phase's (``after``) give
    different LRs at ``step``. It says by how much and names a ``decay_fraction`` or
    ``decay_steps`` (the user's other values kept) that would continue at the run's LR,
    each checked with the schedule itself; None when the LR is continuous."""
    if step < 1:
        return None
    old, new = learning_rate_at_step(before, step), learning_rate_at_step(after, step)
    if _same_lr(old, new):
        return None
    if old:
        percent = (new - old) / old * 100
        jump = f"{percent:+.1f}%" if abs(percent) >= 0.1 else f"{percent:+.2g}%"
    else:
        jump = "from zero"
    return (f"phase {phase} jumps the learning rate at the checkpoint's step {step}: "
            f"{old:.4g} (the run's schedule) → {new:.4g} (the phase's), {jump}; "
            f"{_lr_advice(before, after, step, old)}")


def _same_lr(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=LR_TOLERANCE)


def _lr_advice(before: TrainConfig, after: TrainConfig, step: int, lr: float) -> str:
    """How to continue at ``lr``, the run's LR at ``step``: the flags that would (verified
    with :func:`learning_rate_at_step`), the phase's other values kept."""

    def keeps(changes: dict[str, Any]) -> bool:
        try:
            config = after.replace(**changes)
        except ConfigError:
            return False
        return _same_lr(learning_rate_at_step(config, step), lr)

    horizon, fraction = int(after.decay_steps or 0), after.decay_fraction
    if after.lr_schedule in ("wsd", "cosine"):
        # A WSD decay that starts at or after the step continues a run at its peak there;
        # a cosine has left the peak since warmup, so only WSD can.
        wsd: dict[str, Any] = {} if after.lr_schedule == "wsd" else {"lr_schedule": "wsd"}
        switch = "" if not wsd else "--lr-schedule wsd "
        options = []
        share = _fraction_starting_at(after.replace(**wsd), step)
        if share is not None and keeps({**wsd, "decay_fraction": float(share)}):
            options.append(f"{switch}--decay-fraction {share} (with decay_steps {horizon}: "
                           f"the decay then starts at step {step})")
        steps = _horizon_starting_at(after.replace(**wsd), step)
        if steps is not None and keeps({**wsd, "decay_steps": steps}):
            options.append(f"{switch}--decay-steps {steps} (with decay_fraction {fraction})")
        if options:
            why = ("a cosine decay leaves the peak when warmup ends, so use wsd: "
                   if wsd else "")
            return (f"to continue at {lr:.4g}, {why}the wsd decay must start at or after "
                    f"step {step} (decay_steps − round(decay_fraction·decay_steps) ≥ "
                    f"{step}): pass {' or '.join(options)}")
    if keeps({"decay_steps": step}):
        return (f"to stay at the floor {lr:.4g}, the decay must have ended by step {step}: "
                f"pass --decay-steps {step}")
    # Mid-decay (or another floor): only the run's own decay gives its LR there.
    kept = {name: getattr(before, name) for name in SCHEDULE_FIELDS
            if getattr(before, name) != getattr(after, name)}
    flags = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in kept.items())
    where = (f"the run was in its decay at step {step}: " if before.lr_schedule != "constant"
             and step < int(before.decay_steps or 0) and lr < before.peak_lr else "")
    return (f"{where}to continue at {lr:.4g}, keep the run's decay"
            + (f" ({flags})" if kept and keeps(kept) else ""))


def _fraction_starting_at(config: TrainConfig, step: int) -> str | None:
    """The ``decay_fraction`` (as written on a command line: the shortest decimal of at
    least 6 digits that works) whose WSD decay starts at ``step``, ``decay_steps`` kept;
    None when ``decay_steps`` is not past ``step``."""
    horizon = int(config.decay_steps or 0)
    if horizon <= step:
        return None
    exact = (horizon - step) / horizon
    for digits in range(6, 18):
        text = f"{exact:.{digits}g}"
        if _decay_start(config, decay_fraction=float(text)) == step:
            return text
    return None


def _horizon_starting_at(config: TrainConfig, step: int) -> int | None:
    """The smallest ``decay_steps`` whose WSD decay starts at or after ``step``,
    ``decay_fraction`` kept; None when there is none (a fraction of 1 starts at step 0)."""
    if config.decay_fraction >= 1.0:
        return None
    # decay_start = decay_steps − round(decay_fraction·decay_steps) never decreases as
    # decay_steps grows: start just below the estimate and walk up.
    estimate = math.floor(step / (1.0 - config.decay_fraction))
    for steps in range(max(step + 1, estimate - 2), estimate + 1000):
        start = _decay_start(config, decay_steps=steps)
        if start is not None and start >= step:
            return steps
    return None


def _decay_start(config: TrainConfig, **changes: Any) -> int | None:
    """``config``'s WSD ``decay_start`` with ``changes``, or None when they are invalid."""
    try:
        return config.replace(**changes).decay_start
    except ConfigError:
        return None


def _weighted_identity(data_dir: Path, sources: tuple[Source, ...]) -> list[tuple[str, float]]:
    """The data's digests with their shares (one dataset: a mixture of one, weight 1)."""
    total = sum(s.weight for s in sources) or 1.0
    weights = [s.weight / total for s in sources] or [1.0]
    return list(zip(_data_identity(data_dir, sources), weights))


def _started_at(record: RunRecord, phase: str) -> int | None:
    """The step at which the run's latest phase started, when it is ``phase``."""
    last = record.phases[-1] if record.phases else None
    return last.step if last is not None and last.name == phase else None


def _model_spec(command: TrainCommand, record: RunRecord | None) -> ModelSpec:
    """``--model``'s spec, which must be the run's own when it continues one."""
    if record is not None:
        recorded = record.model
        if command.model is not None and command.model != recorded:
            raise ConfigError(f"--model {command.model}: {command.run_dir} trains the model "
                              f"{recorded!r}; drop --model or choose another --run-dir")
        return get_model_spec(recorded)
    return get_model_spec(command.model or DEFAULT_MODEL)


def _callbacks(command: TrainCommand) -> tuple[Callback, ...]:
    """What the command asked to observe the run with, besides metrics.jsonl; each is
    checked now (a missing package, a bad window), so a session never fails on one late."""
    callbacks: list[Callback] = []
    if command.tensorboard:
        callbacks.append(TensorBoard(command.run_dir / "tensorboard"))
    if command.profile_start is not None:
        try:
            callbacks.append(ProfilerWindow(command.run_dir / "profile",
                                            command.profile_start, command.profile_steps))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    # A bar where a person watches (stderr on a terminal); plain lines on stdout whenever
    # it is not one (`> train.log`, nohup, a job log, CI), or when stderr is redirected.
    if sys.stderr.isatty():
        callbacks.append(ProgressBar())
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        callbacks.append(LogLines())
    # A run with a report keeps it current: every session that trains rewrites it.
    if command.report or (command.run_dir / REPORT_DIR / "index.html").is_file():
        try:
            callbacks.append(Report(command.run_dir))
        except ConfigError:
            if command.report:
                raise  # asked for: say what is missing; else the old report just stays
    return tuple(callbacks)


def _pretrained_model_config(spec: ModelSpec, folder: Path,
                             model_fields: dict[str, Any]) -> Any:
    """The hub folder's model, with the model flags that do not contradict it (those that
    only change how it computes, e.g. ``--kda-chunk-size``); a contradicting one is named."""
    if spec.hub is None:
        raise ConfigError(f"--init-from {folder}: the model {spec.name!r} has no hub format")
    try:
        return spec.hub.config(folder, **model_fields)
    except HubFolderError as exc:
        raise ConfigError(f"--init-from {exc}") from None


def _tokenizer_notes(folder: Path, data_dir: Path) -> tuple[str, ...]:
    """Refuse data prepared with another tokenizer than the folder's."""
    from ..data import load_codec
    from .hub import check_tokenizer

    codec = load_codec(data_dir, read_manifest(data_dir))
    note = check_tokenizer(folder, codec, data_dir, "--init-from")
    return () if note is None else (note,)


def _restart_record(run_dir: Path) -> RunRecord | None:
    """The configs a run that died before its first checkpoint was started with, or None
    when its run.json is missing or damaged (then the command line alone decides)."""
    try:
        return read_record(run_dir)
    except RunError:
        return None


def _vocab_for_data(model_config: Any, data_dir: Path) -> tuple[Any, tuple[str, ...]]:
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
    return dataclasses.replace(model_config, vocab_size=rounded), (note,)
