"""Input readers for ``prepare``: files and folders of text, JSONL and Parquet, as documents.

A document is one ``.txt``/``.md`` file, one JSON line, or one Parquet row. Every reader
streams: a text file is yielded in line-aligned pieces of about ``PIECE_BYTES``, a JSONL
file line by line, a Parquet file in row batches, so memory does not grow with the
corpus. Records that are empty or lack the text field are counted in :class:`RecordCounts`
(never dropped silently); a file that cannot be decoded raises :class:`DataError` naming
the file and line.

JSON lines are yielded undecoded: :func:`resolve` parses them wherever the caller wants
(``prepare`` does it in its worker processes, so the reading process only splits lines).
"""

from __future__ import annotations

import gzip
import io
import json
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

    @property
    def skipped(self) -> int:
        return self.empty + self.missing_field + self.not_text

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
    :func:`resolve` status the consumer counts in ``file.counts``."""

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


def input_kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return None


def discover(inputs: Sequence[str | Path]) -> list[InputFile]:
    """Input files in a fixed order: arguments in order, each folder's files sorted by path.

    Inside folders (searched recursively) only known suffixes are read and hidden entries
    are skipped; a file named explicitly is read as text unless its suffix says otherwise.
    """
    files: list[InputFile] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            for child in sorted(path.rglob("*")):
                relative = child.relative_to(path).parts
                kind = input_kind(child)
                if kind and child.is_file() and not any(p.startswith(".") for p in relative):
                    files.append(InputFile(child, kind))
        elif path.is_file():
            files.append(InputFile(path, input_kind(path) or "text"))
        else:
            raise DataError(f"input {path} not found")
    if not files and inputs:
        raise DataError("no input files found: folders are searched for "
                        + ", ".join(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES))
    return files


def read_pieces(file: InputFile, text_field: str = "text") -> Iterator[Piece]:
    """The pieces of ``file``'s documents in order. Text and Parquet readers count into
    ``file.counts`` themselves; JSON lines are counted by whoever resolves them."""
    if file.kind == "text":
        yield from _text_pieces(file)
    elif file.kind == "jsonl":
        yield from _jsonl_pieces(file, text_field)
    else:
        yield from _parquet_pieces(file, text_field)


def _text_pieces(file: InputFile) -> Iterator[Piece]:
    """Line-aligned pieces; leading blank pieces wait until the file proves non-empty."""
    line_no, held = 0, []
    started = False
    try:
        with open(file.path, "rb") as f:
            while lines := f.readlines(PIECE_BYTES):
                raw = b"".join(lines)
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    bad = line_no + raw.count(b"\n", 0, exc.start) + 1
                    raise DataError(f"{file.path}: line {bad}: not UTF-8 text ({exc.reason})"
                                    ) from None
                line_no += len(lines)
                if not started and not text.strip():
                    held.append(text)
                    continue
                for blank in held:
                    yield Piece(blank, not started)
                    started = True
                held = []
                yield Piece(text, not started)
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
                    yield Piece(value, True)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"{file.path}: row {row + 1}: cannot be read ({_one_line(exc)})"
                        ) from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
