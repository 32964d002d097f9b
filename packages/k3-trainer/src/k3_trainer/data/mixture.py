"""Weighted data mixtures: several prepared datasets read as one stream of rows.

Every row of every global batch is drawn from one source by a deterministic schedule over
the global row index (:class:`RowSchedule`): after ``n`` rows every source's count is
within one row of ``weight · n``, for every ``n``. A global batch of ``W·B`` rows is rows
``[i·W·B, (i+1)·W·B)`` of that one stream whatever the world size ``W`` (rank ``r`` keeps
rows ``[r·B, (r+1)·B)`` of it), so a run on other ranks reads exactly the same tokens and
every gradient sees every source in its proportion. Within a source, rows are read in
order, ``seq_len`` tokens apart; a source without a complete row left starts over (its
``epoch`` counts up, reported by :meth:`MixtureLoader.pop_epochs`); the others are
untouched.

The loader's checkpoint state holds the schedule (rows drawn and each source's count),
one cursor per source and the mixture's identity (the sources' names, manifest digests
and weights); another mixture's state is refused unless the loader starts a new phase
(``adopt=True``), which carries over the cursor of every source it shares with the saved
state, starts the others at zero, and restarts the schedule for the new weights. A state
saved by the batch-level mixture of k3-trainer 0.1 (one source per whole batch) is
converted on load: its cursors continue and the schedule starts at the resumed step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .loader import DataError, DataMismatch, TokenDataLoader

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Source:
    """One prepared dataset of a mixture and its weight (relative; normalized over all)."""

    name: str
    path: Path
    weight: float

    @classmethod
    def parse(cls, text: str, default_weight: float | None = None) -> Source:
        """``NAME=DIR:WEIGHT`` (``--data web=data/web:0.7``); given a ``default_weight``,
        also ``NAME=DIR`` (a colon then belongs to DIR unless a number follows it)."""
        name, sep, rest = text.partition("=")
        path, _, weight = rest.rpartition(":")
        optional = default_weight is not None
        if optional and not (path and (not weight or _is_number(weight))):
            path, weight = rest, str(default_weight)  # no weight given
        if not sep or not name or not path:
            form = "NAME=DIR or NAME=DIR:WEIGHT" if optional else "NAME=DIR:WEIGHT"
            raise DataError(f"--data {text!r}: a mixture source is {form} "
                            "(e.g. web=data/web:0.7)")
        try:
            value = float(weight)
        except ValueError:
            raise DataError(f"--data {text!r}: weight {weight!r} is not a number") from None
        return cls(name, Path(path), value)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_sources(sources: Sequence[Source]) -> None:
    """Names unique and plain, weights positive and finite."""
    if not sources:
        raise DataError("a data mixture needs at least one source")
    names = [s.name for s in sources]
    for source in sources:
        if not source.name.replace("_", "").replace("-", "").isalnum():
            raise DataError(f"mixture source name {source.name!r}: use letters, digits, - "
                            "and _")
        if names.count(source.name) > 1:
            raise DataError(f"mixture source {source.name!r} is named twice")
        if not (math.isfinite(source.weight) and source.weight > 0):
            raise DataError(f"mixture source {source.name!r}: weight must be a positive "
                            f"number, got {source.weight!r}")


class RowSchedule:
    """Which source each row of the stream comes from: after every prefix of ``n`` rows,
    ``|count_s − w_s·n| < 1`` for every source ``s``.

    Tijdeman's solution of the chairman assignment problem: row ``n`` (from one) goes to
    the source with the earliest deadline ``(count_s + 1 − σ) / w_s`` among those whose
    deficit ``w_s·n − count_s`` has reached ``σ = 1/(2k − 2)`` (k sources); it keeps every
    count within ``1 − σ`` of its target. The state is the row count and each source's
    count, so the schedule continues exactly from a checkpoint.
    """

    def __init__(self, weights: Sequence[float]) -> None:
        total = sum(weights)
        self.weights = [w / total for w in weights]
        k = len(self.weights)
        self.slack = 1.0 / (2 * k - 2) if k > 1 else 0.0
        self.rows = 0
        self.counts = [0] * k

    def next(self) -> int:
        """The source index of the next row (advancing the schedule)."""
        n = self.rows + 1
        best, deadline = 0, math.inf
        for index, (weight, count) in enumerate(zip(self.weights, self.counts)):
            if weight * n - count >= self.slack - 1e-9:
                due = (count + 1 - self.slack) / weight
                if due < deadline:
                    best, deadline = index, due
        self.rows = n
        self.counts[best] += 1
        return best

    def restore(self, rows: Any, counts: Any) -> None:
        """Continue from a saved ``rows`` and ``counts``, refused unless they are a state
        this schedule reaches (every count within one row of its target)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0 or not (
                isinstance(counts, list) and len(counts) == len(self.weights)
                and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                        for c in counts) and sum(counts) == rows
                and all(abs(c - w * rows) < 1 for c, w in zip(counts, self.weights))):
            raise DataError(f"mixture loader state has schedule rows {rows!r} and counts "
                            f"{counts!r}, not a state of this mixture's schedule")
        self.rows, self.counts = rows, list(counts)


