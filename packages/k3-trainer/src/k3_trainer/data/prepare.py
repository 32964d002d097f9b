"""Dataset preparation: read documents, tokenize them in parallel, write shards and a manifest.

The built-in corpus is CPython's own reference documentation: the ``pydoc_data.topics``
module that ships with every standard Python install (the text ``help("while")`` shows,
about 460 KB of English prose and grammar). It needs no download, so the demo runs on a
machine with no network.

**Determinism.** The main process reads records in a fixed order (inputs in order,
folders sorted) and cuts them into tasks that do not depend on the number of workers;
workers parse JSON lines and tokenize, and the main process counts, numbers documents and
writes the results in task order. The shards are therefore the same bytes for any
``workers``.

**Validation split.** Every ``N``-th document goes to validation, ``N = round(1 /
val_fraction)`` (documents ``N-1, 2N-1, ...`` in input order), so validation samples the
whole corpus, never a contiguous tail of one file. A corpus with fewer than ``N``
documents (one text file, the built-in corpus) has none to spare and is split by tokens
instead: the last ``val_fraction`` of its token stream is validation. Within a split,
documents are separated by the tokenizer's end-of-document token.

**Memory.** Documents stream through a bounded window of tasks; each split fills one
shard buffer of ``shard_tokens`` tokens and flushes it when full.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .loader import MANIFEST, MANIFEST_FORMAT, DataError, file_sha256, token_dtype
from .options import BUCKET_BYTES, PrepareOptions
from .shards import (
    DocumentShuffle,
    SplitWriter,
    move_tail,
    write_table,
)
from .sources import (
    INVALID,
    InputFile,
    Piece,
    RecordCounts,
    discover,
    invalid_record,
    read_pieces,
    resolve,
)
from .tokenizer import TOKENIZER_FILE, BytesCodec, Codec, HFCodec, codec_from_spec, train_bpe

TASK_CHARS = 1 << 19  # about 0.5 MB of text per worker task
TASK_PIECES = 4096
TASKS_IN_FLIGHT_PER_WORKER = 2


def builtin_corpus() -> tuple[str, dict[str, Any]]:
    """The built-in corpus text and a description of where it came from."""
    from pydoc_data import topics

    names = sorted(topics.topics)
    text = "\n\n".join(topics.topics[name].strip() for name in names) + "\n"
    return text, {"builtin": "pydoc_data.topics", "python": sys.version.split()[0],
                  "topics": len(names)}


def prepare_dataset(inputs: Sequence[str | Path], out_dir: str | Path,
                    options: PrepareOptions | None = None, *, overwrite: bool = False,
                    progress: bool = False) -> dict[str, Any]:
    """Tokenize ``inputs`` (files or folders; none = the built-in corpus) into ``out_dir``.

    Shards are written to a temporary sibling folder that replaces ``out_dir`` only when
    complete, so an interrupted prepare never leaves something that looks like a dataset.
    Returns the manifest.
    """
    options = options if options is not None else PrepareOptions()
    val_fraction, shard_tokens, workers = (options.val_fraction, options.shard_tokens,
                                           options.workers)
    out_dir = Path(out_dir)
    if not 0.0 < val_fraction <= 0.5:
        raise DataError(f"val_fraction must be in (0, 0.5], got {val_fraction!r}")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be positive, got {shard_tokens!r}")
    if workers < 1:
        raise DataError(f"workers must be positive, got {workers!r}")
    if out_dir.exists() and not overwrite:
        raise DataError(f"{out_dir} already exists; choose another --out or remove it")
    corpus = _Corpus(inputs, options.text_field)
    codec, origin = _choose_codec(corpus, options)
    dtype = token_dtype(codec.vocab_size)
    table = codec.token_byte_lengths()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        every = max(2, round(1 / val_fraction))
        writers = {split: SplitWriter(staging, split, dtype, shard_tokens, table, codec.eod_id)
                   for split in ("train", "val")}
        sink = _Splitter(writers, every)
        order: dict[str, Any] = {"order": "input"}
        if options.shuffle_seed is not None:
            buckets = max(1, -(-corpus.input_bytes() // BUCKET_BYTES))
            shuffle = DocumentShuffle(staging, options.shuffle_seed, buckets, dtype)
            sink = _Shuffled(writers, every, shuffle)
            order = {"order": "shuffled", "seed": options.shuffle_seed, "buckets": buckets}
        _tokenize_into(corpus, codec, sink, workers, progress)
        train, val = writers["train"], writers["val"]
        if train.tokens + val.tokens < 2:
            raise DataError(f"the corpus is empty: nothing to train on ({corpus.skipped_note()})")
        if val.documents:
            rule: dict[str, Any] = {"rule": "every_nth_document", "n": every, **order}
        else:
            move_tail(train, val, val_fraction)
            rule = {"rule": "token_tail", "fraction": val_fraction,
                    "why": f"fewer than {every} documents", **order}

        manifest: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "tokenizer": {**codec.describe(), **origin},
            "vocab_size": codec.vocab_size,
            "dtype": dtype,
            "token_bytes": write_table(staging, table),
            "source": corpus.describe(),
            "records": corpus.counts().to_dict(),
            "validation": rule,
            "split_stats": {s: w.stats() for s, w in writers.items()},
            "splits": {s: w.entries for s, w in writers.items()},
        }
        if isinstance(codec, HFCodec):
            (staging / TOKENIZER_FILE).write_text(codec.json_text, encoding="utf-8")
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        for file in staging.iterdir():
            os.chmod(file, 0o444)  # a prepared dataset is immutable
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.chmod(0o777 & ~_umask())  # mkdtemp made it 0700: follow the umask instead
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # the shuffle buckets with it
        raise
    return manifest


def describe_prepared(out_dir: str | Path, manifest: dict[str, Any]) -> str:
    """One line for the user: tokens per split, documents, skipped records, tokenizer."""
    counts = {k: sum(s["tokens"] for s in v) for k, v in manifest["splits"].items()}
    records = manifest["records"]
    skipped = [f"{records[k]} {what}" for k, what in (
        ("empty", "empty"), ("missing_field", "without the text field"),
        ("not_text", "with a non-text field")) if records[k]]
    tokenizer = manifest["tokenizer"]
    return (f"prepared {out_dir}: " + ", ".join(f"{k} {n:,} tokens" for k, n in counts.items())
            + f"; {records['documents']:,} documents"
            + (f" (skipped {', '.join(skipped)})" if skipped else "")
            + f"; tokenizer {tokenizer['kind']}, vocab_size {manifest['vocab_size']}, "
            f"end-of-document id {tokenizer['eod_id']}")


class _Corpus:
    """The inputs as one ordered stream of pieces, plus what reading them found."""

    def __init__(self, inputs: Sequence[str | Path], text_field: str) -> None:
        self.text_field = text_field
        self.files = discover(inputs)
        self.builtin = builtin_corpus() if not inputs else None

    def pieces(self, files: list[InputFile] | None = None) -> Iterator[Piece]:
        if self.builtin is not None:
            yield Piece(self.builtin[0], True)
        for file in self.files if files is None else files:
            yield from read_pieces(file, self.text_field)

    def fresh_pieces(self) -> Iterator[Piece]:
        """The same stream, counted separately (for tokenizer training)."""
        return self.pieces([InputFile(f.path, f.kind) for f in self.files])

    def counts(self) -> RecordCounts:
        total = RecordCounts(documents=1 if self.builtin else 0)
        for file in self.files:
            total.add(file.counts)
        return total

    def skipped_note(self) -> str:
        c = self.counts()
        return (f"{c.documents} documents; skipped {c.empty} empty, {c.missing_field} without "
                f"{self.text_field!r}, {c.not_text} with a non-text {self.text_field!r}")

    def input_bytes(self) -> int:
        """The inputs' size on disk (compressed files count as stored): sizes the shuffle."""
        if self.builtin is not None:
            return len(self.builtin[0])
        return sum(f.path.stat().st_size for f in self.files)

    def describe(self) -> dict[str, Any]:
        if self.builtin is not None:
            return self.builtin[1]
        return {"text_field": self.text_field, "files": [
            {"path": str(f.path), "kind": f.kind, "bytes": f.path.stat().st_size,
             "sha256": file_sha256(f.path), **f.counts.to_dict()} for f in self.files]}


