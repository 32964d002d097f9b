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

**One tokenizer, several datasets.** :func:`prepare_each` writes each input as its own
dataset with one tokenizer (trained on all inputs, in proportion to their sizes, or
given), so the datasets train together as a mixture. Every output is staged first and
the outputs are renamed into place together once all are complete: a failure in any
input leaves none of them.
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
from .readers import (
    INVALID,
    JSONL_SUFFIXES,
    PARQUET_SUFFIXES,
    TEXT_SUFFIXES,
    InputFile,
    Piece,
    RecordCounts,
    discover_each,
    invalid_record,
    read_pieces,
    resolve,
)
from .shards import (
    DocumentShuffle,
    SplitWriter,
    move_tail,
    write_table,
)
from .tokenizer import TOKENIZER_FILE, BytesCodec, Codec, HFCodec, codec_from_spec, train_bpe

TASK_CHARS = 1 << 19  # about 0.5 MB of text per worker task
TASK_PIECES = 4096
TASKS_IN_FLIGHT_PER_WORKER = 2


def builtin_corpus() -> tuple[list[str], dict[str, Any]]:
    """The built-in corpus, one document per topic in name order, and a description of
    where it came from."""
    from pydoc_data import topics

    names = sorted(topics.topics)
    documents = [topics.topics[name].strip() + "\n" for name in names]
    return documents, {"builtin": "pydoc_data.topics", "python": sys.version.split()[0],
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
    out_dir = Path(out_dir)
    _check_options(options)
    _check_outputs([out_dir], overwrite, "--out")
    if not inputs and (options.include or options.exclude):
        raise DataError("--include and --exclude pick files inside input folders; the "
                        "built-in corpus has none (name the input folders)")
    files = discover_each(inputs, options.include, options.exclude) if inputs else []
    _check_apart([out_dir], inputs, "--out")
    corpus = _Corpus([str(i) for i in inputs], files, options.text_field)
    codec, origin = _choose_codec([corpus], options, proportional=False)
    with _Staging() as staging:
        manifest = _write(corpus, codec, origin, staging.folder(out_dir), options, progress)
        staging.publish()
    return manifest


def prepare_each(inputs: Sequence[str | Path], out_root: str | Path,
                 options: PrepareOptions | None = None, *, overwrite: bool = False,
                 progress: bool = False) -> dict[Path, dict[str, Any]]:
    """Tokenize each input (a file or folder) into its own dataset ``out_root/NAME`` (NAME:
    the input's name without its suffix), all with one tokenizer: ``options.tokenizer``,
    or a BPE trained on every input (``options.train_tokenizer``; with
    ``tokenizer_sample_mb``, that many MB drawn from the inputs in proportion to their
    sizes on disk). The datasets share the tokenizer exactly (its file, sha256 and
    end-of-document id), so they train together as a mixture.

    Every check runs before anything is written, every dataset is staged in full, and the
    staged folders are renamed into place together only when all are complete: a failure
    in any input leaves no dataset (and no replaced one). Returns each folder's manifest.
    """
    options = options if options is not None else PrepareOptions()
    _check_options(options)
    if not inputs:
        raise DataError("--out-each writes one dataset per input: name the input files or "
                        "folders (the built-in corpus is one dataset: use --out)")
    out_root = Path(out_root)
    if out_root.exists() and not out_root.is_dir():
        raise DataError(f"--out-each {out_root} is not a folder")
    outs = [out_root / name for name in dataset_names(inputs)]
    _check_outputs(outs, overwrite, "--out-each")
    each = discover_each(inputs, options.include, options.exclude)
    _check_apart(outs, inputs, "--out-each")
    corpora = [_Corpus([str(item)], [files], options.text_field)
               for item, files in zip(inputs, each)]
    codec, origin = _choose_codec(corpora, options, proportional=True)
    manifests: dict[Path, dict[str, Any]] = {}
    with _Staging() as staging:
        for out, corpus in zip(outs, corpora):
            manifests[out] = _write(corpus, codec, origin, staging.folder(out), options,
                                    progress, label=out.name, one_of_many=True)
        staging.publish()
    return manifests


def dataset_names(inputs: Sequence[str | Path]) -> list[str]:
    """Each input's dataset name for :func:`prepare_each`: its file or folder name without
    a known suffix (``web.jsonl.gz`` → ``web``), a folder's whole, another file's without
    its last suffix (``x.tar`` → ``x``); two inputs with one name are refused."""
    names: dict[str, str] = {}
    result = []
    for item in inputs:
        name = Path(os.path.abspath(item)).name
        lower = name.lower()
        known = [s for s in JSONL_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES
                 if lower.endswith(s) and len(s) < len(name)]
        stem = name[:-max(map(len, known))] if known else (
            name if Path(item).is_dir() else Path(name).stem)
        if not stem or stem in (".", ".."):
            raise DataError(f"input {item} has no name to give its dataset; name a folder "
                            "or file inside it instead")
        if stem in names:
            raise DataError(f"inputs {names[stem]} and {item} would both be written to the "
                            f"dataset {stem!r}: rename one, or prepare them in two calls")
        names[stem] = str(item)
        result.append(stem)
    return result


def _check_options(options: PrepareOptions) -> None:
    if not 0.0 < options.val_fraction <= 0.5:
        raise DataError(f"val_fraction must be in (0, 0.5], got {options.val_fraction!r}")
    if options.shard_tokens < 1:
        raise DataError(f"shard_tokens must be positive, got {options.shard_tokens!r}")
    if options.workers < 1:
        raise DataError(f"workers must be positive, got {options.workers!r}")
    if options.train_tokenizer is not None and str(options.tokenizer) != "bytes":
        raise DataError("choose one of --tokenizer PATH and --train-tokenizer VOCAB_SIZE")
    if options.train_tokenizer is None and options.tokenizer_sample_mb is not None:
        raise DataError("--tokenizer-sample applies only with --train-tokenizer")
    if options.tokenizer_sample_mb is not None and not options.tokenizer_sample_mb > 0:
        raise DataError(f"--tokenizer-sample must be a positive number of MB, got "
                        f"{options.tokenizer_sample_mb!r}")


def _check_outputs(outs: Sequence[Path], overwrite: bool, flag: str) -> None:
    """Each output is new, or (``overwrite``) a prepared dataset or an empty folder."""
    for out in outs:
        if not out.exists():
            continue
        if not out.is_dir():
            raise DataError(f"{out} exists and is not a folder; choose another {flag}")
        if not overwrite:
            raise DataError(f"{out} already exists; choose another {flag}, remove it, or "
                            "replace it with --overwrite")
        if not (out / MANIFEST).is_file() and any(out.iterdir()):
            raise DataError(f"{out} is not a prepared dataset (it has no {MANIFEST}): "
                            "--overwrite replaces only datasets; remove it yourself")


def _check_apart(outs: Sequence[Path], inputs: Sequence[str | Path], flag: str) -> None:
    """No output inside an input folder (a later run would read it) or holding an input
    (replacing the output would delete it)."""
    for out in outs:
        target = Path(os.path.abspath(out))
        for item in inputs:
            source = Path(os.path.abspath(item))
            where = ("is" if target == source else "is inside" if source in target.parents
                     else "holds" if target in source.parents else None)
            if where is not None:
                raise DataError(f"{flag} {out} {where} the input {item}: write the dataset "
                                "outside its inputs")


class _Staging:
    """Output folders written as hidden siblings, renamed into place together by
    :meth:`publish`; on an error every staged folder (and every parent folder made for
    them) is removed."""

    def __init__(self) -> None:
        self.staged: list[tuple[Path, Path]] = []
        self.made: list[Path] = []

    def __enter__(self) -> _Staging:
        return self

    def folder(self, out: Path) -> Path:
        missing = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
        out.parent.mkdir(parents=True, exist_ok=True)
        self.made.extend(missing)  # deepest first
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        self.staged.append((staging, out))
        return staging

    def publish(self) -> None:
        for staging, _ in self.staged:
            for file in staging.iterdir():
                os.chmod(file, 0o444)  # a prepared dataset is immutable
            staging.chmod(0o777 & ~_umask())  # mkdtemp made it 0700: follow the umask
        for staging, out in self.staged:
            if out.exists():
                shutil.rmtree(out)
            staging.rename(out)
        self.staged, self.made = [], []

    def __exit__(self, kind: Any, *rest: Any) -> None:
        if kind is None:
            return
        for staging, _ in self.staged:
            shutil.rmtree(staging, ignore_errors=True)  # the shuffle buckets with it
        for folder in self.made:
            try:
                folder.rmdir()
            except OSError:
                break


def _write(corpus: _Corpus, codec: Codec, origin: dict[str, Any], staging: Path,
           options: PrepareOptions, progress: bool, label: str = "prepare",
           one_of_many: bool = False) -> dict[str, Any]:
    """Tokenize ``corpus`` into the folder ``staging`` (``label``: the progress bar's;
    ``one_of_many``: one input of :func:`prepare_each`); returns the manifest written
    there."""
    val_fraction = options.val_fraction
    dtype = token_dtype(codec.vocab_size)
    table = codec.token_byte_lengths()
    every = max(2, round(1 / val_fraction))
    builtin = corpus.builtin is not None  # its last topics' tokens are validation, in order
    writers = {split: SplitWriter(staging, split, dtype, options.shard_tokens, table,
                                  codec.eod_id) for split in ("train", "val")}
    sink = _Splitter(writers, 0 if builtin else every)
    order: dict[str, Any] = {"order": "input"}
    if options.shuffle_seed is not None and not builtin:
        buckets = max(1, -(-corpus.input_bytes() // BUCKET_BYTES))
        shuffle = DocumentShuffle(staging, options.shuffle_seed, buckets, dtype)
        sink = _Shuffled(writers, every, shuffle)
        order = {"order": "shuffled", "seed": options.shuffle_seed, "buckets": buckets}
    inside = _tokenize_into(corpus, codec, sink, options.workers, progress, label,
                            options.allow_eod_in_text)
    train, val = writers["train"], writers["val"]
    if train.tokens + val.tokens < 2:
        what = f"the input {corpus.labels[0]}" if one_of_many else "the corpus"
        raise DataError(f"{what} is empty: nothing to train on ({corpus.skipped_note()})")
    if val.documents:
        rule: dict[str, Any] = {"rule": "every_nth_document", "n": every, **order}
    else:
        move_tail(train, val, val_fraction)
        rule = {"rule": "token_tail", "fraction": val_fraction,
                "why": "the built-in corpus" if builtin else f"fewer than {every} documents",
                **order}

    allowed = {"eod_in_text": inside} if options.allow_eod_in_text else {}
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "tokenizer": {**codec.describe(), **origin, **allowed},
        "vocab_size": codec.vocab_size,
        "dtype": dtype,
        "token_bytes": write_table(staging, table),
        "source": corpus.describe(options),
        "records": corpus.counts().to_dict(),
        "validation": rule,
        "split_stats": {s: w.stats() for s, w in writers.items()},
        "splits": {s: w.entries for s, w in writers.items()},
    }
    if isinstance(codec, HFCodec):
        (staging / TOKENIZER_FILE).write_text(codec.json_text, encoding="utf-8")
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def describe_prepared(out_dir: str | Path, manifest: dict[str, Any]) -> str:
    """One line for the user: tokens per split, documents, skipped records and files,
    bytes per token, tokenizer."""
    counts = {k: sum(s["tokens"] for s in v) for k, v in manifest["splits"].items()}
    records = manifest["records"]
    skipped = [f"{records[k]} {what}" for k, what in (
        ("empty", "empty"), ("missing_field", "without the text field"),
        ("not_text", "with a non-text field")) if records.get(k)]
    if records.get("not_utf8"):
        files = manifest["source"].get("files", [])
        first = next((f for f in files if f.get("not_utf8")), None)
        plural = "s that are" if records["not_utf8"] > 1 else " that is"
        skipped.append(f"{records['not_utf8']} file{plural} not UTF-8 text"
                       + (f", the first {first['path']}: {first.get('skipped')}" if first else ""))
    tokenizer = manifest["tokenizer"]
    stats = manifest.get("split_stats", {})
    tokens = sum(s.get("tokens", 0) for s in stats.values())
    per_token = ""
    if tokenizer["kind"] != "bytes" and tokens:
        per_token = f"; {sum(s.get('bytes', 0) for s in stats.values()) / tokens:.2f} bytes/token"
    return (f"prepared {out_dir}: " + ", ".join(f"{k} {n:,} tokens" for k, n in counts.items())
            + f"; {records['documents']:,} documents"
            + (f" (skipped {', '.join(skipped)})" if skipped else "")
            + per_token
            + f"; tokenizer {tokenizer['kind']}, vocab_size {manifest['vocab_size']}, "
            f"end-of-document id {tokenizer['eod_id']}"
            + (f" (inside the documents' text {tokenizer['eod_in_text']:,} times: "
               "--allow-eod-in-text)" if tokenizer.get("eod_in_text") else ""))


class _Corpus:
    """The inputs as one ordered stream of pieces, plus what reading them found.

    ``labels`` names the inputs and ``each`` holds each one's files (no inputs: the
    built-in corpus)."""

    def __init__(self, labels: list[str], each: list[list[InputFile]], text_field: str
                 ) -> None:
        self.text_field = text_field
        self.labels = labels
        self.each = each
        self.files = [file for files in each for file in files]
        self.builtin = builtin_corpus() if not labels else None

    def pieces(self, files: list[InputFile] | None = None) -> Iterator[Piece]:
        if self.builtin is not None:
            for document in self.builtin[0]:
                yield Piece(document, True)
        for file in self.files if files is None else files:
            yield from read_pieces(file, self.text_field)

    def fresh_pieces(self, files: list[InputFile] | None = None) -> Iterator[Piece]:
        """The same stream (or that of ``files``), counted separately (for tokenizer
        training)."""
        return self.pieces([InputFile(f.path, f.kind)
                            for f in (self.files if files is None else files)])

    def counts(self) -> RecordCounts:
        total = RecordCounts(documents=len(self.builtin[0]) if self.builtin else 0)
        for file in self.files:
            total.add(file.counts)
        return total

    def skipped_note(self) -> str:
        c = self.counts()
        note = (f"{c.documents} documents; skipped {c.empty} empty, {c.missing_field} without "
                f"{self.text_field!r}, {c.not_text} with a non-text {self.text_field!r}")
        first = next((f for f in self.files if f.skipped), None)
        if first is not None:
            files = "file that is" if c.not_utf8 == 1 else "files that are"
            note += f", {c.not_utf8} {files} not UTF-8 text, the first {first.path}: " \
                f"{first.skipped}"
        return note

    def input_bytes(self, files: list[InputFile] | None = None) -> int:
        """The inputs' size on disk (compressed files count as stored): sizes the shuffle."""
        if self.builtin is not None:
            return sum(len(document) for document in self.builtin[0])
        return sum(f.path.stat().st_size for f in (self.files if files is None else files))

    def describe(self, options: PrepareOptions) -> dict[str, Any]:
        if self.builtin is not None:
            return self.builtin[1]
        patterns = {k: list(v) for k, v in (("include", options.include),
                                            ("exclude", options.exclude)) if v}
        return {"text_field": self.text_field, **patterns, "files": [
            {"path": str(f.path), "kind": f.kind, "bytes": f.path.stat().st_size,
             "sha256": file_sha256(f.path), **f.counts.to_dict(),
             **({"skipped": f.skipped} if f.skipped else {})} for f in self.files]}


def _choose_codec(corpora: Sequence[_Corpus], options: PrepareOptions, *, proportional: bool
                  ) -> tuple[Codec, dict[str, Any]]:
    """The tokenizer and the manifest's record of where it came from. A trained one learns
    from every input: the first ``tokenizer_sample_mb`` MB of the stream, or (``proportional``)
    that many MB drawn from each corpus in proportion to its size on disk."""
    tokenizer, train_tokenizer = options.tokenizer, options.train_tokenizer
    sample_mb = options.tokenizer_sample_mb
    if train_tokenizer is not None:
        limit = None if sample_mb is None else int(sample_mb * 1e6)
        seen: list[dict[str, Any]] = []
        codec = train_bpe(_training_texts(corpora, limit, proportional, seen), train_tokenizer)
        sample = "all" if limit is None else "proportional" if proportional else "first"
        return codec, {"trained": {"vocab_size": train_tokenizer, "sample_mb": sample_mb,
                                   "sample": sample, "on": seen}}
    if str(tokenizer) == "bytes":
        return BytesCodec(), {}
    return HFCodec.from_file(tokenizer, options.eod_token), {"source": str(tokenizer)}


def _training_texts(corpora: Sequence[_Corpus], limit: int | None, proportional: bool,
                    seen: list[dict[str, Any]]) -> Iterator[str]:
    """The texts the tokenizer trains on, input by input: all of them (``limit`` None),
    the first ``limit`` characters of the stream, or (``proportional``) a share of
    ``limit`` from the start of each input in proportion to its size on disk. Appends to
    ``seen`` each input with the UTF-8 bytes of its text that the tokenizer saw."""
    inputs: list[tuple[str, int, Iterator[Piece]]] = []
    for corpus in corpora:
        if corpus.builtin is not None:
            inputs.append((str(corpus.builtin[1]["builtin"]), corpus.input_bytes(),
                           corpus.pieces()))
        for label, files in zip(corpus.labels, corpus.each):
            inputs.append((label, corpus.input_bytes(files), corpus.fresh_pieces(files)))
    total = max(1, sum(size for _, size, _ in inputs))
    left = limit
    for label, size, pieces in inputs:
        if proportional and limit is not None:
            left = round(limit * size / total)
        used = 0
        for text in _sample(pieces, left):
            used += len(text.encode("utf-8"))
            if left is not None and not proportional:
                left -= len(text)  # the stream's first ``limit`` characters, over all inputs
            yield text
        seen.append({"input": label, "bytes": used})


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


Encoded = tuple[list[str], np.ndarray, np.ndarray, int, int, int]


def _encode_task(items: list[tuple[str, str | None]]) -> Encoded:
    """Per piece its status (``documents``, a skip reason, or ``invalid:MESSAGE``); the
    documents' token ids as one array with the offsets where each starts (one array, not
    one per document, is what makes the trip back from a worker cheap); their UTF-8 size
    (for the progress rate); how often the end-of-document id occurs inside them and the
    first document it occurs in (-1: none)."""
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
    inside = np.flatnonzero(flat == codec.eod_id)
    first = int(np.searchsorted(offsets, inside[0], side="right")) - 1 if inside.size else -1
    return (statuses, flat.astype(token_dtype(codec.vocab_size), copy=False), offsets, size,
            int(inside.size), first)


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
    """Documents in the order they come: every ``every``-th is validation (0: none)."""

    def __init__(self, writers: dict[str, SplitWriter], every: int) -> None:
        self.writers, self.every = writers, every
        self.document, self.split, self.added = -1, "train", 0

    def add(self, ids: np.ndarray, starts_document: bool) -> None:
        if starts_document:
            self.document += 1
            self.split = "val" if self.every and self.document % self.every == self.every - 1 \
                else "train"
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
                   progress: bool, label: str = "prepare", allow_eod_in_text: bool = False
                   ) -> int:
    """Tokenize the corpus into ``sink``; returns how often the end-of-document id occurred
    inside the documents (refused at the first task where it does, unless
    ``allow_eod_in_text``)."""
    from tqdm import tqdm

    bar = tqdm(unit="B", unit_scale=True, desc=label, disable=not progress,
               dynamic_ncols=True, file=sys.stderr)
    start, tokens, inside = time.perf_counter(), 0, 0
    with bar:
        for meta, (statuses, ids, offsets, size, eods, first) in _tokenized(
                _tasks(corpus.pieces()), codec, workers):
            kept = 0
            for piece, status in zip(meta, statuses):
                if status.startswith(INVALID):
                    raise invalid_record(piece, status[len(INVALID) + 1:])
                if piece.json_field is not None and piece.file is not None:
                    piece.file.counts.count(status)
                if status != "documents":
                    continue
                if kept == first and not allow_eod_in_text:
                    raise _eod_in_text(codec, piece, eods)
                sink.add(ids[offsets[kept]:offsets[kept + 1]], piece.starts_document)
                kept += 1
            inside += eods
            tokens += sink.commit()
            bar.update(size)
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.3g}", refresh=False)
    sink.finish()
    return inside


def _eod_in_text(codec: Codec, piece: Piece, count: int) -> DataError:
    """The refusal of an end-of-document token that occurs inside a document."""
    where = "the built-in corpus" if piece.file is None else str(piece.file.path) + (
        f":{piece.line}" if piece.line else "")
    token = getattr(codec, "eod_token", str(codec.eod_id))
    return DataError(
        f"the end-of-document token {token!r} (id {codec.eod_id}) occurs inside the documents' "
        f"text (first in {where}; {count:,} times in the ~{TASK_CHARS / 1e6:.1f} MB read with "
        "it): it would end a document wherever it occurs "
        "(--document-masking too); name the tokenizer's own end-of-document special token "
        "with --eod-token, or keep going with --allow-eod-in-text (the manifest records it)")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
