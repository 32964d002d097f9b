"""The run record, ``run.json``: what a run trains (its configs, model and data, the phases
and branches it started) and how each of its sessions was launched, as typed fields.

This module alone reads, upgrades and writes the file, so its layout is spelled in one
place and the commands read fields, never keys. Reading upgrades an older record: the
keys later versions added (``model``, ``data.sources``, ``phases``, ``branches``,
``init_from``) read as their defaults, a value of the wrong type reads as absent (so a
damaged detail never stops a command that does not need it), and the keys this version
does not know (the record's, a session's) are kept, as is the order of the record's keys,
when a session extends it.

Torch-free at import: the command reads a run's model before torch loads.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

RUN_RECORD = "run.json"
"""The run record's file in a run directory."""

METRICS = "metrics.jsonl"
"""The run's event log in a run directory, one JSON object per line
(:mod:`k3_trainer.observe.metrics` reads it)."""

LEGACY_MODEL = "k3"
"""The model of a record that names none: runs from before model specs trained K3."""

PACKAGES = ("k3-optim", "k3-qkclip", "k3-checkpoint", "k3-model", "k3-trainer", "torch",
            "numpy")
"""The packages whose versions each session records (with Python's)."""


class RecordError(ValueError):
    """``run.json`` is there but unreadable, not a run record, or lacks what a command
    needs to continue or read the run."""


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _dict(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, dict) else {}


def _entries(value: Any) -> list[dict[str, Any]]:
    """A list's entries that are objects (anything else reads as no entry)."""
    return [entry for entry in value if isinstance(entry, dict)] if isinstance(value, list) \
        else []


def _unknown(raw: dict[str, Any], known: tuple[str, ...]) -> dict[str, Any]:
    return {key: value for key, value in raw.items() if key not in known}


def _in_order(fields: dict[str, Any], order: tuple[str, ...]) -> dict[str, Any]:
    """``fields`` with the keys of ``order`` (a file's) in its order, the others after."""
    rank = {key: i for i, key in enumerate(order)}
    return dict(sorted(fields.items(), key=lambda item: rank.get(item[0], len(rank))))


def versions() -> dict[str, str | None]:
    """Python's version and each of :data:`PACKAGES`' (None: not installed)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


@dataclass(frozen=True)
class Host:
    """The machine a session ran on (``torch_threads``: what a resume must match for a
    bitwise continuation, so a refusal can say how to relaunch)."""

    hostname: str | None = None
    platform: str | None = None
    cpu: str | None = None
    cpu_count: int | None = None
    torch_threads: int | None = None
    cuda: str | None = None
    """The CUDA device's name (None: no CUDA device)."""

    @classmethod
    def current(cls) -> Host:
        import torch  # a session records itself once it has loaded torch; readers need none

        return cls(socket.gethostname(), platform.platform(),
                   platform.processor() or platform.machine(), os.cpu_count(),
                   torch.get_num_threads(),
                   torch.cuda.get_device_name() if torch.cuda.is_available() else None)

    @classmethod
    def from_json(cls, raw: Any) -> Host:
        raw = _dict(raw)
        return cls(_str(raw.get("hostname")), _str(raw.get("platform")), _str(raw.get("cpu")),
                   _int(raw.get("cpu_count")), _int(raw.get("torch_threads")),
                   _str(raw.get("cuda")))

    def to_json(self) -> dict[str, Any]:
        return {"hostname": self.hostname, "platform": self.platform, "cpu": self.cpu,
                "cpu_count": self.cpu_count, "torch_threads": self.torch_threads,
                "cuda": self.cuda}


