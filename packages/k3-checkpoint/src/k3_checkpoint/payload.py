"""The file on disk: the payload as ``torch.save`` wrote it (a zip), then a 64-byte trailer.

Trailer (little-endian), the zip's comment, so the file stays an ordinary zip::

    0   8  magic     b"\\x89K3CKPT\\n"
    8   4  format    7
    12  4  scheme    2 = XXH3-128 (``k3_checkpoint.integrity``)
    16  8  length    bytes before the trailer
    24  16 checksum  of those bytes
    40  20 zero
    60  4  crc32     of bytes 0-59

Why a trailer and not a field inside the pickle: a checksum cannot cover the bytes that
hold it, and the trailer (its CRC, the length) is checked before torch opens the file, so a
cut file never reaches the zip and pickle parsers. Why at the end:
``torch.load(path)`` needs the zip to start the file.
Together the trailer's CRC, the exact length and the checksum make every bit of the file
matter: a flip or a cut anywhere is a ``CheckpointError``, never a half-read payload.
The payload is loaded only by ``torch.load(path, weights_only=True)``, torch's public
weights-only load, so a hostile pickle cannot run code (the checksum is not a
signature: anyone can recompute it). Files written by 0.1.x (a sha256 header in front)
are still read (``legacy.py``).

Writes are atomic: ``torch.save`` writes ``path.tmp`` through ``_ZipWriter``, which hashes
every byte on its way to the file (nothing is read back) and holds the zip's end record back
until its comment length is the trailer's; the trailer is appended, the file is fsynced,
renamed over ``path`` (the rename frees the file it replaces, before the save returns) and
the directory is fsynced. A crash at any point leaves the previous ``path`` intact; nothing
reads ``.tmp`` in place of ``path``, and one cut short has no trailer, which the reader
refuses by name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import struct
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch

from . import legacy
from .errors import CheckpointError
from .integrity import checksum_of_file, running_checksum

__all__ = [
    "FORMAT_VERSION", "HISTORICAL_FORMATS", "fsync_directory", "pack_trailer", "read_payload",
    "write_payload",
]  # fmt: skip

FORMAT_VERSION = 7
"""The only format this package writes and reads."""

HISTORICAL_FORMATS = range(3, 7)
"""Formats 3-6: earlier trainer recipes, recognised so they are refused by name."""

MAGIC = legacy.MAGIC
_FIELDS = struct.Struct("<8sIIQ16s20x")
_CRC = struct.Struct("<I")
TRAILER_SIZE = _FIELDS.size + _CRC.size
XXH3_128 = 2  # checksum scheme id (1 was 0.1.x's sha256 header: legacy.py)
_END_RECORD = struct.Struct("<4s16xH")  # a zip's end of central directory: 22 bytes
_END_SIGNATURE = b"PK\x05\x06"
_SEARCH = 1 << 16  # how far back from the end a displaced trailer is looked for


def pack_trailer(format_version: int, length: int, checksum: bytes) -> bytes:
    """The 64-byte trailer for ``length`` bytes of zip whose checksum is ``checksum``."""
    fields = _FIELDS.pack(MAGIC, format_version, XXH3_128, length, checksum)
    return fields + _CRC.pack(zlib.crc32(fields))


def write_payload(path: str | os.PathLike[str], payload: Mapping[str, Any]) -> str:
    """Atomically write ``payload`` to ``path`` (see the module docstring); return its hex
    checksum.

    The file ``path`` held before is freed by the rename, inside the save, as a
    ``torch.save`` over it frees it. It is not left to a close on a background thread:
    freeing a large file is block-allocator and device work (on a filesystem mounted with
    ``discard``, its blocks are discarded as they are freed), and running after the save
    returned it overlapped the next file's writing, whose block allocation then waited for
    the block groups being freed: a save that came soon after another took up to twice as
    long, at random, and whatever followed a save (a ``torch.save`` too) paid for what it had
    left behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            zip_writer = _ZipWriter(file)
            torch.save(dict(payload), zip_writer)  # type: ignore[arg-type]  # write, flush
            checksum = zip_writer.finish()
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        cause = _os_error_behind(error)
        if cause is None:
            raise
        # torch's zip writer turns a failed write (disk full, quota, file size limit) into
        # a RuntimeError about stream positions; the caller needs the OSError behind it.
        raise OSError(cause.errno, cause.strerror or str(cause), str(temporary)) from error
    fsync_directory(path.parent)
    return checksum.hex()


