"""The file on disk: a 64-byte header, then the payload as ``torch.save`` wrote it.

Header (little-endian)::

    0   8  magic   b"\\x89K3CKPT\\n"
    8   4  format  7
    12  4  scheme  1 = sha256 over 4 MiB blocks
    16  8  length  payload bytes after the header
    24  32 digest  of those payload bytes (``k3_checkpoint.digest``)
    56  4  zero
    60  4  crc32   of bytes 0-59

Why a header and not a digest field inside the pickle: a digest cannot cover the bytes that hold
it, and checking it *before* unpickling means a corrupt file never reaches the zip and pickle
parsers. Together the header CRC, the exact length and the digest make every single bit of the
file matter: a flip or a cut anywhere is a ``CheckpointError``, never a half-read payload.
The payload itself is unpickled only by torch's weights-only unpickler (the one behind
``torch.load(weights_only=True)``), so a hostile pickle cannot run code (the digest is not a
signature: anyone can recompute it).

Writes are atomic: ``path.tmp`` is written with a blank header, the payload is hashed from the
file while ``torch.save`` writes it (the last blocks while its data is flushed to disk), the
header is filled in once it is complete, the file is fsynced, renamed over ``path`` (the file
it replaces is freed on a background thread), and the directory is fsynced. A crash at any
point leaves the previous ``path`` intact. Nothing reads ``.tmp`` in place of ``path``, and one
cut short mid-write has a blank header, which the reader refuses by name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import struct
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch

from . import unmemoized
from .buffer import PayloadBuffer
from .digest import TrailingHasher, read_and_digest, workers
from .errors import CheckpointError

__all__ = [
    "FORMAT_VERSION", "HISTORICAL_FORMATS", "fsync_directory", "read_payload", "write_payload",
]  # fmt: skip

FORMAT_VERSION = 7
"""The only format this package writes and reads."""

HISTORICAL_FORMATS = range(3, 7)
"""Formats 3-6: earlier trainer recipes, recognised so they are refused by name."""

MAGIC = b"\x89K3CKPT\n"  # non-ASCII first byte and a newline: text-mode mangling breaks it
_FIELDS = struct.Struct("<8sIIQ32s4x")
_CRC = struct.Struct("<I")
HEADER_SIZE = _FIELDS.size + _CRC.size
_SHA256_BLOCKS = 1  # digest scheme id: see digest.py


def pack_header(format_version: int, length: int, digest: bytes) -> bytes:
    """The 64-byte header for a payload of ``length`` bytes whose digest is ``digest``."""
    fields = _FIELDS.pack(MAGIC, format_version, _SHA256_BLOCKS, length, digest)
    return fields + _CRC.pack(zlib.crc32(fields))


def write_payload(path: str | os.PathLike[str], payload: Mapping[str, Any]) -> str:
    """Atomically write ``payload`` to ``path`` (see the module docstring); return its digest."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "w+b") as file:  # read too: the hasher maps what was written
            file.write(bytes(HEADER_SIZE))  # blank: marks an unfinished write
            with TrailingHasher(file, HEADER_SIZE) as writer:
                torch.save(dict(payload), writer, pickle_module=unmemoized)  # type: ignore[arg-type]
                # If the hashing lags (busy cores), the payload heads for the disk while the
                # last blocks hash, and the fsync below has little left but the header.
                digest = writer.finish(meanwhile=lambda: _sync_data(file.fileno()))
            file.seek(0)
            file.write(pack_header(FORMAT_VERSION, writer.length, digest))
            file.flush()
            os.fsync(file.fileno())
        _replace(temporary, path)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        cause = _os_error_behind(error)
        if cause is None:
            raise
        # torch's zip writer turns a failed write (disk full, quota, file size limit) into
        # a RuntimeError about stream positions; the caller needs the OSError behind it.
        raise OSError(cause.errno, cause.strerror or str(cause), str(temporary)) from error
    fsync_directory(path.parent)
    return digest.hex()


