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
    """

    def __init__(self, log_dir: str | Path) -> None:
        self.require()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

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
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
