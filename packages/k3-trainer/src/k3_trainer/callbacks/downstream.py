"""Downstream tasks in the loop: the run scored on a few tasks every N steps and at its end.

:class:`DownstreamEvaluator` scores :class:`~k3_trainer.tasks.DownstreamTasks` (the same
first K documents each time, so the curves compare like with like) and publishes the
result as an ``eval`` event carrying ``downstream``: ``{"tasks": {task: {"acc", "acc_norm",
"bpb", "centered_acc", "docs"}}, "core": …}``; metrics.jsonl, the log lines, the progress
bar and the report read it from there. The time it takes is its own phase
(``downstream``) in the session's timings. In a data-parallel run every rank scores a
share of the documents and the sums are combined, so the numbers are one process's.
Under pipeline stages the documents go forward only through the stages
(:class:`~k3_trainer.pipeline.PipelineScoring`), their contexts cut to ``seq_len``.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..tasks import DownstreamTasks, summary
from .base import Callback, Run


class DownstreamEvaluator(Callback):
    """Score ``tasks`` every ``interval`` successful steps and at the last one.

    ``vocab_size`` and ``max_len``: the model's vocabulary and window (checked against
    the tasks' text when built, so a run never fails on them late)."""

    def __init__(self, tasks: DownstreamTasks, interval: int, *, vocab_size: int,
                 max_len: int) -> None:
        if interval < 1:
            raise ValueError(f"DownstreamEvaluator: interval must be ≥ 1, got {interval}")
        tasks.check(vocab_size)
        self.tasks, self.interval = tasks, interval
        self.vocab_size, self.max_len = vocab_size, max_len

    def on_step_end(self, trainer: Run, stats: dict[str, float]) -> None:
        step = trainer.state.step
        if step % self.interval and step != trainer.config.max_steps:
            return
        with trainer.profiler.region("downstream"):
            found = self.evaluate(trainer)
        trainer.emit("eval", step=step, tokens_seen=trainer.state.tokens_seen,
                     downstream=found)

    def evaluate(self, trainer: Run) -> dict[str, Any]:
        """The tasks' metrics and ``core`` for the trainer's model as it is now."""
        parallel = trainer.parallel
        stages = None if parallel is None else parallel.stages
        if stages is not None:  # forward only through the stages, every document here
            from ..pipeline import PipelineScoring

            return summary(self.tasks.evaluate(
                PipelineScoring(stages, trainer.model), vocab_size=self.vocab_size,
                max_len=min(self.max_len, trainer.config.seq_len)))
        with (parallel.full_parameters(trainer.model) if parallel is not None
              else contextlib.nullcontext()):
            results = self.tasks.evaluate(
                trainer.model, vocab_size=self.vocab_size, max_len=self.max_len,
                rank=0 if parallel is None else parallel.rank,
                world=1 if parallel is None else parallel.world_size,
                sum_=None if parallel is None else parallel.sum_)
        return summary(results)

