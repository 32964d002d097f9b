"""Downstream evaluation: multiple-choice tasks scored by ranked classification.

:mod:`.catalog` reads the tasks (OLMo's bundled request files, or a user's JSONL),
:mod:`.scoring` scores their choices and defines the metrics. :class:`DownstreamTasks`
holds the tasks of a run, encoded once, and scores a model on them, in one process or
with each rank of a data-parallel run scoring a share of the documents (the sums of the
metrics are combined over the ranks, so the numbers are one process's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..data import Codec
from .catalog import (
    INSTALL,
    Document,
    Task,
    TaskError,
    load_task,
    parse_tasks,
    task_names,
    unscorable_tasks,
)
from .scoring import (
    SUMS,
    EncodedDocument,
    Scored,
    core,
    encode_documents,
    metrics,
    score_documents,
    score_encoded,
)


@dataclass(frozen=True)
class TaskResult:
    """One task's metrics and (in one process) its scored documents."""

    name: str
    metrics: dict[str, float]
    docs: list[Scored]

    def to_json(self) -> dict[str, Any]:
        return {"metrics": self.metrics, "docs": [d.to_json() for d in self.docs]}


class DownstreamTasks:
    """The tasks ``names`` (see :func:`.catalog.load_task`), their first ``limit``
    documents each, scored with ``codec`` and the document-start token ``bos``."""

    def __init__(self, names: Sequence[str], codec: Codec, *, limit: int | None = None,
                 bos: int | None = None, batch_size: int = 16) -> None:
        self.tasks = [load_task(name, limit) for name in names]
        self.codec, self.bos, self.batch_size = codec, bos, batch_size
        self._encodings: dict[tuple[str, int], list[EncodedDocument]] = {}

    @property
    def names(self) -> list[str]:
        return [task.name for task in self.tasks]

    def check(self, vocab_size: int) -> None:
        """Refuse, before anything is scored or written, a task the model's vocabulary
        cannot encode (the encodings are kept: an evaluation in the loop reuses them)."""
        for task in self.tasks:
            self._encoded(task, vocab_size)

    def _encoded(self, task: Task, vocab_size: int) -> list[EncodedDocument]:
        key = (task.name, vocab_size)
        if key not in self._encodings:
            self._encodings[key] = encode_documents(self.codec, task, task.documents,
                                                    vocab_size=vocab_size, bos=self.bos)
        return self._encodings[key]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, *, vocab_size: int, max_len: int, rank: int = 0,
                 world: int = 1, sum_: Any = None) -> dict[str, TaskResult]:
        """Every task's metrics (``max_len``: the model's window); with ``world`` > 1 this
        rank scores documents ``rank``, ``rank + world``, … and ``sum_`` (an in-place
        all-reduce) combines the sums (the results then list this rank's documents)."""
        results = {}
        for task in self.tasks:
            scored, skipped = score_encoded(
                model, task.documents[rank::world],
                self._encoded(task, vocab_size)[rank::world], max_len=max_len,
                batch_size=self.batch_size)
            rows = [d.sums() for d in scored] + [[0.0] * (len(SUMS) - 1) + [float(skipped)]]
            sums = torch.tensor([sum(column) for column in zip(*rows)], dtype=torch.float64)
            if sum_ is not None and world > 1:
                sum_(sums)
            results[task.name] = TaskResult(task.name, metrics(sums.tolist()), scored)
        return results


def summary(results: dict[str, TaskResult]) -> dict[str, Any]:
    """``{task: metrics}`` plus ``core`` and the tasks it averages, ``core_tasks`` (an
    ``eval`` event's ``downstream`` field)."""
    return {"tasks": {name: r.metrics for name, r in results.items()},
            "core": core({name: r.metrics for name, r in results.items()}),
            "core_tasks": list(results)}


__all__ = ["INSTALL", "Document", "DownstreamTasks", "Scored", "Task", "TaskError",
           "TaskResult", "core", "load_task", "metrics", "parse_tasks", "score_documents",
           "summary", "task_names", "unscorable_tasks"]
