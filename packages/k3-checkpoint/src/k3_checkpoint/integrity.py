"""The integrity checksum: XXH3-128 (the ``xxhash`` package), at memory speed.

It detects corruption (a torn copy, bit rot, a truncated transfer); it cannot
authenticate, since whoever can rewrite a file can rewrite an unkeyed checksum. Code
execution is kept out by torch's weights-only unpickler, not by the checksum, so a fast
non-cryptographic hash with 128 bits (no accidental collision in practice) is the right
tool: a checkpoint is hashed on every save and every load.
"""

from __future__ import annotations

import os
from typing import BinaryIO

import xxhash

__all__ = [
    "ALGORITHM", "checksum_of_bytes", "checksum_of_file", "file_checksum", "running_checksum",
]  # fmt: skip

ALGORITHM = "xxh3-128"
"""The checksum's name, as headers and manifests record it."""

CHUNK = 1 << 20
"""Default read granularity: large enough for memory speed, small enough to stay cached."""


def checksum_of_bytes(data: bytes | bytearray | memoryview) -> bytes:
    """The 16-byte checksum of ``data``."""
    return xxhash.xxh3_128_digest(data)


def running_checksum() -> xxhash.xxh3_128:
    """A checksum fed piece by piece (``update``), whose ``digest()`` is
    ``checksum_of_bytes`` of the pieces joined: a writer hashes its bytes as it writes them
    rather than reading the file back."""
    return xxhash.xxh3_128()


def checksum_of_file(
    file: BinaryIO, start: int, stop: int, chunk: int = CHUNK
) -> bytes | None:
    """The checksum of bytes ``[start, stop)`` of the open ``file``, read ``chunk`` bytes at a
    time, or None when the file ends before ``stop`` (it shrank since its size was read)."""
    hasher = running_checksum()
    view = memoryview(bytearray(chunk))
    file.seek(start)
    remaining = stop - start
    while remaining > 0:
        got = file.readinto(view[: min(chunk, remaining)])  # type: ignore[attr-defined]
        if not got:
            return None
        hasher.update(view[:got])
        remaining -= got
    return hasher.digest()


def file_checksum(path: str | os.PathLike[str]) -> str:
    """The hex checksum of the whole file at ``path`` (e.g. a sharded checkpoint's files)."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        digest = checksum_of_file(file, 0, size)
    if digest is None:
        raise OSError(f"{path} shrank while it was read")
    return digest.hex()
