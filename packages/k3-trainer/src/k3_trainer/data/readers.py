"""Input readers for ``prepare``: files and folders of text, JSONL and Parquet, as documents.

A document is one text file (``.txt``/``.md`` in a folder, any file a ``--include``
pattern or the command line names), one JSON line, or one Parquet row. Every reader
streams: a text file is yielded in line-aligned pieces of about ``PIECE_BYTES``, a JSONL
file line by line, a Parquet file in row batches, so memory does not grow with the
corpus. Records that are empty or lack the text field are counted in :class:`RecordCounts`
(never dropped silently), and so is a text file that is not UTF-8 text (invalid UTF-8 or
a NUL byte: a binary file that a broad ``--include`` took in), which is skipped whole; a
JSONL file that cannot be decoded raises :class:`DataError` naming the file and line.

JSON lines are yielded undecoded: :func:`resolve` parses them wherever the caller wants
(``prepare`` does it in its worker processes, so the reading process only splits lines).
"""

from __future__ import annotations

import fnmatch
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .loader import DataError

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
PIECE_BYTES = 1 << 20
PARQUET_BATCH_ROWS = 1024


@dataclass
class RecordCounts:
    """What the readers saw: documents kept and records skipped, by reason."""

    documents: int = 0
    empty: int = 0
    missing_field: int = 0
    not_text: int = 0
    not_utf8: int = 0
    """Text files skipped whole: not UTF-8, or holding a NUL byte (binary)."""

    @property
    def skipped(self) -> int:
        return self.empty + self.missing_field + self.not_text + self.not_utf8

    def count(self, status: str) -> None:
        setattr(self, status, getattr(self, status) + 1)

    def add(self, other: RecordCounts) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class Piece:
    """Text of one document or of a part of it (long text files are read in parts), or
    with ``json_field`` set, one undecoded JSON line (``file`` line ``line``) whose
    :func:`resolve` status the consumer counts in ``file.counts``. ``file``: the input it
    came from (None: the built-in corpus); ``line``: its JSON line or Parquet row."""

    text: str
    starts_document: bool
    json_field: str | None = None
    file: InputFile | None = None
    line: int = 0


INVALID = "invalid"


def parse_record(line: str, text_field: str) -> tuple[str, str]:
    """``(status, text)`` of one JSON line: status ``documents`` with the text, a
    :class:`RecordCounts` reason with ``""``, or ``INVALID`` with the parser's message."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return INVALID, str(exc)
    value = record.get(text_field) if isinstance(record, dict) else None
    if value is None:
        return "missing_field", ""
    if not isinstance(value, str):
        return "not_text", ""
    if not value.strip():
        return "empty", ""
    return "documents", value


def resolve(text: str, json_field: str | None) -> tuple[str, str]:
    """A piece's status and text (``json_field``: ``text`` is a JSON line to parse)."""
    return ("documents", text) if json_field is None else parse_record(text, json_field)


def invalid_record(piece: Piece, message: str) -> DataError:
    path = piece.file.path if piece.file else "?"
    return DataError(f"{path}: line {piece.line}: not valid JSON ({message})")


@dataclass
class InputFile:
    path: Path
    kind: str  # "text", "jsonl" or "parquet"
    counts: RecordCounts = field(default_factory=RecordCounts)
    skipped: str | None = None
    """Why the whole file was skipped (a text file that is not UTF-8 text), else None."""


def input_kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return None


def check_patterns(include: Sequence[str], exclude: Sequence[str]) -> None:
    """Patterns match file names: one with a path separator would never match."""
    for flag, patterns in (("--include", include), ("--exclude", exclude)):
        for pattern in patterns:
            if not pattern or "/" in pattern or os.sep in pattern:
                raise DataError(f"{flag} {pattern!r}: a pattern matches file names, not paths "
                                "(e.g. '*.h', 'README', '*')")


def _matches(name: str, patterns: Sequence[str]) -> list[str]:
    return [p for p in patterns if fnmatch.fnmatchcase(name, p)]