def _choose_codec(corpus: _Corpus, options: PrepareOptions) -> tuple[Codec, dict[str, Any]]:
    tokenizer, train_tokenizer = options.tokenizer, options.train_tokenizer
    sample_mb = options.tokenizer_sample_mb
    if train_tokenizer is not None:
        if str(tokenizer) != "bytes":
            raise DataError("choose one of --tokenizer PATH and --train-tokenizer VOCAB_SIZE")
        limit = None if sample_mb is None else int(sample_mb * 1e6)
        codec = train_bpe(_sample(corpus.fresh_pieces(), limit), train_tokenizer)
        return codec, {"trained": {"vocab_size": train_tokenizer, "sample_mb": sample_mb}}
    if sample_mb is not None:
        raise DataError("--tokenizer-sample applies only with --train-tokenizer")
    if str(tokenizer) == "bytes":
        return BytesCodec(), {}
    return HFCodec.from_file(tokenizer, options.eod_token), {"source": str(tokenizer)}


def _sample(pieces: Iterator[Piece], limit: int | None) -> Iterator[str]:
    """Texts from the start of the stream, up to ``limit`` characters (None: all)."""
    seen = 0
    for piece in pieces:
        if limit is not None and seen >= limit:
            return
        status, text = resolve(piece.text, piece.json_field)
        if status == INVALID:
            raise invalid_record(piece, text)
        if status == "documents":
            seen += len(text)
            yield text