class MixtureLoader:
    """A :class:`~k3_trainer.data.BatchLoader` over the ``split`` of several datasets, row
    by row in proportion to their weights (see the module docstring).

    ``offset`` counts the tokens of the batches drawn (``batches · tokens_per_batch``); the
    per-source cursors live in :attr:`sources`, whose loaders also serve each source's
    whole batches to a per-source evaluation.
    """

    def __init__(self, sources: Sequence[Source], split: str, batch_size: int, seq_len: int,
                 *, rank: int = 0, world_size: int = 1, adopt: bool = False) -> None:
        check_sources(sources)
        self.split, self.adopt = split, adopt
        self.batch_size, self.seq_len = int(batch_size), int(seq_len)
        self.rank, self.world_size = int(rank), int(world_size)
        self.sources: dict[str, TokenDataLoader] = {
            s.name: TokenDataLoader(s.path, split, batch_size, seq_len, rank=rank,
                                    world_size=world_size) for s in sources}
        first, *rest = self.sources.items()
        for name, loader in rest:
            if _tokenizer_identity(loader) != _tokenizer_identity(first[1]):
                raise DataError(f"mixture source {name!r} ({loader.path}) was prepared with "
                                f"another tokenizer than {first[0]!r} ({first[1].path}); every "
                                "source must share one tokenizer")
        self.schedule = RowSchedule([s.weight for s in sources])
        self.weights = dict(zip(self.sources, self.schedule.weights))
        self.vocab_size = first[1].vocab_size
        self.tokenizer = first[1].tokenizer
        self.manifest = first[1].manifest
        self.token_bytes = first[1].token_bytes
        self.num_tokens = sum(loader.num_tokens for loader in self.sources.values())
        self.batches = 0
        self.epochs = dict.fromkeys(self.sources, 0)
        self.drawn = dict.fromkeys(self.sources, 0)  # rows, every rank's
        self._pending: list[tuple[str, int]] = []
        self._last_rows: list[str] = []  # the source of each row of the last batch read

    @property
    def identity(self) -> list[dict[str, Any]]:
        """What a checkpoint records of the mixture: names, manifest digests, weights."""
        return [{"name": name, "manifest_digest": loader.manifest_digest,
                 "weight": self.weights[name]} for name, loader in self.sources.items()]

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len * self.world_size

    @property
    def offset(self) -> int:
        return self.batches * self.tokens_per_batch

    def _plan(self) -> tuple[list[tuple[str, int]], dict[str, Any]]:
        """This rank's rows of the next global batch (source, token offset) and the state
        after it, computed without changing anything."""
        names = list(self.sources)
        schedule = RowSchedule(self.schedule.weights)
        schedule.rows, schedule.counts = self.schedule.rows, list(self.schedule.counts)
        offsets = {name: loader.offset for name, loader in self.sources.items()}
        epochs, drawn, wrapped = dict(self.epochs), dict(self.drawn), []
        mine = range(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        rows = []
        for row in range(self.batch_size * self.world_size):
            name = names[schedule.next()]
            offset = offsets[name]
            if offset + self.seq_len + 1 > self.sources[name].num_tokens:
                offset, epochs[name] = 0, epochs[name] + 1
                wrapped.append((name, epochs[name]))
            if row in mine:
                rows.append((name, offset))
            offsets[name], drawn[name] = offset + self.seq_len, drawn[name] + 1
        after = {"schedule": schedule, "offsets": offsets, "epochs": epochs, "drawn": drawn,
                 "wrapped": wrapped}
        return rows, after

    def _read(self, rows: list[tuple[str, int]]) -> Batch:
        self._last_rows = [name for name, _ in rows]
        windows = [self.sources[name].window(offset, self.seq_len + 1)
                   for name, offset in rows]
        block = torch.from_numpy(np.stack(windows).astype(np.int64))
        return block[:, :-1], block[:, 1:]

    def next_batch(self) -> Batch:
        rows, after = self._plan()
        batch = self._read(rows)
        self.schedule = after["schedule"]
        for name, offset in after["offsets"].items():
            self.sources[name].offset = offset
        self.epochs, self.drawn = after["epochs"], after["drawn"]
        self._pending.extend(after["wrapped"])
        self.batches += 1
        return batch

    def batch_at(self, offset: int) -> Batch:
        """The batch at the cursor, without moving it (a mixture reads in order only)."""
        if offset != self.offset:
            raise DataError(f"a data mixture reads its batches in order: offset {offset} is "
                            f"not its cursor {self.offset}")
        return self._read(self._plan()[0])

    def reset(self) -> None:
        for loader in self.sources.values():
            loader.reset()
        self.schedule = RowSchedule(self.schedule.weights)
        self.batches = 0
        self.epochs = dict.fromkeys(self.sources, 0)
        self.drawn = dict.fromkeys(self.sources, 0)

    def pop_epochs(self) -> list[tuple[str, int]]:
        """``(source, epoch)`` of every source that ran out and started over since the last
        call."""
        pending, self._pending = self._pending, []
        return pending

    def row_sources(self) -> torch.Tensor:
        """Which source each row of the last batch read came from: ``(B,)`` indices into
        the sources in order (``list(self.sources)``), for a per-source training loss."""
        names = list(self.sources)
        return torch.tensor([names.index(name) for name in self._last_rows], dtype=torch.long)

    def tokens_by_source(self) -> dict[str, int]:
        """Training tokens drawn from each source (the global batch, every rank's rows)."""
        return {name: rows * self.seq_len for name, rows in self.drawn.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "mixture", "draw": "rows", "split": self.split,
                "batches": self.batches, "mixture": self.identity,
                "schedule": {"rows": self.schedule.rows,
                             "counts": dict(zip(self.sources, self.schedule.counts))},
                "sources": {name: {**loader.state_dict(), "epoch": self.epochs[name],
                                   "rows": self.drawn[name]}
                            for name, loader in self.sources.items()}}

    def load_state_dict(self, state: Mapping[str, Any], /) -> None:
        """Restore a state of this mixture; with ``adopt``, also another mixture's or a
        single dataset's (a new phase): shared sources keep their cursors and the schedule
        starts over. A batch-level state (k3-trainer 0.1) is converted: cursors kept, the
        schedule started at the resumed batch. Validated whole before anything changes."""
        if state.get("split") != self.split:
            raise DataError(f"loader state belongs to split {state.get('split')!r}, this "
                            f"loader reads split {self.split!r}")
        if state.get("kind") != "mixture":  # a single dataset's cursor
            if not self.adopt:
                raise DataMismatch("loader state belongs to different data (one dataset, not "
                                f"this mixture of {', '.join(self.sources)}); start a new "
                                "phase to change the data")
            saved = {"": {**state, "epoch": 0, "rows": 0}}
            batches = 0
        else:
            if state.get("mixture") != self.identity and not self.adopt:
                raise DataMismatch(
                    "loader state belongs to different data (the mixture "
                    f"{_describe(state.get('mixture'))}; this session reads "
                    f"{_describe(self.identity)}); start a new phase to change the mixture")
            saved, batches = _rows_state(dict(state.get("sources") or {}), state.get("batches"),
                                         self.batch_size * self.world_size)
        schedule = RowSchedule(self.schedule.weights)
        plan = state.get("schedule")
        if state.get("draw") == "rows" and state.get("mixture") == self.identity:
            counts = plan.get("counts") if isinstance(plan, Mapping) else None
            schedule.restore(plan.get("rows") if isinstance(plan, Mapping) else None,
                             [counts.get(name) for name in self.sources]
                             if isinstance(counts, Mapping) else None)
        restored: dict[str, tuple[int, int, int]] = {}
        for name, loader in self.sources.items():
            found = saved.get(name) if not self.adopt else _shared(saved, name, loader)
            if found is None:
                if not self.adopt:
                    raise DataError(f"mixture loader state has no cursor for {name!r}")
                restored[name] = (0, 0, 0)
                continue
            values = []
            for what, top in (("offset", loader.num_tokens), ("epoch", None), ("rows", None)):
                value = found.get(what)
                if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (
                        top is not None and value > top):
                    raise DataError(f"mixture source {name!r}: saved {what} {value!r} is "
                                    "out of range")
                values.append(value)
            restored[name] = (values[0], values[1], values[2])
        for name, (offset, epoch, drawn) in restored.items():
            self.sources[name].offset = offset
            self.epochs[name], self.drawn[name] = epoch, drawn
        self.schedule, self.batches = schedule, batches


def _rows_state(sources: dict[str, Any], batches: Any, rows_per_batch: int
                ) -> tuple[dict[str, Any], int]:
    """The saved sources with row counts, and the batch count, checked; a batch-level
    state's per-source batch counts become rows (each of its batches was one source's)."""
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
        raise DataError(f"mixture loader state has batch count {batches!r}")
    converted = {}
    for name, entry in sources.items():
        if isinstance(entry, Mapping) and "rows" not in entry and "batches" in entry:
            count = entry["batches"]
            rows = count * rows_per_batch if isinstance(count, int) else count
            entry = {**entry, "rows": rows}
        converted[name] = entry
    return converted, batches


def _tokenizer_identity(loader: TokenDataLoader) -> tuple[Any, ...]:
    """What makes two datasets' token ids mean the same: the tokenizer's kind, file digest
    and end-of-document id, and the vocabulary (not where the file came from)."""
    entry = loader.tokenizer
    return (entry.get("kind"), entry.get("sha256"), entry.get("eod_id"), loader.vocab_size)


def _shared(saved: Mapping[str, Any], name: str, loader: TokenDataLoader
            ) -> Mapping[str, Any] | None:
    """The saved cursor of the source ``loader`` reads: the same name and data, or (from a
    single dataset's state) the same data."""
    state = saved.get(name)
    if isinstance(state, Mapping) and state.get("manifest_digest") == loader.manifest_digest:
        return state
    single = saved.get("")
    if isinstance(single, Mapping) and single.get("manifest_digest") == loader.manifest_digest:
        return single
    return None


def _describe(identity: Any) -> str:
    if not isinstance(identity, list):
        return repr(identity)
    return ", ".join(f"{s.get('name')}={s.get('weight')} "
                     f"(data {str(s.get('manifest_digest'))[:12]})" if isinstance(s, dict)
                     else repr(s) for s in identity)
