"""A training session's plan, resolved from the run directory's state and a
:class:`~k3_trainer.session.TrainRequest` before anything is built or written.

Fresh: defaults ← preset ← config file ← explicit fields (the model's vocabulary grows to
the data's tokenizer unless set); resumed: the run's recorded configs ← config file ←
explicit fields. The plan holds everything the session then does: the model spec and both
configs, the data, the checkpoint to resume, the notes to say and the callbacks that
observe the run.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..callbacks import Callback, LogLines, ProfilerWindow, ProgressBar, Report, TensorBoard
from ..checkpoint import TRAINER_POLICY
from ..config import ConfigError, TrainConfig
from ..data import read_manifest
from ..data.loader import MANIFEST_FORMAT, manifest_digest
from ..data.mixture import Source
from ..data.prepare import prepare_dataset
from ..models import DEFAULT_MODEL, HubFolderError, ModelSpec, get_model_spec
from ..observe.report import REPORT_DIR
from ..record import RUN_RECORD, RunRecord
from .config_file import check_toml_fields, data_of, read_toml
from .messages import Say, to_stderr
from .request import TrainRequest
from .run_dir import recorded_sources, run_state

VOCAB_MULTIPLE = 128


def builtin_data_dir() -> Path:
    """Where the built-in corpus is prepared once (per Python version: its text differs;
    ``topics``: one document per topic, not the one document of 0.1's cache)."""
    root = os.environ.get("K3_TRAIN_CACHE") or Path.home() / ".cache" / "k3-train"
    version = f"py{sys.version_info[0]}.{sys.version_info[1]}"
    return Path(root) / f"builtin-pydoc-topics-{version}-{MANIFEST_FORMAT.replace('/', '')}"


def resolve_data(data: Path | None, say: Say = to_stderr) -> Path:
    """``data``, or the built-in corpus (prepared into :func:`builtin_data_dir` once)."""
    if data is not None:
        return data
    path = builtin_data_dir()
    if not (path / "manifest.json").is_file():
        say(f"preparing the built-in corpus into {path}")
        prepare_dataset([], path, overwrite=True)
    return path


def model_config_from(
    spec: ModelSpec, preset: str | None, overrides: dict[str, Any], recorded: dict[str, Any] | None
) -> Any:
    try:
        return spec.config(preset, overrides, recorded)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"model config: {exc}") from None


def train_config_from(
    base: dict[str, Any], toml: dict[str, Any], overrides: dict[str, Any]
) -> TrainConfig:
    merged = {**base, **toml.get("train", {}), **overrides}
    try:
        return TrainConfig.from_dict(merged)
    except TypeError as exc:
        raise ConfigError(f"train config: {exc}") from None


@dataclass(frozen=True)
class Plan:
    """A session's plan, resolved before anything is built or written."""

    request: TrainRequest
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