class _ZipWriter:
    """The file-like ``torch.save`` writes to (``write`` and ``flush``, what ``torch.save``
    asks of one): each byte goes to ``file`` and into the checksum as it is written, except
    the last 22, which may be the zip's end record and are held back until ``finish``.

    Hashing on the way out reads each byte once more from the memory ``torch.save`` writes
    it from; hashing the finished file would copy all of it back out of the page cache
    first. The end record is held back because the trailer is the zip's comment: its
    comment length changes before it is hashed, so it is written once, in order, and the
    file is written front to back."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._checksum = running_checksum()
        self._held = b""
        self._length = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        keep = _END_RECORD.size
        if size >= keep:
            self._pass_on(self._held)
            self._pass_on(view[: size - keep])
            self._held = view[size - keep :].tobytes()
        else:
            joined = self._held + view.tobytes()
            self._pass_on(joined[: max(0, len(joined) - keep)])
            self._held = joined[-keep:]
        self._length += size
        return size

    def flush(self) -> None:
        self._file.flush()

    def _pass_on(self, data: bytes | memoryview) -> None:
        if data:
            self._checksum.update(data)
            self._file.write(data)

    def finish(self) -> bytes:
        """Make the trailer the zip's comment (set the comment length of the end record
        ``torch.save`` wrote last, 22 bytes with no comment, to the trailer's size), write
        the end record and the trailer; return the checksum of the zip."""
        end = bytearray(self._held)
        if len(end) != _END_RECORD.size or _END_RECORD.unpack(end) != (_END_SIGNATURE, 0):
            raise CheckpointError("torch.save wrote a zip whose end record is not last; this "
                                  "k3-checkpoint does not know the layout of this torch's files")
        struct.pack_into("<H", end, _END_RECORD.size - 2, TRAILER_SIZE)
        self._pass_on(memoryview(end))
        self._held = b""
        checksum = self._checksum.digest()
        self._file.write(pack_trailer(FORMAT_VERSION, self._length, checksum))
        return checksum


def _os_error_behind(error: BaseException) -> OSError | None:
    """The OSError that caused ``error`` when ``error`` is not one itself, else None."""
    if isinstance(error, OSError) or not isinstance(error, Exception):
        return None
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, OSError):
            return link
        link = link.__cause__ or link.__context__
    return None


def read_payload(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The verified payload of a format-7 checkpoint, touching no live object.

    Checks the trailer, the length and the checksum before loading, loads with
    ``torch.load(weights_only=True)`` onto the CPU, and checks the format version.
    Formats 3-6 are refused by name; every other problem raises ``CheckpointError``
    naming the file and the reason.
    """
    return read_verified(path).payload


class Verified(NamedTuple):
    """A payload whose checksum matched."""

    payload: dict[str, Any]
    digest: str
    """The file's hex checksum (sha256 for a 0.1.x file): the checkpoint's identity."""


def read_verified(path: str | os.PathLike[str]) -> Verified:
    """``read_payload``, with the checksum.

    The trailer is checked, the payload hashed and ``torch.load`` given the same path (see
    ``_load_checked``); the file's identity (device, inode, size, modification time) before
    and after says it was neither replaced nor modified meanwhile, so the payload returned is
    made of the bytes that were verified.
    """
    path = Path(path)
    try:
        with open(path, "rb") as file:
            before = os.fstat(file.fileno())
            tail = _tail(file, before.st_size)
            if tail[-TRAILER_SIZE:][: len(MAGIC)] == MAGIC:
                version, length, expected = _read_trailer(before.st_size, tail[-TRAILER_SIZE:],
                                                          path)
                payload, digest = _load_checked(file, before, length, expected, path)
            elif _head(file) == MAGIC:  # 0.1.x: the header in front
                version, data, digest = legacy.read_legacy(file, before.st_size, path)
                _refuse_format(version, path)
                payload = _weights_only(lambda: legacy.load_bytes(data), path,
                                        "torch.load(weights_only=True)")
            else:
                raise CheckpointError(_identify_foreign(path, file, before.st_size, tail),
                                      path=path)
    except OSError as error:
        raise CheckpointError(f"cannot be read: {error.strerror or error}", path=path) from error
    if not isinstance(payload, dict):
        raise CheckpointError(f"payload is a {type(payload).__name__}, not a dict", path=path)
    saved = payload.get("format_version")
    if format_problem(saved) is not None or saved != version:
        raise CheckpointError(
            f"payload format_version {saved!r} disagrees with the file's {version}", path=path
        )
    return Verified(payload, digest)


