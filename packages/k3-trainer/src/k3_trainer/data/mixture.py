"""Weighted data mixtures: several prepared datasets read as one stream of batches.

Each global batch comes whole from one source, chosen by a seeded hash of the batch's
index: the same index picks the same source in any session and under any world size, so a
resume and a run on other ranks read exactly the same tokens (every rank its own rows of
that source's global batch). Over many batches each source's share approaches its weight.
A source that runs out starts over (its ``epoch`` counts up, reported by
:meth:`MixtureLoader.pop_epochs`); the others are untouched.

The loader's checkpoint state holds one cursor per source and the mixture's identity (the
sources' names, manifest digests and weights); another mixture's state is refused unless
the loader starts a new phase (``adopt=True``), which carries over the cursor of every
source it shares with the saved state and starts the others at zero.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .loader import DataError, DataExhausted, TokenDataLoader

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Source:
    """One prepared dataset of a mixture and its weight (relative; normalized over all)."""

    name: str
    path: Path
    weight: float

    @classmethod
    def parse(cls, text: str) -> Source:
        """``NAME=PATH:WEIGHT`` (``--data web=data/web:0.7``)."""
        name, sep, rest = text.partition("=")
        path, colon, weight = rest.rpartition(":")
        if not sep or not colon or not name or not path:
            raise DataError(f"--data {text!r}: a mixture source is NAME=PATH:WEIGHT "
                            "(e.g. web=data/web:0.7)")
        try:
            value = float(weight)
        except ValueError:
            raise DataError(f"--data {text!r}: weight {weight!r} is not a number") from None
        return cls(name, Path(path), value)


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


def _unit(seed: int, index: int) -> float:
    """A number in [0, 1) that depends only on ``seed`` and ``index``."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class MixtureLoader:
    """A :class:`~k3_trainer.data.BatchLoader` over the ``split`` of several datasets,
    batch by batch in proportion to their weights (see the module docstring).

    ``offset`` counts the tokens of the batches drawn (``index · tokens_per_batch``); the
    per-source cursors live in :attr:`sources`.
    """

    def __init__(self, sources: Sequence[Source], split: str, batch_size: int, seq_len: int,
                 *, seed: int, rank: int = 0, world_size: int = 1, adopt: bool = False
                 ) -> None:
        check_sources(sources)
        self.split, self.seed, self.adopt = split, int(seed), adopt
        total = sum(s.weight for s in sources)
        self.weights = {s.name: s.weight / total for s in sources}
        self.sources: dict[str, TokenDataLoader] = {
            s.name: TokenDataLoader(s.path, split, batch_size, seq_len, rank=rank,
                                    world_size=world_size) for s in sources}
        first, *rest = self.sources.items()
        for name, loader in rest:
            if _tokenizer_identity(loader) != _tokenizer_identity(first[1]):
                raise DataError(f"mixture source {name!r} ({loader.path}) was prepared with "
                                f"another tokenizer than {first[0]!r} ({first[1].path}); every "
                                "source must share one tokenizer")
        self.vocab_size = first[1].vocab_size
        self.tokenizer = first[1].tokenizer
        self.manifest = first[1].manifest
        self.token_bytes = first[1].token_bytes
        self.num_tokens = sum(loader.num_tokens for loader in self.sources.values())
        self.batches = 0
        self.epochs = dict.fromkeys(self.sources, 0)
        self.drawn = dict.fromkeys(self.sources, 0)
        self._pending: list[tuple[str, int]] = []
        bounds, running = [], 0.0
        for name, weight in self.weights.items():
            running += weight
            bounds.append((running, name))
        self._bounds = bounds

    @property
    def identity(self) -> list[dict[str, Any]]:
        """What a checkpoint records of the mixture: names, manifest digests, weights."""
        return [{"name": name, "manifest_digest": loader.manifest_digest,
                 "weight": self.weights[name]} for name, loader in self.sources.items()]

    @property
    def tokens_per_batch(self) -> int:
        return next(iter(self.sources.values())).tokens_per_batch

    @property
    def offset(self) -> int:
        return self.batches * self.tokens_per_batch

    def source_at(self, index: int) -> str:
        """The source of the ``index``-th batch (from zero)."""
        u = _unit(self.seed, index)
        return next((name for bound, name in self._bounds if u < bound), self._bounds[-1][1])

    def next_batch(self) -> Batch:
        name = self.source_at(self.batches)
        loader = self.sources[name]
        try:
            batch = loader.next_batch()
        except DataExhausted:
            loader.reset()
            self.epochs[name] += 1
            self._pending.append((name, self.epochs[name]))
            batch = loader.next_batch()
        self.batches += 1
        self.drawn[name] += 1
        return batch

    def batch_at(self, offset: int) -> Batch:
        """The batch at the cursor, without moving it (a mixture reads in order only)."""
        if offset != self.offset:
            raise DataError(f"a data mixture reads its batches in order: offset {offset} is "
                            f"not its cursor {self.offset}")
        loader = self.sources[self.source_at(self.batches)]
        try:
            return loader.batch_at(loader.offset)
        except DataExhausted:
            return loader.batch_at(0)

    def reset(self) -> None:
        for loader in self.sources.values():
            loader.reset()
        self.batches = 0
        self.epochs = dict.fromkeys(self.sources, 0)
        self.drawn = dict.fromkeys(self.sources, 0)

    def pop_epochs(self) -> list[tuple[str, int]]:
        """``(source, epoch)`` of every source that ran out and started over since the last
        call."""
        pending, self._pending = self._pending, []
        return pending

    def tokens_by_source(self) -> dict[str, int]:
        """Training tokens drawn from each source (the global batch, every rank's rows)."""
        return {name: count * self.tokens_per_batch for name, count in self.drawn.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "mixture", "split": self.split, "batches": self.batches,
                "mixture": self.identity,
                "sources": {name: {**loader.state_dict(), "epoch": self.epochs[name],
                                   "batches": self.drawn[name]}
                            for name, loader in self.sources.items()}}

    def load_state_dict(self, state: Mapping[str, Any], /) -> None:
        """Restore a state of this mixture; with ``adopt``, also another mixture's or a
        single dataset's (a new phase): shared sources keep their cursors. Validated whole
        before anything changes."""
        if state.get("split") != self.split:
            raise DataError(f"loader state belongs to split {state.get('split')!r}, this "
                            f"loader reads split {self.split!r}")
        if state.get("kind") != "mixture":  # a single dataset's cursor
            if not self.adopt:
                raise DataError("loader state belongs to different data (one dataset, not "
                                f"this mixture of {', '.join(self.sources)}); start a new "
                                "phase to change the data")
            saved = {"": {**state, "epoch": 0, "batches": 0}}
            batches = 0
        else:
            if state.get("mixture") != self.identity and not self.adopt:
                raise DataError(
                    "loader state belongs to different data (the mixture "
                    f"{_describe(state.get('mixture'))}; this session reads "
                    f"{_describe(self.identity)}); start a new phase to change the mixture")
            saved, count = dict(state.get("sources") or {}), state.get("batches")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise DataError(f"mixture loader state has batch count {count!r}")
            batches = count
        restored: dict[str, tuple[int, int, int]] = {}
        for name, loader in self.sources.items():
            found = saved.get(name) if not self.adopt else _shared(saved, name, loader)
            if found is None:
                if not self.adopt:
                    raise DataError(f"mixture loader state has no cursor for {name!r}")
                restored[name] = (0, 0, 0)
                continue
            values = []
            for what, top in (("offset", loader.num_tokens), ("epoch", None),
                              ("batches", None)):
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
        self.batches = batches


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
