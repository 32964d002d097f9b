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


class DocumentShuffle:
    """A seeded shuffle of a stream of documents too large for memory.

    Each document goes, as it arrives, to one of ``buckets`` temporary files chosen by a
    seeded hash of its index; :meth:`drain` then reads the buckets one at a time, permutes
    each with a generator seeded by the seed and the bucket, and hands the documents on in
    that order. The order depends on the seed, the documents and the bucket count only
    (never on how many workers tokenized them), and memory holds one bucket at a time.
    """

    def __init__(self, folder: Path, seed: int, buckets: int, dtype: str) -> None:
        self.folder, self.seed, self.dtype = folder, seed, dtype
        self.files = [open(folder / f".shuffle-{b:05d}.bin", "wb")  # noqa: SIM115
                      for b in range(buckets)]
        self.lengths: list[list[int]] = [[] for _ in range(buckets)]
        self.document = -1
        self.bucket = 0

    def add(self, ids: np.ndarray, starts_document: bool) -> None:
        """A piece of the current document, or the first piece of the next one."""
        if starts_document:
            self.document += 1
            self.bucket = _bucket(self.seed, self.document, len(self.files))
            self.lengths[self.bucket].append(0)
        self.files[self.bucket].write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self.lengths[self.bucket][-1] += len(ids)

    def drain(self, take: Any) -> None:
        """Call ``take(ids)`` for every document in the shuffled order; deletes the buckets."""
        for file in self.files:
            file.close()
        for b, file in enumerate(self.files):
            path = Path(file.name)
            tokens = np.fromfile(path, dtype=self.dtype)
            path.unlink()
            lengths = np.asarray(self.lengths[b], dtype=np.int64)
            ends = np.cumsum(lengths)
            order = np.random.default_rng([self.seed, b]).permutation(len(lengths))
            for d in order:
                take(tokens[ends[d] - lengths[d]:ends[d]])

    def close(self) -> None:
        """Remove what is left (a failed prepare)."""
        for file in self.files:
            file.close()
            Path(file.name).unlink(missing_ok=True)


def _bucket(seed: int, document: int, buckets: int) -> int:
    """A seeded, well-mixed hash of the document's index (SplitMix64's finalizer)."""
    x = (seed * 0x9E3779B97F4A7C15 + document + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) % buckets