def resolve(request: TrainRequest, notes: tuple[str, ...] = (), say: Say = to_stderr) -> Plan:
    """The session's plan from the run directory's state and ``request``, or a
    ``RunError`` when the run directory is not in a state the request can use (``notes``:
    the caller's own, said with the plan's once the session is sure to train; what cannot
    wait is said now, through ``say``)."""
    run_dir, toml = request.run_dir, read_toml(request.config)
    preset = request.preset or toml.get("preset")
    state = run_state(
        run_dir, resume=request.resume, resume_from=request.resume_from, say=say
    )
    record, resume = state.record, state.resume
    if request.phase is not None and not resume:
        raise ConfigError(
            f"--phase {request.phase} needs --resume: a phase continues a run from its checkpoint"
        )
    spec = _model_spec(request, record)
    check_toml_fields(toml, spec, request.config)
    model_fields = {**toml.get("model", {}), **request.model_fields}
    given_dir, sources = data_of(request.data, toml)
    said: tuple[str, ...] = ()
    init_from = request.init_from
    if init_from is not None and resume:
        said = (
            f"--init-from {init_from} is not read: the run's checkpoint holds its "
            "weights (it starts a run only)",
        )
        init_from = None
    if init_from is not None:
        if preset is not None:
            raise ConfigError(
                f"--init-from {init_from} and --preset {preset} both choose the "
                "model; drop --preset (the folder's config.json is the model)"
            )
        config = train_config_from({}, toml, request.train_fields)
        model_config = _pretrained_model_config(spec, init_from, model_fields)
        data_dir = resolve_data(given_dir, say)
        said = _tokenizer_notes(init_from, data_dir)
    elif record is not None:
        config = train_config_from(record.train_config, toml, request.train_fields)
        model_config = model_config_from(spec, preset, model_fields, record.model_config)
        if given_dir is None:
            data_dir, sources = Path(record.data.dir), recorded_sources(record)
        else:
            data_dir = given_dir
            if resume and request.phase is None:
                _check_same_data(record, given_dir, sources)
    else:
        config = train_config_from({}, toml, request.train_fields)
        model_config = model_config_from(spec, preset, model_fields, None)
        data_dir = resolve_data(given_dir, say)
        if "vocab_size" in spec.field_names and "vocab_size" not in model_fields:
            model_config, said = _vocab_for_data(model_config, data_dir)
    horizon_unset = record is None and "decay_steps" not in {
        **toml.get("train", {}),
        **request.train_fields,
    }
    recorded_data = record.data.dir if record is not None else None
    phase, changes, new, before = None, {}, False, None
    if request.phase is not None and record is not None:
        phase = request.phase
        # A phase reads through a mixture loader, which takes over any saved cursor of the
        # same data: one dataset becomes a mixture of one.
        sources = sources or (Source("data", data_dir, 1.0),)
        changes = _phase_changes(record, config, data_dir, sources)
        started = None if changes else _started_at(record, phase)
        new = started is None
        before = train_config_from(record.train_config, {}, {}) if new else None
        listed = ", ".join(name.removeprefix("train_config.") for name in changes) or "nothing"
        said = (
            *said,
            f"phase {phase} starts at the checkpoint's step: it changes {listed}"
            if new
            else f"phase {phase} already started at step {started}; it continues",
        )
    if preset is None and init_from is None:  # what the model was built from, on record
        preset = record.preset if record is not None else spec.default_preset
    return Plan(
        request,
        spec,
        config,
        model_config,
        data_dir,
        state.checkpoint,
        horizon_unset,
        branch=state.branch,
        preset=preset,
        recorded_data=recorded_data,
        notes=(*notes, *said),
        init_from=init_from,
        callbacks=_callbacks(request),
        sources=sources,
        phase=phase,
        phase_changes=changes,
        phase_new=new,
        phase_before=before,
    )


def _data_identity(data_dir: Path, sources: tuple[Source, ...]) -> list[str]:
    return [
        manifest_digest(read_manifest(path)) for path in ([s.path for s in sources] or [data_dir])
    ]


def _check_same_data(record: RunRecord, data_dir: Path, sources: tuple[Source, ...]) -> None:
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
            "start a new phase of it (--phase NAME)"
        )


def describe_data(data_dir: Path, sources: tuple[Source, ...]) -> Any:
    """The data as run.json and a phase's changes name it: a folder, or the mixture."""
    if not sources:
        return str(data_dir.resolve())
    return [{"name": s.name, "dir": str(s.path.resolve()), "weight": s.weight} for s in sources]


