"""The progress bar a person watches on a terminal, as a callback."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ..callbacks import Callback, Record

if TYPE_CHECKING:
    from ..trainer import Trainer


class ProgressBar(Callback):
    """A tqdm bar on stderr: step of ``max_steps``, loss, tokens/s, ETA."""

    def __init__(self) -> None:
        self.bar: Any = None

    def on_session_start(self, trainer: Trainer, record: Record) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=trainer.config.max_steps, initial=trainer.state.step,
                        unit="step", dynamic_ncols=True, file=sys.stderr)

    def on_step_end(self, trainer: Trainer, stats: dict[str, float]) -> None:
        if self.bar is None:
            return
        self.bar.n = trainer.state.step
        self.bar.set_postfix(loss=f"{stats['loss']:.3f}", tok_s=f"{stats['tokens_per_s']:.0f}",
                             refresh=False)
        self.bar.refresh()

    def on_session_end(self, trainer: Trainer, record: Record) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