@dataclass(frozen=True)
class DataParallel:
    """A torchrun session's layout (``Parallel.describe()``), which a resume must match:
    ``expert_parallel`` only when on."""

    mode: str | None
    world_size: int | None
    """A positive count of processes (None: not recorded, or damaged)."""
    expert_parallel: int | None = None
    pp: int | None = None
    """Pipeline stages (None: one, as every record before pipelines)."""
    cp: int | None = None
    """Context-parallel ranks per row (None: one, as every record before it)."""

    @classmethod
    def from_json(cls, raw: Any) -> DataParallel | None:
        if not isinstance(raw, dict):
            return None
        size = _int(raw.get("world_size"))
        return cls(_str(raw.get("mode")), size if size is not None and size > 0 else None,
                   _int(raw.get("expert_parallel")), _int(raw.get("pp")), _int(raw.get("cp")))

    @property
    def data_ranks(self) -> int:
        """The ranks that read different rows: the world over pipeline and context ranks
        (1 when not recorded)."""
        ranks = (self.world_size or 1) // ((self.pp or 1) * (self.cp or 1))
        return max(ranks, 1)

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "world_size": self.world_size,
                **({} if self.expert_parallel is None
                   else {"expert_parallel": self.expert_parallel}),
                **({} if self.pp is None else {"pp": self.pp}),
                **({} if self.cp is None else {"cp": self.cp}),
                **({} if self.pp is None and self.cp is None else {"dp": self.data_ranks})}


@dataclass(frozen=True)
class Session:
    """One session of the run: when and how it was launched, what it continued, with which
    code on which machine. A past session's entry is history, written back as read."""

    started: str | None
    command: tuple[str, ...]
    """The session's ``sys.argv``."""
    device: str | None
    resumed_from_step: int | None = None
    resumed_from: str | None = None
    """The checkpoint the session resumed from."""
    branch: int | None = None
    """The step of the branch the session started (``--resume-from`` an older one)."""
    data_parallel: DataParallel | None = None
    init_from: str | None = None
    """The hub folder whose weights a fresh run started from (``--init-from``)."""
    phase: str | None = None
    """The name of the phase the session started."""
    versions: dict[str, str | None] = field(default_factory=dict)
    host: Host = field(default_factory=Host)
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys this version does not know (a later version's), kept as they are."""
    key_order: tuple[str, ...] = field(default=(), compare=False, repr=False)
    """The keys' order in the file read, kept when the entry is written back."""

    KEYS = ("started", "command", "resumed_from_step", "resumed_from", "branch", "device",
            "data_parallel", "init_from", "phase", "versions", "host")

    @classmethod
    def now(cls, device: str, *, resumed_from_step: int | None = None,
            resumed_from: str | None = None, data_parallel: DataParallel | None = None,
            init_from: str | None = None) -> Session:
        """The session this process runs, launched now (its command, versions and host)."""
        return cls(_now(), tuple(sys.argv), device, resumed_from_step, resumed_from,
                   data_parallel=data_parallel, init_from=init_from, versions=versions(),
                   host=Host.current())

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Session:
        command = raw.get("command")
        return cls(
            _str(raw.get("started")),
            tuple(command) if isinstance(command, list) and all(
                isinstance(word, str) for word in command) else (),
            _str(raw.get("device")), _int(raw.get("resumed_from_step")),
            _str(raw.get("resumed_from")), _int(raw.get("branch")),
            DataParallel.from_json(raw.get("data_parallel")), _str(raw.get("init_from")),
            _str(raw.get("phase")),
            {str(k): v for k, v in _dict(raw.get("versions")).items()
             if v is None or isinstance(v, str)},
            Host.from_json(raw.get("host")), _unknown(raw, cls.KEYS), tuple(raw))

    def to_json(self) -> dict[str, Any]:
        optional = {"resumed_from": self.resumed_from, "branch": self.branch}
        later = {"data_parallel": None if self.data_parallel is None
                 else self.data_parallel.to_json(),
                 "init_from": self.init_from, "phase": self.phase}
        return _in_order({"started": self.started, "command": list(self.command),
                          "resumed_from_step": self.resumed_from_step,
                          **{k: v for k, v in optional.items() if v is not None},
                          "device": self.device,
                          **{k: v for k, v in later.items() if v is not None},
                          "versions": self.versions, "host": self.host.to_json(),
                          **self.extra}, self.key_order)


@dataclass(frozen=True)
class Phase:
    """A phase the run started (``--phase``) at a checkpoint's step, and what it changed,
    ``{what: [before, after]}``; also the ``phase_start`` event's fields."""

    name: str
    step: int
    changes: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Phase | None:
        name, step = _str(raw.get("name")), _int(raw.get("step"))
        return None if name is None or step is None else cls(name, step,
                                                             _dict(raw.get("changes")))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "step": self.step, "changes": self.changes}