def _replace(temporary: Path, path: Path) -> None:
    """``os.replace(temporary, path)``, leaving the replaced file to be freed on another thread.

    A rename frees the file it replaces when nothing else holds it, and freeing is not free:
    22 ms for 96 MiB here (ext4 mounted with ``discard``), a sixth of the save. Holding the
    old file open across the rename moves that work to its last close, which one of the
    package's worker threads (``digest.workers``) does while the caller goes on (database
    engines delete obsolete files in the background for the same reason). The new file is in
    place either way; if the machine stops before the close, the filesystem frees the orphan
    when it mounts. Not on Windows, where an open file cannot be replaced."""
    held = _open_replaced(path)
    try:
        os.replace(temporary, path)
    finally:
        if held is not None:
            workers().submit(_close_replaced, held)


def _open_replaced(path: Path) -> int | None:
    """A read-only descriptor of the regular file at ``path`` (a link is not followed: the
    rename replaces the link), or None: nothing there, not a regular file (opening a FIFO or
    a device could block or act), not ours to read, or Windows."""
    if os.name == "nt":
        return None
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    with contextlib.suppress(OSError):
        if stat.S_ISREG(os.lstat(path).st_mode):
            return os.open(path, flags)
    return None


def _close_replaced(descriptor: int) -> None:
    os.close(descriptor)


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

    Checks the header, the length and the digest before unpickling, loads with torch's
    weights-only unpickler onto the CPU, and checks the format version. Formats 3-6 are
    refused by name; every other problem raises ``CheckpointError`` naming the file and the
    reason. The tensors share the memory the file was read into, as with
    ``torch.load(mmap=True)``: clone one you keep on its own.
    """
    return read_verified(path).payload


class Verified(NamedTuple):
    """A payload whose digest matched, with the memory its tensors view."""

    payload: dict[str, Any]
    digest: str
    """The payload's hex digest: the checkpoint's identity."""
    buffer: PayloadBuffer


def read_verified(
    path: str | os.PathLike[str], meanwhile: Callable[[], object] | None = None
) -> Verified:
    """``read_payload``, with the digest and the buffer (see ``PayloadBuffer.release_unused``).

    The file is read once into memory and hashed behind the read; the digest is checked over
    those bytes and the same bytes are unpickled, so no byte that was not verified reaches the
    unpickler, even if the file changes meanwhile. The payload's tensors view those bytes
    rather than being copied out of them (``buffer.py``).

    ``meanwhile``: work that needs no payload (a loader's checks of the live objects), run
    while the last bytes hash. What it raises is raised once the file has been read, verified
    and unpickled without error, as if it had run after this function.
    """
    path = Path(path)
    deferred: list[BaseException] = []

    def guarded() -> None:
        try:
            meanwhile()  # type: ignore[misc]
        except BaseException as error:  # raised below, after the file's own problems
            deferred.append(error)

    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            length, expected = _read_header(file, size, path)
            buffer = PayloadBuffer(length)
            actual = read_and_digest(file, buffer.view, guarded if meanwhile else None)
        if not actual:
            raise CheckpointError("is shorter than when it was opened (changed while read)")
        if actual != expected:
            raise CheckpointError(
                f"digest mismatch: the payload hashes to {actual.hex()[:16]}…, the header "
                f"records {expected.hex()[:16]}…; the file is corrupt",
                path=path,
            )
        payload = _weights_only(buffer.unpickle, path, "torch's weights_only=True unpickler")
    except OSError as error:
        raise CheckpointError(f"cannot be read: {error.strerror or error}", path=path) from error
    except CheckpointError as error:
        if error.path is not None:
            raise
        raise error.with_path(path) from error
    if not isinstance(payload, dict):
        raise CheckpointError(f"payload is a {type(payload).__name__}, not a dict", path=path)
    version = payload.get("format_version")
    if format_problem(version) is not None:
        raise CheckpointError(
            f"payload format_version {version!r} disagrees with the header's {FORMAT_VERSION}",
            path=path,
        )
    if deferred:
        raise deferred[0]
    return Verified(payload, actual.hex(), buffer)


def _sync_data(descriptor: int) -> None:
    """Start the payload's way to the disk early (the closing fsync makes it durable)."""
    if hasattr(os, "fdatasync"):
        os.fdatasync(descriptor)


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


def _read_header(file: BinaryIO, size: int, path: Path) -> tuple[int, bytes]:
    head = file.read(HEADER_SIZE)
    if size == 0:
        raise CheckpointError("is empty (0 bytes): not a checkpoint", path=path)
    if len(head) < len(MAGIC) and MAGIC.startswith(head):
        raise CheckpointError(f"is truncated: {size} bytes, not even a header", path=path)
    if head[: len(MAGIC)] != MAGIC:
        if head[: len(MAGIC)] == bytes(len(MAGIC)):
            raise CheckpointError(
                "has a blank header: a save was interrupted before it finished, so this file "
                "is not a checkpoint (the previous checkpoint is the file without .tmp)",
                path=path,
            )
        raise CheckpointError(_identify_foreign(path, head), path=path)
    if len(head) < HEADER_SIZE:
        raise CheckpointError(
            f"is truncated: {len(head)} of the header's {HEADER_SIZE} bytes", path=path
        )
    fields, (crc,) = head[: _FIELDS.size], _CRC.unpack(head[_FIELDS.size :])
    if zlib.crc32(fields) != crc:
        raise CheckpointError("header is corrupt (its CRC does not match)", path=path)
    _, version, digest_kind, length, digest = _FIELDS.unpack(fields)
    problem = format_problem(version)
    if problem is not None:
        raise CheckpointError(problem, path=path)
    if digest_kind != _SHA256_BLOCKS:
        raise CheckpointError(f"unknown digest scheme id {digest_kind}", path=path)
    if size < HEADER_SIZE + length:
        raise CheckpointError(
            f"is truncated: {size} bytes, the header promises {HEADER_SIZE + length}", path=path
        )
    if size > HEADER_SIZE + length:
        raise CheckpointError(
            f"has {size - HEADER_SIZE - length} unexpected bytes after the payload", path=path
        )
    return length, digest


def _weights_only(load: Callable[[], Any], path: Path, unpickler: str) -> Any:
    """``load()`` (torch's weights-only unpickling); whatever it raises becomes one
    ``CheckpointError`` naming the file, the ``unpickler`` and torch's reason."""
    try:
        return load()
    except Exception as error:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
        raise CheckpointError(f"refused by {unpickler}: {_reason(error)}", path=path) from error


def _torch_load(path: Path, **options: Any) -> Any:
    return _weights_only(
        lambda: torch.load(path, weights_only=True, map_location="cpu", **options),
        path,
        "torch.load(weights_only=True)",
    )


def _reason(error: Exception) -> str:
    text = str(error)
    marker = "WeightsUnpickler error:"
    if marker in text:  # the useful line of torch's long weights_only message
        text = text.split(marker, 1)[1]
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else 'no message'}"


def _identify_foreign(path: Path, head: bytes) -> str:
    """Why a file without the k3 header is refused: historical format, bare payload or neither."""
    if not head.startswith(b"PK\x03\x04"):  # not even a torch zip; never unpickle it
        return f"is not a k3 checkpoint (no k3-checkpoint header; starts with {head[:8]!r})"
    try:  # mmap: only the small pickle is read, not every tensor
        legacy = _torch_load(path, mmap=True)
    except CheckpointError:
        legacy = _torch_load(path)
    version = legacy.get("format_version") if isinstance(legacy, Mapping) else None
    if version is None:
        return "is a torch file but not a k3 checkpoint (it has no format_version)"
    if version == FORMAT_VERSION:
        return (
            "is a bare format-7 payload without the k3-checkpoint header (written by "
            "torch.save, not save_checkpoint), so its integrity cannot be verified"
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