def discover_each(inputs: Sequence[str | Path], include: Sequence[str] = (),
                  exclude: Sequence[str] = ()) -> list[list[InputFile]]:
    """Each input's files, in a fixed order: each folder's files sorted by path.

    Inside folders (searched recursively, hidden entries skipped) a file is read when its
    suffix is a known one or its name matches an ``include`` pattern, and not when its name
    matches an ``exclude`` pattern; a file named explicitly is always read, as text unless
    its suffix says otherwise. An ``include`` pattern that matches no file in any folder is
    an error, and so is an input with no file to read.
    """
    check_patterns(include, exclude)
    each: list[list[InputFile]] = []
    folders: list[Path] = []
    used: set[str] = set()
    for item in inputs:
        path = Path(item)
        files: list[InputFile] = []
        if path.is_dir():
            folders.append(path)
            for child in sorted(path.rglob("*")):
                relative = child.relative_to(path).parts
                if any(p.startswith(".") for p in relative) or not child.is_file():
                    continue
                kind = input_kind(child)
                included = _matches(child.name, include)
                used.update(included)
                if (kind or included) and not _matches(child.name, exclude):
                    files.append(InputFile(child, kind or "text"))
        elif path.is_file():
            files.append(InputFile(path, input_kind(path) or "text"))
        else:
            raise DataError(f"input {path} not found")
        each.append(files)
    unused = [p for p in include if p not in used]
    if unused and not folders:
        raise DataError(f"--include {unused[0]!r} picks files inside input folders, and no "
                        "input is a folder (a file named as an input is read whatever its "
                        "suffix)")
    if unused:
        raise DataError(f"--include {unused[0]!r} matches no file in the input folders "
                        f"({', '.join(str(f) for f in folders)}); patterns match file names, "
                        "hidden entries are skipped")
    for item, files in zip(inputs, each):
        if not files:
            raise DataError(f"no input files found in {item}: {_searched(include, exclude)}")
    return each


def _searched(include: Sequence[str], exclude: Sequence[str]) -> str:
    what = "folders are searched for " + ", ".join(
        TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES)
    if include:
        what += " and the --include patterns " + ", ".join(repr(p) for p in include)
    else:
        what += " (add others with --include '*.EXT')"
    if exclude:
        what += ", less the --exclude patterns " + ", ".join(repr(p) for p in exclude)
    return what


def discover(inputs: Sequence[str | Path], include: Sequence[str] = (),
             exclude: Sequence[str] = ()) -> list[InputFile]:
    """All inputs' files in one list (see :func:`discover_each`)."""
    return [file for files in discover_each(inputs, include, exclude) for file in files]


def read_pieces(file: InputFile, text_field: str = "text") -> Iterator[Piece]:
    """The pieces of ``file``'s documents in order. Text and Parquet readers count into
    ``file.counts`` themselves; JSON lines are counted by whoever resolves them."""
    if file.kind == "text":
        yield from _text_pieces(file)
    elif file.kind == "jsonl":
        yield from _jsonl_pieces(file, text_field)
    else:
        yield from _parquet_pieces(file, text_field)


def _decoded(raw: bytes, first_line: int) -> tuple[str, str | None]:
    """A line-aligned block's text, or ``""`` and why it is not UTF-8 text (whichever of
    invalid UTF-8 and a NUL byte comes first; ``first_line`` is the block's first line)."""
    nul = raw.find(b"\0")
    try:
        text = raw.decode("utf-8")
        bad, why = -1, ""
    except UnicodeDecodeError as exc:
        text, bad, why = "", exc.start, f"not UTF-8 at line {{}}: {exc.reason}"
    if nul >= 0 and (bad < 0 or nul < bad):
        bad, why = nul, "a NUL byte at line {}"
    if bad < 0:
        return text, None
    return "", why.format(first_line + raw.count(b"\n", 0, bad))


def _text_problem(path: Path) -> str | None:
    """Why the file is not UTF-8 text (None: it is), reading it in blocks."""
    line_no = 0
    with open(path, "rb") as f:
        while lines := f.readlines(PIECE_BYTES):
            _, why = _decoded(b"".join(lines), line_no + 1)
            if why is not None:
                return why
            line_no += len(lines)
    return None


