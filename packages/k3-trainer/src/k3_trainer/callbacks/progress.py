"""What a person watches: a progress bar on a terminal, plain lines in a log file."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from ..observe.metrics import Record
from .base import Callback, Run


class ProgressBar(Callback):
    """A tqdm bar on stderr: step of ``max_steps``, loss, tokens/s, the latest validation,
    the latest downstream accuracies and ``core``, ETA."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.training: dict[str, str] = {}
        self.validation: dict[str, str] = {}
        self.downstream: dict[str, str] = {}

    def on_session_start(self, trainer: Run, record: Record) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=trainer.config.max_steps, initial=trainer.state.step,
                        unit="step", dynamic_ncols=True, file=sys.stderr)

    def on_step_end(self, trainer: Run, stats: dict[str, float]) -> None:
        if self.bar is None:
            return
        self.bar.n = trainer.state.step
        self.training = {"loss": f"{stats['loss']:.3f}", "tok_s": f"{stats['tokens_per_s']:.0f}"}
        self._show()

    def on_eval_end(self, trainer: Run, record: Record) -> None:
        downstream = record.get("downstream")
        if isinstance(downstream, dict):
            self.downstream = {**{name: f"{m['acc']:.3f}"
                                  for name, m in downstream["tasks"].items()},
                               "core": f"{downstream['core']:+.3f}"}
        else:
            bpb = record.get("val_bpb")
            self.validation = {"val_bpb": f"{bpb:.4f}"} if isinstance(bpb, float) else {
                "val_loss": f"{_num(record.get('val_loss'), '.4f')}"}
        self._show()

    def _show(self) -> None:
        if self.bar is not None:
            self.bar.set_postfix(**self.training, **self.validation, **self.downstream,
                                 refresh=False)
            self.bar.refresh()

    def on_session_end(self, trainer: Run, record: Record) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class LogLines(Callback):
    """Plain lines for a log file (nohup, a job log, CI), where a progress bar would print
    nothing useful: one per log window (step, loss — a mixture's each source too — lr,
    tokens/s, elapsed, ETA) and one per evaluation (validation, a mixture's each source
    too, or downstream tasks with the tasks ``core`` averages)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self.started = time.monotonic()
        self.first_step = 0

    def on_session_start(self, trainer: Run, record: Record) -> None:
        self.started, self.first_step = time.monotonic(), trainer.state.step

    def on_log(self, trainer: Run, record: Record) -> None:
        step, total = record["step"], trainer.config.max_steps
        elapsed = time.monotonic() - self.started
        done = step - self.first_step
        eta = elapsed / done * (total - step) if done > 0 else math.nan
        rate = record.get("tokens_per_s")
        self._say(f"step {step}/{total} | loss {_num(record.get('loss'), '.4f')}"
                  f"{_train_sources(record)} | "
                  f"lr {_num(record.get('lr'), '.2e')} | {_num(rate, ',.0f')} tokens/s | "
                  f"elapsed {_clock(elapsed)} | ETA {_clock(eta)}")

    def on_eval_end(self, trainer: Run, record: Record) -> None:
        downstream = record.get("downstream")
        if isinstance(downstream, dict):
            tasks = " | ".join(
                f"{name} acc {m['acc']:.4f} acc_norm {m['acc_norm']:.4f} bpb {m['bpb']:.4f}"
                for name, m in downstream["tasks"].items())
            averaged = ", ".join(downstream.get("core_tasks") or downstream["tasks"])
            self._say(f"step {record['step']}/{trainer.config.max_steps} | {tasks} | core "
                      f"{downstream['core']:+.4f} (mean centered_acc of {averaged})")
            return
        bpb = record.get("val_bpb")
        tokens = record.get("val_tokens")
        self._say(f"step {record['step']}/{trainer.config.max_steps} | val_loss "
                  f"{_num(record.get('val_loss'), '.4f')}"
                  + (f" | val_bpb {bpb:.4f}" if bpb is not None else "")
                  + (f" | {tokens:,} tokens" if tokens is not None else "")
                  + _sources_line(record))

    def _say(self, line: str) -> None:
        stream = self.stream if self.stream is not None else sys.stdout
        print(line, file=stream, flush=True)


def _train_sources(record: Record) -> str:
    """A mixture's training loss, source by source, after the window's: ``" (web 3.2100,
    code 2.8700)"``; empty for one dataset."""
    sources = record.get("loss_by_source")
    if not isinstance(sources, dict) or len(sources) < 2:
        return ""
    return " (" + ", ".join(f"{name} {_num(value, '.4f')}"
                            for name, value in sources.items()) + ")"


def _sources_line(record: Record) -> str:
    """A mixture's evaluation, source by source, to end its line: ``" | web 3.2100, code
    2.8700 bpb"`` (``val_loss`` where a source has no bits per byte); empty for one dataset
    (or a mixture of one, which the line's own figures already are)."""
    sources = record.get("val_by_source")
    if not isinstance(sources, dict) or len(sources) < 2:
        return ""
    parts = [part if isinstance(part, dict) else {} for part in sources.values()]
    key, unit = (("val_bpb", "bpb") if all(isinstance(p.get("val_bpb"), int | float)
                                           for p in parts) else ("val_loss", "val_loss"))
    return " | " + ", ".join(f"{name} {_num(part.get(key), '.4f')}"
                             for name, part in zip(sources, parts)) + f" {unit}"


def _num(value: Any, spec: str) -> str:
    return "n/a" if not isinstance(value, int | float) or not math.isfinite(value) else \
        format(value, spec)


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "n/a"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