@dataclass(frozen=True)
class Branch:
    """A ``--resume-from`` an older checkpoint than the latest (``from``, its path) at its
    step, and how many records of the event log it superseded; also the ``branch``
    event's fields."""

    checkpoint: str
    step: int
    superseded_records: int | None = None

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Branch | None:
        checkpoint, step = _str(raw.get("from")), _int(raw.get("step"))
        return None if checkpoint is None or step is None else cls(
            checkpoint, step, _int(raw.get("superseded_records")))

    def to_json(self) -> dict[str, Any]:
        return {"from": self.checkpoint, "step": self.step,
                **({} if self.superseded_records is None
                   else {"superseded_records": self.superseded_records})}


@dataclass(frozen=True)
class RecordedSource:
    """One source of a mixture: its name, folder, weight and data digest."""

    name: str
    dir: str
    weight: float
    manifest_digest: str | None = None

    @classmethod
    def from_json(cls, raw: Any) -> RecordedSource:
        """The source, or ``TypeError``/``KeyError``/``ValueError`` when it is damaged."""
        if not isinstance(raw["dir"], str):
            raise TypeError(raw["dir"])
        return cls(str(raw["name"]), raw["dir"], float(raw["weight"]),
                   _str(raw.get("manifest_digest")))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dir": self.dir, "weight": self.weight,
                **({} if self.manifest_digest is None
                   else {"manifest_digest": self.manifest_digest})}


@dataclass(frozen=True)
class RecordedData:
    """The data the run reads (its latest session's): the folder (a mixture's first
    source's) with its digest, and a mixture's sources (none: one dataset)."""

    dir: str
    manifest_digest: str | None = None
    sources: tuple[RecordedSource, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"dir": self.dir, "manifest_digest": self.manifest_digest,
                **({"sources": [s.to_json() for s in self.sources]} if self.sources else {})}


