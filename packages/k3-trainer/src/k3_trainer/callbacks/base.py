"""Callbacks: how observers (metrics files, TensorBoard, progress, profiler, reports, a
user's tracker) see a run without the loop knowing them.

Subclass :class:`Callback` and override the hooks you need; pass instances as
``Trainer(callbacks=[...])``. Hooks run on the rank that has the callback, in list order.
A hook receives the trainer (its ``state``, ``config``, ``model``...) and, for the events
that ``metrics.jsonl`` records, that event's record (``{"event", "time", ...fields}``).

A callback that also has ``state_dict()`` and ``load_state_dict(state)`` is stateful: its
state is one more checkpoint component (``callbacks.<name>``), saved at every checkpoint,
validated and restored on resume, and rolled back with the rest when a resume is refused.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import torch

from k3_checkpoint import Stateful

from ..config import TrainConfig
from ..observe.metrics import Record
from ..observe.profiling import TrainingProfiler
from ..state import TrainState

logger = logging.getLogger(__name__)


class Run(Protocol):
    """The trainer as its callbacks see it (:class:`~k3_trainer.Trainer` is one): the
    callbacks sit above the trainer and never import it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    config: TrainConfig
    state: TrainState
    device: torch.device
    profiler: TrainingProfiler
    scaler: torch.amp.GradScaler
    checkpoint_path: Path | None
    checkpointer: Any
    parallel: Any
    """The data-parallel layout (:class:`~k3_trainer.distributed.Parallel`), or None."""

    def request_stop(self, signum: int = ...) -> None: ...
    def emit(self, event: str, **fields: Any) -> None: ...


_HOOK_OF_EVENT = {
    "session_start": "on_session_start",
    "overflow": "on_overflow",
    "train": "on_log",
    "eval": "on_eval_end",
    "checkpoint": "on_checkpoint_saved",
    "epoch": "on_data_epoch",
    "session_end": "on_session_end",
}


class Callback:
    """Hooks called by :class:`~k3_trainer.Trainer`; every hook does nothing by default.

    ``name`` is the callback's checkpoint key when it is stateful (default: the class name
    in snake_case); two stateful callbacks of one run need different names.
    """

    name: str | None = None

    def on_session_start(self, trainer: Run, record: Record) -> None:
        """Training is about to start (or continue from ``trainer.state``)."""

    def on_attempt_start(self, trainer: Run, step: int) -> None:
        """An attempted update for successful step ``step`` begins."""

    def on_attempt_end(self, trainer: Run, step: int) -> None:
        """That attempt is over, whether its update was applied or skipped."""

    def on_step_end(self, trainer: Run, stats: dict[str, float]) -> None:
        """After every successful update: ``loss``, ``lr``, ``grad_norm``,
        ``tokens_per_s`` (of the current log window)."""

    def on_overflow(self, trainer: Run, record: Record) -> None:
        """An FP16 overflow skipped the update (``overflow`` event)."""

    def on_log(self, trainer: Run, record: Record) -> None:
        """A log interval's summary (``train`` event: loss, lr, tokens/s, MFU, QK, MoE...)."""

    def on_eval_end(self, trainer: Run, record: Record) -> None:
        """A validation result (``eval`` event: ``val_loss``, ``val_bpb``)."""

    def on_checkpoint_saved(self, trainer: Run, record: Record) -> None:
        """A checkpoint was published (``checkpoint`` event: ``path``, ``digest``)."""

    def on_data_epoch(self, trainer: Run, record: Record) -> None:
        """A mixture's source ran out and starts over (``epoch`` event: ``source``,
        ``epoch``)."""

    def on_session_end(self, trainer: Run, record: Record) -> None:
        """The session trained to ``max_steps`` (``session_end`` event: phase times)."""

    def on_error(self, trainer: Run, error: BaseException) -> None:
        """``fit()`` is failing with ``error`` (a non-finite loss, a failed checkpoint
        write, an exception of the model or of a callback); called before :meth:`close`,
        then the error goes on. A stop asked for (Ctrl-C, a signal) is no error."""

    def close(self) -> None:
        """The session is over, trained, stopped or failed: release what the callback holds
        (files, writers, bars). Called once at the end of every ``fit()``, last."""


def callback_name(callback: Callback) -> str:
    """The checkpoint key of a stateful callback."""
    if callback.name:
        return callback.name
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(callback).__name__).lower()


def is_stateful(callback: object) -> bool:
    return isinstance(callback, Stateful)


class Callbacks:
    """The run's callbacks in order, and the dispatch of each event to its hook."""

    def __init__(self, callbacks: Iterable[Callback]) -> None:
        self.items = list(callbacks)
        for callback in self.items:
            if not isinstance(callback, Callback):
                raise TypeError(f"callbacks must be k3_trainer.Callback instances, got "
                                f"{type(callback).__name__}")
        names = [callback_name(c) for c in self.items if is_stateful(c)]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"stateful callbacks need distinct names (the checkpoint keys "
                             f"them by name): {', '.join(twice)}")

    def extend(self, callbacks: Iterable[Callback]) -> None:
        """Add observers to a built trainer (the CLI adds its files once every check has
        passed). Stateful ones must be given to ``Trainer(callbacks=...)``: the
        checkpoint's components are fixed when the trainer is built."""
        more = Callbacks(callbacks)
        if more.states():
            raise ValueError("a stateful callback must be passed to Trainer(callbacks=...): "
                             "the checkpoint's components are fixed when it is built")
        self.items += more.items

    def states(self) -> dict[str, Any]:
        """``{name: callback}`` of the stateful ones: their checkpoint components."""
        return {callback_name(c): c for c in self.items if is_stateful(c)}

    def event(self, trainer: Run, record: Record) -> None:
        """Hand a ``metrics.jsonl`` record to every callback's hook for its event."""
        hook = _HOOK_OF_EVENT.get(record["event"])
        if hook is None:
            raise ValueError(f"unknown event {record['event']!r}; events: "
                             f"{', '.join(_HOOK_OF_EVENT)}")
        for callback in self.items:
            getattr(callback, hook)(trainer, record)

    def error(self, trainer: Run, error: BaseException) -> None:
        """Every callback's :meth:`Callback.on_error`; one that raises does not keep the
        others from hearing of the error, which is what goes on."""
        for callback in self.items:
            try:
                callback.on_error(trainer, error)
            except Exception as problem:  # the run's own error is the one to report
                logger.warning("%s.on_error raised %s: %s (while the run failed with %s)",
                               callback_name(callback), type(problem).__name__, problem,
                               type(error).__name__)

    def close(self) -> None:
        """Every callback's :meth:`Callback.close`, each called even when one raises (the
        first such error is raised after all of them ran)."""
        first: Exception | None = None
        for callback in self.items:
            try:
                callback.close()
            except Exception as problem:
                first = first or problem
        if first is not None:
            raise first

    def attempt_start(self, trainer: Run, step: int) -> None:
        for callback in self.items:
            callback.on_attempt_start(trainer, step)

    def attempt_end(self, trainer: Run, step: int) -> None:
        for callback in self.items:
            callback.on_attempt_end(trainer, step)

    def step_end(self, trainer: Run, stats: dict[str, float]) -> None:
        for callback in self.items:
            callback.on_step_end(trainer, stats)
