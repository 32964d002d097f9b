"""``TrainRequest``: what a training session is asked to do, as typed data.

The command line parses its flags into one (``k3-train train``); a notebook, a benchmark
or another launcher builds one directly and hands it to :func:`~k3_trainer.session.train`
(or resolves it into a :class:`~k3_trainer.session.Plan` first). Nothing here reads argv.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..data.mixture import Source


@dataclass(frozen=True)
class TrainRequest:
    """A training session's inputs: the run directory and what to do with it.

    The model and recipe come, in order of precedence, from ``train_fields`` /
    ``model_fields`` (each ``TrainConfig`` or model-config field set explicitly), the
    ``config`` TOML file (``preset``, ``[train]``, ``[model]``, ``[data.sources]``), a
    resumed run's record, and the preset.
    """

    run_dir: Path
    """the run's folder: checkpoints, metrics.jsonl, run.json"""
    data: Path | tuple[Source, ...] | None = None
    """one dataset folder, a mixture's sources, or None (the config file's
    ``[data.sources]``, a resumed run's data, else the built-in corpus)"""
    config: Path | None = None
    """a TOML file: preset, [train], [model], [data.sources]"""
    model: str | None = None
    """the registered model to train (default: k3, or the resumed run's)"""
    init_from: Path | None = None
    """a hub folder whose weights start a fresh run (continued pretraining)"""
    resume: bool = False
    """continue from the run's latest checkpoint"""
    resume_from: Path | None = None
    """continue from this older checkpoint of the run, as a new branch"""
    preset: str | None = None
    """the model preset the model fields start from"""
    device: str = "auto"
    """auto, cpu, cuda or cuda:N"""
    report: bool = False
    """write the run's plots and index page when the session ends"""
    tensorboard: bool = False
    """also write TensorBoard scalars"""
    profile_start: int | None = None
    """trace attempts from this step with torch.profiler"""
    profile_steps: int = 3
    """attempts in the trace window"""
    phase: str | None = None
    """with ``resume``: start a new phase of the run (data and decay may change)"""
    allow_runtime_change: bool = False
    """with ``resume``: accept another torch version, thread count, device or layout"""
    parallel: Literal["none", "ddp", "fsdp"] = "none"
    """data parallelism under torchrun (this process is one rank of it)"""
    train_fields: dict[str, Any] = field(default_factory=dict)
    """TrainConfig fields set explicitly"""
    model_fields: dict[str, Any] = field(default_factory=dict)
    """model config fields set explicitly"""