def _tail(file: BinaryIO, size: int) -> bytes:
    """The file's last bytes, enough to hold a trailer and find a displaced one."""
    file.seek(max(0, size - _SEARCH))
    return file.read()


def _head(file: BinaryIO) -> bytes:
    file.seek(0)
    return file.read(len(MAGIC))


def _identity(status: os.stat_result) -> tuple[int, int, int, int]:
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def _read_trailer(size: int, trailer: bytes, path: Path) -> tuple[int, int, bytes]:
    """``(format version, payload length, expected checksum)`` once the trailer holds."""
    if len(trailer) < TRAILER_SIZE:
        raise CheckpointError(f"is truncated: {size} bytes, not even a trailer", path=path)
    fields, (crc,) = trailer[: _FIELDS.size], _CRC.unpack(trailer[_FIELDS.size :])
    if zlib.crc32(fields) != crc:
        raise CheckpointError("trailer is corrupt (its CRC does not match)", path=path)
    _, version, scheme, length, expected = _FIELDS.unpack(fields)
    _refuse_format(version, path)
    if scheme != XXH3_128:
        raise CheckpointError(f"unknown checksum scheme id {scheme}", path=path)
    if length != size - TRAILER_SIZE:
        raise CheckpointError(
            f"is {size} bytes, its trailer promises {length + TRAILER_SIZE} (bytes were cut "
            "from or inserted into the file)",
            path=path,
        )
    return version, length, expected


OVERLAP_FROM = 32 << 20
"""Payloads this large are hashed on a thread while torch parses them. Below it, starting
the thread and handing the interpreter lock back and forth cost more than the hash saves
(measured: BENCHMARKS.md)."""

OVERLAP_CHUNK = 4 << 20
"""The thread's read granularity. It takes the interpreter lock back after every read and
every hash call, each time from torch's unpickler, which runs Python; larger reads mean
fewer handoffs, at the price of a buffer of this size beside the loaded state."""


def _load_checked(
    file: BinaryIO, before: os.stat_result, length: int, expected: bytes, path: Path
) -> Verified:
    """``torch.load`` of ``path``, returned only once bytes ``[0, length)`` of ``file`` hash
    to ``expected`` and the file is still the one ``before`` describes.

    A large payload is hashed while torch parses it: both read the same page cache, the hash
    runs at memory speed outside the interpreter lock, and done first it would add its whole
    time to every resume. Nothing torch returns is used, and no refusal of torch's reported,
    until the checksum has been compared, so a corrupt file is always refused as corrupt.
    What the overlap gives up is only that torch's parser may see corrupt bytes first; it
    faces arbitrary bytes anyway, since a forger recomputes an unkeyed checksum, and
    ``weights_only`` is what keeps a hostile pickle from running code.

    Not ``mmap=True``: a mapped storage is sliced from the file without checking its size
    against its zip record (a forged size reads the bytes that follow it, where the copying
    load refuses the file), and the optimizer state restored from it would either keep the
    file mapped for the whole run (a replaced checkpoint's disk space held, SIGBUS if the file
    is truncated) or need a private copy while the mapping is resident (a peak above the
    copying load's; BENCHMARKS.md).
    """

    with contextlib.ExitStack() as stack:
        verified: Callable[[], str]
        if length < OVERLAP_FROM:  # hashed first: a small corrupt file never reaches torch
            checksum = _compare_checksum(checksum_of_file(file, 0, length), expected, path)
            verified = lambda: checksum  # noqa: E731
        else:
            pool = stack.enter_context(
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3-checkpoint-hash"))
            hashing = pool.submit(checksum_of_file, file, 0, length, OVERLAP_CHUNK)
            verified = lambda: _compare_checksum(hashing.result(), expected, path)  # noqa: E731
        try:
            payload = _weights_only(
                lambda: torch.load(path, weights_only=True, map_location="cpu"),
                path, "torch.load(weights_only=True)")
        except CheckpointError:  # corrupt, then rewritten meanwhile, before torch's refusal
            verified()
            _check_unchanged(before, path)
            raise
        checksum = verified()
    _check_unchanged(before, path)
    return Verified(payload, checksum)


def _check_unchanged(before: os.stat_result, path: Path) -> None:
    """Refuse a file whose identity (device, inode, size, modification time) is no longer
    ``before``'s: it was replaced or modified while it was hashed and loaded."""
    if _identity(os.stat(path)) != _identity(before):
        raise CheckpointError("changed while it was read (replaced or modified while its "
                              "checksum was verified and it was loaded)", path=path)


def _compare_checksum(actual: bytes | None, expected: bytes, path: Path) -> str:
    """The hex checksum, once ``actual`` (None: the file ended early) matches ``expected``."""
    if actual is None:
        raise CheckpointError("is shorter than when it was opened (changed while read)",
                              path=path)
    if actual != expected:
        raise CheckpointError(
            f"checksum mismatch: the file hashes to {actual.hex()[:16]}…, its trailer "
            f"records {expected.hex()[:16]}…; the file is corrupt",
            path=path,
        )
    return actual.hex()


def _refuse_format(version: int, path: Path) -> None:
    problem = format_problem(version)
    if problem is not None:
        raise CheckpointError(problem, path=path)


def format_problem(version: object) -> str | None:
    """Why ``version`` cannot be read, or None for format 7."""
    if version == FORMAT_VERSION and type(version) is int:
        return None
    if type(version) is int and version in HISTORICAL_FORMATS:
        return (
            f"historical recipe format {version} is not supported: this loader reads format "
            f"{FORMAT_VERSION} only; resume it with the trainer release that wrote it, or start "
            "a new run"
        )
    return f"unknown checkpoint format {version!r}: this loader reads format {FORMAT_VERSION} only"


def _weights_only(load: Callable[[], Any], path: Path, unpickler: str) -> Any:
    """``load()`` (torch's weights-only unpickling); whatever it raises becomes one
    ``CheckpointError`` naming the file, the ``unpickler`` and torch's reason."""
    try:
        return load()
    except Exception as error:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
        raise CheckpointError(f"refused by {unpickler}: {_reason(error)}", path=path) from error


def _reason(error: Exception) -> str:
    text = str(error)
    marker = "WeightsUnpickler error:"
    if marker in text:  # the useful line of torch's long weights_only message
        text = text.split(marker, 1)[1]
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else 'no message'}"