Task = tuple[list[Piece], list[tuple[str, str | None]]]


def _tasks(pieces: Iterator[Piece]) -> Iterator[Task]:
    """Pieces grouped into tasks by size alone: the pieces (text moved out) and, for the
    worker, each text with the JSON field to parse it by (None: plain text)."""
    meta: list[Piece] = []
    items: list[tuple[str, str | None]] = []
    size = 0
    for piece in pieces:
        items.append((piece.text, piece.json_field))
        size += len(piece.text)
        piece.text = ""
        meta.append(piece)
        if size >= TASK_CHARS or len(items) >= TASK_PIECES:
            yield meta, items
            meta, items, size = [], [], 0
    if items:
        yield meta, items


_WORKER_CODEC: Codec | None = None


def _init_worker(spec: dict[str, Any]) -> None:
    global _WORKER_CODEC
    _WORKER_CODEC = codec_from_spec(spec)


def _init_pool_worker(spec: dict[str, Any]) -> None:
    """Ctrl-C reaches the whole process group; the main process alone handles it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(spec)


Encoded = tuple[list[str], np.ndarray, np.ndarray, int]


def _encode_task(items: list[tuple[str, str | None]]) -> Encoded:
    """Per piece its status (``documents``, a skip reason, or ``invalid:MESSAGE``); the
    documents' token ids as one array with the offsets where each starts (one array, not
    one per document, is what makes the trip back from a worker cheap); their UTF-8 size
    (for the progress rate)."""
    codec = _WORKER_CODEC
    assert codec is not None
    statuses, texts = [], []
    for text, json_field in items:
        status, value = resolve(text, json_field)
        statuses.append(f"{INVALID}:{value}" if status == INVALID else status)
        if status == "documents":
            texts.append(value)
    ids = codec.encode_batch(texts)
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in ids], out=offsets[1:])
    flat = np.concatenate(ids) if ids else np.empty(0)
    size = sum(len(t.encode("utf-8")) for t in texts)
    return statuses, flat.astype(token_dtype(codec.vocab_size), copy=False), offsets, size


def _tokenized(tasks: Iterator[Task], codec: Codec, workers: int
               ) -> Iterator[tuple[list[Piece], Encoded]]:
    """Each task's metadata with its token ids, in task order, at most
    ``TASKS_IN_FLIGHT_PER_WORKER`` tasks per worker in flight (bounded memory)."""
    if workers == 1:
        _init_worker(codec.spec())
        for meta, items in tasks:
            yield meta, _encode_task(items)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    gc.freeze()  # forked workers would otherwise copy every page the collector touches
    try:
        pool = multiprocessing.get_context(method).Pool(workers, _init_pool_worker,
                                                          (codec.spec(),))
    finally:
        gc.unfreeze()
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    with pool:
        pending: deque[Any] = deque()
        for meta, items in tasks:
            pending.append((meta, pool.apply_async(_encode_task, (items,))))
            if len(pending) >= TASKS_IN_FLIGHT_PER_WORKER * workers:
                meta, result = pending.popleft()
                yield meta, result.get()
        while pending:
            meta, result = pending.popleft()
            yield meta, result.get()


class _Splitter:
    """Documents in the order they come: every ``every``-th is validation."""

    def __init__(self, writers: dict[str, SplitWriter], every: int) -> None:
        self.writers, self.every = writers, every
        self.document, self.split, self.added = -1, "train", 0

    def add(self, ids: np.ndarray, starts_document: bool) -> None:
        if starts_document:
            self.document += 1
            self.split = "val" if self.document % self.every == self.every - 1 else "train"
        self.writers[self.split].add(ids, starts_document)

    def commit(self) -> int:
        return sum(writer.commit() for writer in self.writers.values())

    def finish(self) -> None:
        for writer in self.writers.values():
            writer.flush()


class _Shuffled(_Splitter):
    """Documents in a seeded shuffled order (:class:`DocumentShuffle`), then split as they
    come: the training stream and the validation prefix both sample the whole corpus."""

    def __init__(self, writers: dict[str, SplitWriter], every: int,
                 shuffle: DocumentShuffle) -> None:
        super().__init__(writers, every)
        self.shuffle = shuffle

    def add(self, ids: np.ndarray, starts_document: bool) -> None:
        self.shuffle.add(ids, starts_document)
        self.added += len(ids)

    def commit(self) -> int:
        added, self.added = self.added, 0
        return added

    def finish(self) -> None:
        def take(ids: np.ndarray) -> None:
            super(_Shuffled, self).add(ids, True)
            if self.document % 4096 == 0:
                super(_Shuffled, self).commit()

        self.shuffle.drain(take)
        super().commit()
        super().finish()


def _tokenize_into(corpus: _Corpus, codec: Codec, sink: _Splitter, workers: int,
                   progress: bool) -> None:
    from tqdm import tqdm

    bar = tqdm(unit="B", unit_scale=True, desc="prepare", disable=not progress,
               dynamic_ncols=True, file=sys.stderr)
    start, tokens = time.perf_counter(), 0
    with bar:
        for meta, (statuses, ids, offsets, size) in _tokenized(_tasks(corpus.pieces()), codec,
                                                               workers):
            kept = 0
            for piece, status in zip(meta, statuses):
                if status.startswith(INVALID):
                    raise invalid_record(piece, status[len(INVALID) + 1:])
                if piece.json_field is not None and piece.file is not None:
                    piece.file.counts.count(status)
                if status != "documents":
                    continue
                sink.add(ids[offsets[kept]:offsets[kept + 1]], piece.starts_document)
                kept += 1
            tokens += sink.commit()
            bar.update(size)
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.3g}", refresh=False)
    sink.finish()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