def _text_pieces(file: InputFile) -> Iterator[Piece]:
    """Line-aligned pieces; leading blank pieces wait until the file proves non-empty.

    A file that is not UTF-8 text is counted (``not_utf8``) and skipped before any piece
    of it is yielded: a file larger than one piece is checked whole first (read twice);
    a smaller one is one piece, checked as it is read.
    """
    line_no, held = 0, []
    started = False
    try:
        if file.path.stat().st_size > PIECE_BYTES:
            file.skipped = _text_problem(file.path)
            if file.skipped is not None:
                file.counts.not_utf8 += 1
                return
        with open(file.path, "rb") as f:
            while lines := f.readlines(PIECE_BYTES):
                text, why = _decoded(b"".join(lines), line_no + 1)
                if why is not None:
                    if not started:  # nothing of the file was yielded: skip it whole
                        file.skipped = why
                        file.counts.not_utf8 += 1
                        return
                    raise DataError(f"{file.path}: {why}; the file changed while it was read")
                line_no += len(lines)
                if not started and not text.strip():
                    held.append(text)
                    continue
                for blank in held:
                    yield Piece(blank, not started, file=file)
                    started = True
                held = []
                yield Piece(text, not started, file=file)
                started = True
    except OSError as exc:
        raise DataError(f"input {file.path} cannot be read: {exc}") from None
    if started:
        file.counts.documents += 1
    else:
        file.counts.empty += 1


def _open_jsonl(path: Path) -> io.TextIOWrapper:
    return io.TextIOWrapper(_open_binary(path), encoding="utf-8", newline="\n")


def _open_binary(path: Path) -> Any:
    """The file's decompressed bytes."""
    name = path.name.lower()
    binary: Any
    if name.endswith(".gz"):
        binary = gzip.open(path, "rb")  # noqa: SIM115 (the caller closes it)
    elif name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path}: reading .zst needs zstandard: pip install 'k3-trainer[zstd]'"
                            ) from None
        raw = open(path, "rb")  # noqa: SIM115 (the stream reader closes it)
        binary = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    else:
        binary = open(path, "rb")  # noqa: SIM115 (the caller closes it)
    return binary


def _first_bad_line(path: Path) -> int:
    """The line holding the first invalid UTF-8 (the text reader decodes in blocks)."""
    with _open_binary(path) as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return line_no
    return 0


def _jsonl_pieces(file: InputFile, text_field: str) -> Iterator[Piece]:
    """One record per line, undecoded; blank lines are not records."""
    line_no = 0
    try:
        with _open_jsonl(file.path) as f:
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    yield Piece(line, True, text_field, file, line_no)
    except UnicodeDecodeError as exc:
        raise DataError(f"{file.path}: line {_first_bad_line(file.path)}: not UTF-8 text "
                        f"({exc.reason})") from None
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{file.path}: line {line_no + 1}: cannot be read ({_one_line(exc)}); "
                        "the file is corrupt or truncated") from None
    except Exception as exc:  # zstandard raises its own ZstdError
        if type(exc).__name__ != "ZstdError":
            raise
        raise DataError(f"{file.path}: line {line_no + 1}: cannot be read ({_one_line(exc)}); "
                        "the file is corrupt or truncated") from None


def require_pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading .parquet needs pyarrow: pip install 'k3-trainer[parquet]'"
                        ) from None
    return pq


def _parquet_pieces(file: InputFile, text_field: str) -> Iterator[Piece]:
    pq = require_pyarrow()
    counts = file.counts
    try:
        parquet = pq.ParquetFile(file.path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        raise DataError(f"{file.path}: not a readable Parquet file ({_one_line(exc)})") from None
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise DataError(f"{file.path}: no column {text_field!r} (columns: {', '.join(names)}); "
                        "choose the text column with --text-field")
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
            for value in batch.column(0).to_pylist():
                row += 1
                if value is None:
                    counts.missing_field += 1
                elif not isinstance(value, str):
                    counts.not_text += 1
                elif not value.strip():
                    counts.empty += 1
                else:
                    counts.documents += 1
                    yield Piece(value, True, file=file, line=row)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"{file.path}: row {row + 1}: cannot be read ({_one_line(exc)})"
                        ) from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
