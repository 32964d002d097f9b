"""Writing a prepared dataset's files: fixed-size ``.npy`` shards per split, hashed on the way out.

A :class:`SplitWriter` takes one split's documents in order, separates them with the
end-of-document token and flushes a shard whenever its buffer of ``shard_tokens`` is
full, so memory stays at one buffer per split whatever the corpus size.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from .loader import TOKEN_BYTES


class HashingWriter:
    """Passes writes to ``file`` and hashes them (shards are hashed once, on the way out)."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.digest = hashlib.sha256()

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return int(self.file.write(data))


def save_npy(path: Path, array: np.ndarray) -> str:
    """Write ``array`` as ``.npy``; returns the file's sha256."""
    with open(path, "wb") as file:
        out = HashingWriter(file)
        np.lib.format.write_array(out, np.ascontiguousarray(array))
    return out.digest.hexdigest()


class SplitWriter:
    """One split's stream of documents, written as shards of ``shard_tokens`` tokens."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int,
                 table: np.ndarray, eod_id: int) -> None:
        self.folder, self.split, self.table = folder, split, table
        self.buffer = np.empty(shard_tokens, dtype=dtype)
        self.fill, self.tokens, self.bytes, self.documents = 0, 0, 0, 0
        self.eod = np.array([eod_id], dtype=dtype)
        self.entries: list[dict[str, Any]] = []
        self.pending: list[np.ndarray] = []

    def add(self, ids: np.ndarray, starts_document: bool) -> None:
        """Queue a piece (and the separator before a new document) until :meth:`commit`."""
        if starts_document:
            if self.documents:
                self.pending.append(self.eod)  # separators between documents
            self.documents += 1
        self.pending.append(ids)

    def commit(self) -> int:
        """Write the queued pieces (one copy per task, not per piece); returns their tokens."""
        if not self.pending:
            return 0
        ids = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending = []
        self.put(ids)
        return len(ids)

    def put(self, ids: np.ndarray) -> None:
        while len(ids):
            n = min(len(self.buffer) - self.fill, len(ids))
            self.buffer[self.fill:self.fill + n] = ids[:n]
            self.fill, ids = self.fill + n, ids[n:]
            if self.fill == len(self.buffer):
                self.flush()

    def flush(self) -> None:
        if not self.fill:
            return
        data = self.buffer[:self.fill]
        name = f"{self.split}_{len(self.entries):05d}.npy"
        self.entries.append({"file": name, "tokens": self.fill, "sha256": save_npy(
            self.folder / name, data)})
        self.tokens += self.fill
        self.bytes += int(self.table[data].sum())
        self.fill = 0

    def stats(self) -> dict[str, int]:
        return {"documents": self.documents, "tokens": self.tokens, "bytes": self.bytes}


def move_tail(train: SplitWriter, val: SplitWriter, fraction: float) -> None:
    """Move the last ``fraction`` of the train tokens to ``val`` (a shard at a time)."""
    n_val = max(1, round(train.tokens * fraction))
    cut, start, kept = train.tokens - n_val, 0, []
    for entry in train.entries:
        lo, hi = start, start + entry["tokens"]
        start = hi
        if hi <= cut:
            kept.append(entry)
            continue
        path = train.folder / entry["file"]
        shard = np.load(path)
        val.put(shard[max(cut, lo) - lo:])
        path.unlink()
        if lo < cut:
            kept.append({"file": entry["file"], "tokens": cut - lo,
                         "sha256": save_npy(path, shard[:cut - lo])})
    val.flush()
    train.entries, train.tokens, train.bytes = kept, cut, train.bytes - val.bytes


def write_table(folder: Path, table: np.ndarray) -> dict[str, Any]:
    """The bytes-per-token table next to the shards (what bits per byte divides by)."""
    return {"file": TOKEN_BYTES, "sha256": save_npy(folder / TOKEN_BYTES, table)}