@dataclass(frozen=True)
class RunRecord:
    """The run's record: its configs, model and data as the latest session ran them, the
    phases and branches it started, and every session's launch."""

    train_config: dict[str, Any]
    """The ``TrainConfig``'s fields (``to_dict()``)."""
    model_config: dict[str, Any]
    """The model config's fields (its spec's ``config_dict``)."""
    data: RecordedData
    model: str = LEGACY_MODEL
    """The model spec's name (``--model``)."""
    preset: str | None = None
    """The preset the run was started from."""
    created: str | None = None
    sessions: tuple[Session, ...] = ()
    phases: tuple[Phase, ...] = ()
    branches: tuple[Branch, ...] = ()
    init_from: str | None = None
    """The hub folder whose weights the run started from (``--init-from``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys this version does not know (a later version's), kept as they are."""
    key_order: tuple[str, ...] = field(default=(), compare=False, repr=False)
    """The keys' order in the file read, kept when the record is written back."""

    KEYS = ("created", "sessions", "train_config", "model", "model_config", "preset",
            "data", "phases", "branches", "init_from")

    @property
    def last_session(self) -> Session | None:
        return self.sessions[-1] if self.sessions else None

    @classmethod
    def read(cls, run_dir: str | Path, *, partial: bool = False) -> RunRecord:
        """The record of ``run_dir``, checked to hold what a command continues or reads a
        run with: the configs and the data folder (``partial``: whatever the record holds,
        the rest empty, for a reader that shows what it finds or a session that replaces
        it). ``FileNotFoundError`` without one; ``RecordError``, one line, when damaged."""
        path = Path(run_dir) / RUN_RECORD
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} not found: {run_dir} is not a k3-train run "
                                    "directory") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise RecordError(f"{path} is unreadable: {exc}") from None
        if not isinstance(raw, dict) or "train_config" not in raw:
            raise RecordError(f"{path} is not a k3-train run record")
        data = _dict(raw.get("data"))
        complete = (isinstance(raw["train_config"], dict)
                    and isinstance(raw.get("model_config"), dict)
                    and isinstance(data.get("dir"), str))
        if not (complete or partial):
            raise RecordError(f"{path} lacks train_config, model_config or data.dir")
        entries = data.get("sources") or []
        try:
            sources = tuple(RecordedSource.from_json(entry) for entry in entries)
        except (TypeError, KeyError, ValueError):
            if not partial:
                raise RecordError(f"{RUN_RECORD}'s data.sources is damaged: "
                                  f"{entries!r}") from None
            sources = ()
        model = raw.get("model", LEGACY_MODEL)
        phases = [Phase.from_json(entry) for entry in _entries(raw.get("phases"))]
        branches = [Branch.from_json(entry) for entry in _entries(raw.get("branches"))]
        return cls(
            _dict(raw["train_config"]), _dict(raw.get("model_config")),
            RecordedData(_str(data.get("dir")) or "", _str(data.get("manifest_digest")),
                         sources),
            model if isinstance(model, str) else LEGACY_MODEL, _str(raw.get("preset")),
            _str(raw.get("created")),
            tuple(Session.from_json(entry) for entry in _entries(raw.get("sessions"))),
            tuple(phase for phase in phases if phase is not None),
            tuple(branch for branch in branches if branch is not None),
            _str(raw.get("init_from")), _unknown(raw, cls.KEYS), tuple(raw))

    @classmethod
    def extending(cls, run_dir: str | Path) -> RunRecord:
        """The record a new session of ``run_dir`` extends: the run's (whatever it holds,
        :meth:`read` ``partial``), or a new run's, created now."""
        if (Path(run_dir) / RUN_RECORD).exists():
            return cls.read(run_dir, partial=True)
        return cls({}, {}, RecordedData(""), created=_now())

    def with_session(self, session: Session, *, train_config: dict[str, Any], model: str,
                     model_config: dict[str, Any], preset: str | None, data: RecordedData,
                     phase: Phase | None = None, branch: Branch | None = None) -> RunRecord:
        """This record extended by ``session``, which ran ``model`` with these configs on
        ``data`` (the latest session's win) and may start a ``phase`` or a ``branch``."""
        session = replace(session, phase=None if phase is None else phase.name,
                          branch=None if branch is None else branch.step)
        return replace(
            self, train_config=train_config, model=model, model_config=model_config,
            preset=preset, data=data, sessions=(*self.sessions, session),
            phases=(*self.phases, *(() if phase is None else (phase,))),
            branches=(*self.branches, *(() if branch is None else (branch,))),
            init_from=self.init_from if session.init_from is None else session.init_from)

    def to_json(self) -> dict[str, Any]:
        """The file's layout: keys in the order read, new ones after them."""
        known = {"created": self.created, "sessions": [s.to_json() for s in self.sessions],
                 "train_config": self.train_config, "model": self.model,
                 "model_config": self.model_config, "preset": self.preset,
                 "data": self.data.to_json(),
                 "phases": [p.to_json() for p in self.phases] or None,
                 "branches": [b.to_json() for b in self.branches] or None,
                 "init_from": self.init_from}
        optional = ("created", "phases", "branches", "init_from")
        return _in_order({**{k: v for k, v in known.items()
                             if v is not None or k not in optional}, **self.extra},
                         self.key_order)

    def write(self, run_dir: str | Path) -> None:
        """Write ``run_dir``'s ``run.json`` atomically."""
        path = Path(run_dir) / RUN_RECORD
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(path)