def _identify_foreign(path: Path, file: BinaryIO, size: int, tail: bytes) -> str:
    """Why a file without a trailer at its end is refused: a displaced trailer (bytes
    appended), a cut-short save, a bare payload, a historical format, or neither."""
    if size == 0:
        return "is empty (0 bytes): not a checkpoint"
    found = tail.rfind(MAGIC)
    if found >= 0 and len(tail) - found > TRAILER_SIZE:
        return (f"has {len(tail) - found - TRAILER_SIZE} unexpected bytes after its k3 "
                "trailer")
    if found >= 0:
        return (f"is truncated: its k3 trailer ends after {len(tail) - found} of its "
                f"{TRAILER_SIZE} bytes")
    head = _head(file)
    if len(head) < 4 and b"PK\x03\x04".startswith(head):
        return f"is truncated: {size} bytes, the start of a zip and nothing more"
    if not head.startswith(b"PK\x03\x04"):  # not even a torch zip; never load it
        file.seek(0)
        return ("is not a k3 checkpoint (no k3-checkpoint trailer; starts with "
                f"{file.read(8)!r})")
    try:  # mmap: only the small pickle is read, not every tensor
        bare = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:  # the weights-only unpickler's refusal
        return ("has no k3-checkpoint trailer, and torch.load(weights_only=True) refuses "
                f"it: {_reason(error)}")
    except Exception:  # torch raises RuntimeError, EOFError, ... for a broken zip
        if path.name.endswith(".tmp"):
            return ("has no k3-checkpoint trailer and is not a complete torch file: a save "
                    f"cut short (the previous checkpoint, if any, is {path.name[:-4]})")
        return ("has no k3-checkpoint trailer and is not a complete torch file: a truncated "
                "copy (a save is published only once complete, so it is no save cut short)")
    version = bare.get("format_version") if isinstance(bare, Mapping) else None
    if version is None:
        return "is a torch file but not a k3 checkpoint (it has no format_version)"
    if version == FORMAT_VERSION:
        return (
            "is a bare format-7 payload without the k3-checkpoint trailer (written by "
            "torch.save, not save_checkpoint, or cut short by exactly its trailer), so its "
            "integrity cannot be verified"
        )
    return format_problem(version) or "is not a k3 checkpoint"


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make a rename or a new entry in ``directory`` durable (as ``save_checkpoint`` does
    after its rename). A no-op on Windows, which cannot open a directory, and on filesystems
    that refuse to sync one."""
    if os.name == "nt":
        return
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(descriptor)