def _phase_changes(
    record: RunRecord, config: TrainConfig, data_dir: Path, sources: tuple[Source, ...]
) -> dict[str, Any]:
    """What a phase changes against the run's record: config fields and the data (not the
    fields any resume may change, such as max_steps)."""
    before = train_config_from(record.train_config, {}, {})
    changes: dict[str, Any] = {
        f"train_config.{name}": [getattr(before, name), getattr(config, name)]
        for name in (f.name for f in dataclasses.fields(TrainConfig))
        if getattr(before, name) != getattr(config, name)
        and f"train_config.{name}" not in TRAINER_POLICY.may_differ
    }
    before_dir, before_sources = Path(record.data.dir), recorded_sources(record)
    if _weighted_identity(before_dir, before_sources) != _weighted_identity(data_dir, sources):
        changes["data"] = [
            describe_data(before_dir, before_sources),
            describe_data(data_dir, sources),
        ]
    return changes


def _weighted_identity(data_dir: Path, sources: tuple[Source, ...]) -> list[tuple[str, float]]:
    """The data's digests with their shares (one dataset: a mixture of one, weight 1)."""
    total = sum(s.weight for s in sources) or 1.0
    weights = [s.weight / total for s in sources] or [1.0]
    return list(zip(_data_identity(data_dir, sources), weights))


def _started_at(record: RunRecord, phase: str) -> int | None:
    """The step at which the run's latest phase started, when it is ``phase``."""
    last = record.phases[-1] if record.phases else None
    return last.step if last is not None and last.name == phase else None


def _model_spec(request: TrainRequest, record: RunRecord | None) -> ModelSpec:
    """``--model``'s spec, which must be the run's own when it continues one."""
    if record is not None:
        recorded = record.model
        if request.model is not None and request.model != recorded:
            raise ConfigError(
                f"--model {request.model}: {request.run_dir} trains the model "
                f"{recorded!r}; drop --model or choose another --run-dir"
            )
        return get_model_spec(recorded)
    return get_model_spec(request.model or DEFAULT_MODEL)


def _callbacks(request: TrainRequest) -> tuple[Callback, ...]:
    """What the command asked to observe the run with, besides metrics.jsonl; each is
    checked now (a missing package, a bad window), so a session never fails on one late."""
    callbacks: list[Callback] = []
    if request.tensorboard:
        callbacks.append(TensorBoard(request.run_dir / "tensorboard"))
    if request.profile_start is not None:
        try:
            callbacks.append(
                ProfilerWindow(
                    request.run_dir / "profile", request.profile_start, request.profile_steps
                )
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    # A bar where a person watches (stderr on a terminal); plain lines on stdout whenever
    # it is not one (`> train.log`, nohup, a job log, CI), or when stderr is redirected.
    if sys.stderr.isatty():
        callbacks.append(ProgressBar())
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        callbacks.append(LogLines())
    # A run with a report keeps it current: every session that trains rewrites it.
    if request.report or (request.run_dir / REPORT_DIR / "index.html").is_file():
        try:
            callbacks.append(Report(request.run_dir))
        except ConfigError:
            if request.report:
                raise  # asked for: say what is missing; else the old report just stays
    return tuple(callbacks)


def _pretrained_model_config(spec: ModelSpec, folder: Path, model_fields: dict[str, Any]) -> Any:
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
    from ..hub import check_tokenizer

    codec = load_codec(data_dir, read_manifest(data_dir))
    note = check_tokenizer(folder, codec, data_dir, "--init-from")
    return () if note is None else (note,)


def _vocab_for_data(model_config: Any, data_dir: Path) -> tuple[Any, tuple[str, ...]]:
    """The model with a vocabulary large enough for the data's tokenizer (rounded up to a
    multiple of 128, for the embedding's matrix shapes) and a note saying so; unchanged
    when the preset's covers it. A vocab_size the user set is never changed: the loaders
    refuse one that is too small."""
    needed = int(read_manifest(data_dir)["vocab_size"])
    if needed <= model_config.vocab_size:
        return model_config, ()
    rounded = -(-needed // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    note = (
        f"vocab_size {model_config.vocab_size} → {rounded} to cover the data's "
        f"{needed}-token tokenizer (--vocab-size sets it)"
    )
    return dataclasses.replace(model_config, vocab_size=rounded), (note,)
