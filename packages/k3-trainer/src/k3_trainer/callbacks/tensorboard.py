"""TensorBoard scalars beside the JSONL log (the source of truth), as a callback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..observe.metrics import Record
from .base import Callback, Run


class TensorBoard(Callback):
    """Mirrors numeric fields of ``train`` and ``eval`` events as TensorBoard scalars.

    Needs the ``tensorboard`` package (``pip install 'k3-trainer[tensorboard]'``); asking
    for it without the package is a clear ``ConfigError`` at startup, not a late crash.
    The event file is created with the first scalar, so building the callback (as a
    command's plan does before its checks pass) writes nothing.
    """

    def __init__(self, log_dir: str | Path) -> None:
        self.require()
        self.log_dir = Path(log_dir)
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        """The ``SummaryWriter`` (opened on first use)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    @staticmethod
    def require() -> None:
        """Raise ``ConfigError`` now if the tensorboard package is missing."""
        try:
            import tensorboard  # noqa: F401
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise ConfigError("--tensorboard needs the tensorboard package: "
                              "pip install 'k3-trainer[tensorboard]'") from None

    def on_log(self, trainer: Run, record: Record) -> None:
        self.write(record)

    def on_eval_end(self, trainer: Run, record: Record) -> None:
        self.write(record)

    def on_session_end(self, trainer: Run, record: Record) -> None:
        self.close()

    def write(self, record: dict[str, Any]) -> None:
        if record["event"] not in ("train", "eval") or "step" not in record:
            return
        for key, value in record.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and key not in (
                    "step", "time"):
                self.writer.add_scalar(f"{record['event']}/{key}", value, record["step"])
        downstream = record.get("downstream")
        if isinstance(downstream, dict):  # downstream/<task>/<metric>, downstream/core
            for task, found in downstream["tasks"].items():
                for key, value in found.items():
                    self.writer.add_scalar(f"downstream/{task}/{key}", value, record["step"])
            self.writer.add_scalar("downstream/core", downstream["core"], record["step"])
        self.writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None  # a later session opens a new one
